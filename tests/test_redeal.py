"""The rule that deals the rest of an interrupted epoch over a stream to another number of processes.

Every process reads the whole rest — first the batches the saving processes had read ahead, then the stream from
their states — and takes every ``M``-th batch of it, a round of ``M`` batches at a time: the way Accelerate's own
``IterableDatasetShard`` deals a stream, which the rule must equal where nothing was read ahead. The end of the epoch
follows Accelerate's rules too (``drop_last`` drops a last short round; otherwise it is completed with the first
samples read). The multi-process resumes (2 -> 1 -> 3, by sample ids) are in ``test_stream_resume.py``.
"""

import pytest
import torch
from accelerate.data_loader import IterableDatasetShard
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate

from trainfold import CheckpointError
from trainfold._src.backend.streams import deal, units_of


class Ids(IterableDataset):
    def __init__(self, ids):
        self.ids = list(ids)

    def __iter__(self):
        return iter(self.ids)


def _dealt(pieces, samples, unit, processes, drop_last):
    """Every process's batches, as lists of ids."""
    items = [(True, torch.tensor(p)) for p in pieces] + [(False, torch.tensor(s)) for s in samples]
    return [
        [
            b.tolist()
            for b in deal(
                iter(items), unit=unit, processes=processes, index=i, drop_last=drop_last, collate=default_collate
            )
        ]
        for i in range(processes)
    ]


def _accelerate(samples, unit, processes, drop_last):
    """What Accelerate's prepared loader gives each process of a stream (a plain DataLoader for one process)."""
    if processes == 1:
        return [[b.tolist() for b in DataLoader(Ids(samples), batch_size=unit, drop_last=drop_last)]]
    return [
        [
            b.tolist()
            for b in DataLoader(
                IterableDatasetShard(
                    Ids(samples), batch_size=unit, drop_last=drop_last, num_processes=processes, process_index=i
                ),
                batch_size=unit,
                drop_last=drop_last,
            )
        ]
        for i in range(processes)
    ]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 40), st.integers(1, 4), st.integers(1, 4), st.booleans())
def test_the_deal_is_accelerates(length, unit, processes, drop_last):
    """With nothing read ahead the rule deals a stream as Accelerate does."""
    assert _accelerate(range(length), unit, processes, drop_last) == _dealt(
        [], range(length), unit, processes, drop_last
    )


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 5), st.integers(0, 40), st.integers(1, 4), st.integers(1, 4), st.booleans())
def test_batches_read_ahead_come_first(pieces, length, unit, processes, drop_last):
    """Batch ``i`` of the rest (read-ahead batches first) goes to process ``i % M``, a whole round at a time, so the
    processes stay in step: every sample of the whole rounds once; a last short round dropped under ``drop_last``,
    else completed (several processes) or taken as it is (one)."""
    whole = [list(range(1000 + unit * p, 1000 + unit * (p + 1))) for p in range(pieces)]
    got = _dealt(whole, range(length), unit, processes, drop_last)

    sequence = whole + [list(range(i, min(i + unit, length))) for i in range(0, length, unit)]
    rounds = len(sequence) // processes
    if rounds and len(sequence[rounds * processes - 1]) < unit:
        rounds -= 1  # a short batch ends the sequence: its round is not whole
    dealt = sequence[: rounds * processes]
    left = sequence[rounds * processes :]
    assert [dealt[i::processes] for i in range(processes)] == [batches[:rounds] for batches in got]
    if drop_last or not left:
        assert all(len(batches) == rounds for batches in got)
    elif processes == 1:
        assert [left] == [batches[rounds:] for batches in got]
    else:  # the last round completed with samples already trained: every process one more batch, every sample trained
        assert all(len(batches) == rounds + 1 and len(batches[-1]) == unit for batches in got)
        assert {i for b in left for i in b} <= {i for batches in got for i in batches[-1]}


def test_a_last_round_is_completed():
    """A last round is completed with the first samples read and one process takes a short batch as it is."""
    assert [[[1000, 1001], [2, 3]], [[0, 1], [4, 0]]] == _dealt([[1000, 1001]], range(5), 2, 2, drop_last=False)
    assert [[[1000, 1001]], [[0, 1]]] == _dealt([[1000, 1001]], range(5), 2, 2, drop_last=True)
    assert [[[1000, 1001], [0, 1], [2]]] == _dealt([[1000, 1001]], range(3), 2, 1, drop_last=False)
    assert [[[1000, 1001]], [[1002, 1003]], [[1000, 1001]]] == _dealt(
        [[1000, 1001], [1002, 1003]], [], 2, 3, drop_last=False
    )


def test_batches_read_ahead_are_cut_or_joined_into_this_runs_batches():
    """Two processes each read ahead 4 samples; one process of batches of 8 takes them as one batch, and a dispatched
    batch of 16 becomes two of 8. Batches that do not add up, or hold what cannot be cut, are refused by name."""
    pair = [{"x": torch.arange(4)}, {"x": torch.arange(4, 8)}]
    assert [list(range(8))] == [b["x"].tolist() for b in units_of(pair, 8)]
    assert [[0, 1, 2, 3], [4, 5, 6, 7]] == [b["x"].tolist() for b in units_of([{"x": torch.arange(8)}], 4)]
    assert pair == units_of(pair, 4)  # already this run's batches: as they are
    with pytest.raises(CheckpointError, match=r"\(4, 4 samples\) cannot be dealt out as this run's batches of 3"):
        units_of(pair, 3)
    with pytest.raises(CheckpointError, match=r"cannot be dealt out as this run's batches of 2 \(.*str"):
        units_of([{"x": torch.arange(4), "text": ["a", "b", "c", "d"]}], 2)


def test_tuple_samples_are_dealt():
    """A stream of ``(x, y, id)`` samples, whose read-ahead batches default_collate made lists of tensors, is dealt
    like one of single tensors: a collated batch is never taken for a list of samples still to collate."""
    sample = lambda i: (torch.full((2,), float(i)), torch.tensor(i % 3), torch.tensor(i))
    ahead = [default_collate([sample(i) for i in range(1000, 1002)])]
    assert isinstance(ahead[0], list)
    items = [(True, b) for b in ahead] + [(False, sample(i)) for i in range(6)]

    got = [
        [
            b[2].tolist()
            for b in deal(iter(items), unit=2, processes=2, index=i, drop_last=False, collate=default_collate)
        ]
        for i in range(2)
    ]

    assert [[[1000, 1001], [2, 3]], [[0, 1], [4, 5]]] == got


@pytest.mark.parametrize(
    "parts, words",
    [
        ([[[2, 0], {}], [[2, 0], {}]], r"names the part \[2, 0\] twice"),
        ([[[2, 0], {}], [[3, 1], {}]], r"parts of streams split 2 and 3 ways"),
        ([[None, {}], [[2, 1], {}]], r"the whole stream and a part of it"),
        ([[[2, 1], {}]], r"Ids cannot be split \(it has no shard\(\)\)"),
    ],
)
def test_forged_redealt_parts_are_refused(parts, words):
    """A stream dealt anew records the parts still to read; a checkpoint naming one twice (trained twice), parts of
    different splits, the whole stream beside a part of it, or a part of a stream that cannot be split is refused."""
    from trainfold._src.backend.streams import StreamState, redeal

    saved = [StreamState("redealt", "test_redeal.Ids", 0, {"pieces": [], "parts": parts})]
    with pytest.raises(CheckpointError, match=words):
        redeal(Ids(range(8)), [], saved, "part", 0, 2)
