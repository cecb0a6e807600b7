"""Streamed data (iterable datasets): a run interrupted inside an epoch continues where its checkpoint stands.

A stream that can say where it is (``state_dict()``/``load_state_dict()``: a ``datasets`` stream, torchdata's
``StatefulDataLoader``, a user's class) continues from the state its checkpoint holds, reading none of the
consumed part again. Any other stream has no sampler's order to skip through: the resumed epoch reads the
consumed part again and drops it. Either way every sample is trained on once and the parameters equal an
uninterrupted run's bit for bit. The data is generated here: Hugging Face ``datasets`` streams over shards
(with and without a shuffle buffer), and torch ``IterableDataset`` classes of a user's, with and without a state.
"""

import json
import multiprocessing
import warnings

import helpers
import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration

from trainfold import (
    CheckpointError,
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    load_checkpoint,
    loop,
    make_step,
    run_epoch,
    testing,
)

SAMPLES, BATCH = 512, 16  # 32 batches an epoch


class Numbers(torch.utils.data.IterableDataset):
    """A user's own stream: the samples of a seeded permutation of its epoch, without a state of its own.

    ``yielded`` counts the samples it yields, in every process and worker (shared memory).
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.yielded = multiprocessing.Value("l", 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch))
        worker = torch.utils.data.get_worker_info()
        if worker is not None:  # each worker its share, as a sharded stream deals them
            order = order[worker.id :: worker.num_workers]
        return order.tolist()

    def sample(self, i: int) -> dict:
        with self.yielded.get_lock():
            self.yielded.value += 1
        return {"x": torch.tensor([i / SAMPLES]), "id": torch.tensor(i)}

    def __iter__(self):
        for i in self.order():
            yield self.sample(i)


class StatefulNumbers(Numbers):
    """The same stream, able to say where it is: how far into its (worker's) order it has yielded."""

    def __init__(self) -> None:
        super().__init__()
        self.position = self.start = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.start = state["epoch"], state["position"]

    def __iter__(self):
        start, self.start = self.start, 0
        for self.position, i in enumerate(self.order()[start:], start + 1):
            yield self.sample(i)


def _counted(example):
    _counted.yielded.value += 1
    return example


def _stream(kind: str):
    if kind.startswith("datasets"):
        from datasets import Dataset

        data = Dataset.from_dict({"x": [[i / SAMPLES] for i in range(SAMPLES)], "id": list(range(SAMPLES))})
        stream = data.to_iterable_dataset(num_shards=16)
        if kind != "datasets-plain":
            # a shuffle buffer of 64 (its state leaves the buffer out: read again), or the shards' order alone (O(1))
            stream = stream.shuffle(seed=7, buffer_size=64 if kind == "datasets" else 1)
        _counted.yielded = multiprocessing.Value("l", 0)
        stream = stream.map(_counted).with_format("torch")
        stream.yielded = _counted.yielded
        return stream
    return StatefulNumbers() if kind == "stateful" else Numbers()


def _setup(kind: str, workers: int, stateful_loader: bool = False, cpu: bool = True, dispatch: bool | None = None):
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful_loader, dispatch_batches=dispatch)
    ctx = Context(accelerator=Accelerator(cpu=cpu, dataloader_config=config))
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(_stream(kind), batch_size=BATCH, num_workers=workers))
    return ctx, state, dl


def _yielded(dl) -> int:
    return dl.base_dataloader.dataset.yielded.value


class Crash(Exception):
    """The process dies here (no run-end save follows, as after kill -9)."""


def _loss(trained, crash_after=None):
    def loss_fn(model, batch):
        if len(trained) == crash_after:
            raise Crash
        trained.extend(batch["id"].tolist())  # (on CUDA, one sync a batch: a test's bookkeeping)
        return ((model(batch["x"]) - batch["x"].sin()) ** 2).mean()

    return loss_fn


@pytest.mark.parametrize("kind, workers", [("datasets", 2), ("own", 0), ("own", 2)])
def test_a_stream_resumed_mid_epoch(kind, workers, tmp_path):
    """The issue's run: checkpoints every 10 updates, killed after update 23, resumed from update 20 (batch 20 of 32)."""
    ctx, state, dl = _setup(kind, workers)
    expected_ids: list[int] = []
    expected = loop(run_epoch(ctx, make_step(ctx, _loss(expected_ids)), dl), max_epochs=2)(state)
    ctx.close()

    ctx, state, dl = _setup(kind, workers)
    before: list[int] = []
    with pytest.raises(Crash):
        run_epoch(
            ctx, checkpoint_every(ctx, 10, tmp_path)(make_step(ctx, _loss(before, crash_after=23 * BATCH))), dl, state
        )
    ctx.close()
    assert tmp_path / "ckpt-0000000020" == latest_checkpoint(tmp_path)

    ctx, state, dl = _setup(kind, workers)
    after: list[int] = []
    with pytest.warns(
        UserWarning, match=r"stopped at batch 20 of epoch 0.*reading the epoch's first 21 batches \(336 samples\) again"
    ) as caught:
        resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
        resumed = loop(run_epoch(ctx, make_step(ctx, _loss(after)), dl), max_epochs=2)(resumed)
    ctx.close()

    assert 1 == len(caught)  # once per run, not once per resumed epoch
    assert 2 * 32 == resumed.step  # never a second pass over the consumed part
    first_epoch = before[: 20 * BATCH] + after[: 12 * BATCH]
    assert sorted(first_epoch) == list(range(SAMPLES))  # every sample of the interrupted epoch once
    assert expected_ids == first_epoch + after[12 * BATCH :]  # in the uninterrupted run's order
    testing.assert_params_equal(expected, resumed)
    assert expected.history == resumed.history


@pytest.mark.parametrize("dispatch", [None, True], ids=["each-process-reads", "dispatched"])
def test_a_stream_saved_at_its_last_batch(dispatch, tmp_path):
    """The save at update 32 comes before run_epoch closes the epoch, and the loader has read nothing ahead (Accelerate's
    dispatching loop, too, flags the last batch before it yields it): the resume only closes the epoch, reading nothing."""
    ctx, state, dl = _setup("own", 0, dispatch=dispatch)
    state = run_epoch(ctx, checkpoint_every(ctx, 32, tmp_path)(make_step(ctx, _loss([]))), dl, state)
    ctx.close()

    ctx, state, dl = _setup("own", 0, dispatch=dispatch)
    trained: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
        resumed = loop(run_epoch(ctx, make_step(ctx, _loss(trained)), dl), max_epochs=2)(resumed)
    ctx.close()
    assert (2, 64) == (resumed.epoch, resumed.step)
    assert SAMPLES == len(trained) == _yielded(dl)  # epoch 1 alone, read once


# --- streams that say where they are: O(1) ------------------------------------------------------------------

O1_CASES = [
    ("stateful", 0, False),  # a user's class, read in this process: its own state
    ("datasets-shards", 0, False),  # a datasets stream, its shards shuffled: its own state
    ("datasets", 0, False),  # a datasets stream with a shuffle buffer of 64: its state holds the buffer
    ("stateful", 2, True),  # torchdata's StatefulDataLoader collects its two workers' states
    # (shuffled shards read by workers: datasets 5.2 fails to load its own state there, IndexError in its load_state_dict)
    ("datasets-plain", 2, True),
]


def _interrupted(kind, workers, stateful_loader, root, crash_after):
    """A run that saves every 10 updates and dies after ``crash_after`` updates; the ids it trained."""
    ctx, state, dl = _setup(kind, workers, stateful_loader)
    trained: list[int] = []
    with pytest.raises(Crash):
        loop(
            run_epoch(
                ctx,
                checkpoint_every(ctx, 10, root)(make_step(ctx, _loss(trained, crash_after=crash_after * BATCH))),
                dl,
            ),
            max_epochs=2,
        )(state)
    ctx.close()
    return trained


def _resumed(kind, workers, stateful_loader, root, crash_after=None):
    """The run resumed from the root's newest checkpoint (crashing again after ``crash_after`` updates, if given)."""
    ctx, state, dl = _setup(kind, workers, stateful_loader)
    trained: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no replay warning: nothing is read again
        warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
        resumed = load_checkpoint(ctx, latest_checkpoint(root), state)
        run = loop(
            run_epoch(
                ctx,
                checkpoint_every(ctx, 10, root)(
                    make_step(ctx, _loss(trained, crash_after=crash_after and crash_after * BATCH))
                ),
                dl,
            ),
            max_epochs=2,
        )
        if crash_after is not None:
            with pytest.raises(Crash):
                run(resumed)
            resumed = None
        else:
            resumed = run(resumed)
    ctx.close()
    return resumed, trained, _yielded(dl)


@pytest.mark.parametrize("kind, workers, stateful_loader", O1_CASES)
def test_a_stateful_stream_reads_only_the_rest(kind, workers, stateful_loader, tmp_path):
    """Killed after update 23, resumed from update 20: the stream yields the rest of epoch 0 (after the batch the
    checkpoint holds, read ahead) and epoch 1, nothing consumed again; ids, parameters and history as uninterrupted."""
    ctx, state, dl = _setup(kind, workers, stateful_loader)
    expected_ids: list[int] = []
    expected = loop(run_epoch(ctx, make_step(ctx, _loss(expected_ids)), dl), max_epochs=2)(state)
    ctx.close()

    before = _interrupted(kind, workers, stateful_loader, tmp_path, crash_after=23)
    resumed, after, yielded = _resumed(kind, workers, stateful_loader, tmp_path)

    assert 2 * 32 == resumed.step
    assert expected_ids == before[: 20 * BATCH] + after  # every sample once, in the uninterrupted order
    testing.assert_params_equal(expected, resumed)
    assert expected.history == resumed.history
    # read: the rest of epoch 0 after batch 21 (held by the checkpoint), and epoch 1; with workers, at most what
    # each worker prefetches (2 batches) beyond that: never the 336 consumed samples again
    rest = SAMPLES - 21 * BATCH + SAMPLES
    assert rest <= yielded <= rest + (2 * workers * 2 * BATCH)


@pytest.mark.parametrize("kind, workers, stateful_loader", [("stateful", 0, False), ("datasets-plain", 2, True)])
def test_a_second_resume_in_the_same_epoch(kind, workers, stateful_loader, tmp_path):
    """The datasets#8308 case: resumed at update 10, killed again after 23, resumed from 20 (a state saved by a resumed stream)."""
    ctx, state, dl = _setup(kind, workers, stateful_loader)
    expected_ids: list[int] = []
    expected = loop(run_epoch(ctx, make_step(ctx, _loss(expected_ids)), dl), max_epochs=2)(state)
    ctx.close()

    first = _interrupted(kind, workers, stateful_loader, tmp_path, crash_after=13)
    _, second, _ = _resumed(kind, workers, stateful_loader, tmp_path, crash_after=13)  # from update 10 to 23
    assert tmp_path / "ckpt-0000000020" == latest_checkpoint(tmp_path)
    resumed, third, _ = _resumed(kind, workers, stateful_loader, tmp_path)

    assert expected_ids == first[: 10 * BATCH] + second[: 10 * BATCH] + third
    testing.assert_params_equal(expected, resumed)


def test_a_loader_that_cannot_take_the_state(tmp_path):
    """Saved by a stateful stream, resumed over a stream without a state: a CheckpointError naming both, nothing trained."""
    _interrupted("stateful", 0, False, tmp_path, crash_after=13)
    ctx, state, dl = _setup("plain", 0)
    resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
    trained: list[int] = []
    with pytest.raises(
        CheckpointError, match=r"said by a test_streams\.StatefulNumbers \(dataset\).*Numbers cannot say where it is"
    ):
        run_epoch(ctx, make_step(ctx, _loss(trained)), dl, resumed)
    ctx.close()
    assert [] == trained and 0 == _yielded(dl)


def test_another_number_of_workers_is_refused(tmp_path):
    """A loader state saved with two workers is refused with another number."""
    _interrupted("stateful", 2, True, tmp_path, crash_after=13)
    ctx, state, dl = _setup("stateful", 1, True)
    resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
    with pytest.raises(
        CheckpointError, match="the states of 2 loader worker.*num_workers=1.*Resume with num_workers=2"
    ):
        run_epoch(ctx, make_step(ctx, _loss([])), dl, resumed)
    ctx.close()


def test_a_stream_state_of_another_kind_of_source_is_refused_naming_both(tmp_path):
    _interrupted("stateful", 0, False, tmp_path, crash_after=13)
    ctx, state, dl = _setup("datasets-shards", 0)
    resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
    with pytest.raises(
        CheckpointError,
        match=r"state of a test_streams\.StatefulNumbers \(dataset\).*said by a datasets\..*IterableDataset \(dataset\)",
    ):
        run_epoch(ctx, make_step(ctx, _loss([])), dl, resumed)
    ctx.close()


def _buffered(fmt, epoch=0, node=None, swap=True):
    """A datasets stream of 600 samples in 8 shards through a shuffle buffer of 64, as ``fmt`` formats it; at ``epoch``,
    and ``node`` = (rank, world) split by node. ``swap``: its buffer kept in its state, as ``ctx.prepare_loaders`` does."""
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    from trainfold._src.backend.shuffle_buffer import keep_buffers_in_state

    data = Dataset.from_dict({"id": list(range(600)), "raw": [bytes([i % 251]) * (i % 5) for i in range(600)]})
    stream = data.to_iterable_dataset(num_shards=8).shuffle(seed=5, buffer_size=64)
    stream = stream.with_format(fmt) if fmt else stream
    if node is not None:
        stream = split_dataset_by_node(stream, rank=node[0], world_size=node[1])
    if swap:
        assert keep_buffers_in_state(stream) == 1
    stream.set_epoch(epoch)
    return stream


def _ids_of(samples):
    return [int(s["id"][0].as_py() if hasattr(s["id"], "to_pylist") else s["id"]) for s in samples]


@pytest.mark.parametrize("fmt", [None, "arrow", "torch"], ids=["rows", "arrow", "torch"])
@pytest.mark.parametrize("epoch, node", [(0, None), (1, None), (0, (1, 2))], ids=["epoch-0", "epoch-1", "node-1-of-2"])
def test_a_shuffle_buffer_in_the_state_yields_datasets_order_and_resumes_anywhere(fmt, epoch, node):
    """``ctx.prepare_loaders`` swaps a datasets stream's shuffle buffer for one whose state holds the buffer: the
    stream yields datasets' own order (each path: rows, Arrow tables, formatted), and its state, saved after any
    sample (inside a round of the buffer's yields, at a round's end, at the stream's end) and loaded into a new stream,
    yields exactly the rest."""
    from trainfold._src.checkpoint.codec import Encoder, decode

    theirs = _ids_of(_buffered(fmt, epoch, node, swap=False))
    assert _ids_of(_buffered(fmt, epoch, node)) == theirs and len(set(theirs)) == len(theirs)
    for stop in (1, 31, 32, 33, len(theirs) // 2, len(theirs) - 1, len(theirs)):
        stream = _buffered(fmt, epoch, node)
        samples = iter(stream)
        first = _ids_of(next(samples) for _ in range(stop))
        encoder = Encoder()
        written = json.loads(json.dumps(encoder.encode(stream.state_dict(), "stream")))  # as a checkpoint holds it
        again = _buffered(fmt, epoch, node)
        again.load_state_dict(decode(written, encoder.tensors))

        assert first + _ids_of(again) == theirs, stop


@pytest.mark.parametrize(
    "kind, workers, stateful_loader, why",
    [
        (
            "stateful",
            2,
            False,
            "its StatefulNumbers has a state, but 2 workers read it and a plain DataLoader does not collect their states.*use_stateful_dataloader=True",
        ),
        ("plain", 0, False, "its Numbers cannot say where it is: give it state_dict\\(\\) and load_state_dict\\(\\)"),
    ],
)
def test_a_stream_read_again_says_why_and_how_to_make_the_resume_o1(kind, workers, stateful_loader, why, tmp_path):
    _interrupted(kind, workers, stateful_loader, tmp_path, crash_after=13)
    ctx, state, dl = _setup(kind, workers, stateful_loader)
    resumed = load_checkpoint(ctx, latest_checkpoint(tmp_path), state)
    with pytest.warns(
        UserWarning, match=rf"reading the epoch's first 11 batches \(176 samples\) again.*read again because {why}"
    ):
        run_epoch(ctx, make_step(ctx, _loss([])), dl, resumed)
    ctx.close()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda doc: doc["stream"].update(holder="sampler"), "stream holder 'sampler'"),
        (lambda doc: doc["stream"].update(workers=-1), "'stream workers' is -1"),
        (lambda doc: doc["stream"].pop("state"), "not {holder, kind, workers, state}"),
        (lambda doc: doc.update(dispatched="yes"), "dispatched is 'yes', not a bool"),
        (lambda doc: doc.update(dealt="half"), "dealt is 'half', not 'whole' or 'part'"),
    ],
)
def test_a_damaged_stream_state_is_refused_by_load_checkpoint_naming_it(change, match, tmp_path):
    _interrupted("stateful", 0, False, tmp_path, crash_after=13)
    folder = latest_checkpoint(tmp_path)
    helpers.edit_signed_json(folder, "rank-0.json", change)
    ctx, state, dl = _setup("stateful", 0)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ctx, folder, state)
    ctx.close()


@pytest.mark.parametrize(
    "state, match",
    [
        (
            lambda saved: saved,
            "not one of a stream dealt anew",
        ),  # a dataset's state named the state of an epoch dealt anew
        (
            lambda saved: {"__dict__": [["pieces", []], ["parts", [[[2, 5], saved]]]]},
            r"names a part \[\[2, 5\], .*not \[processes, index\] or null",
        ),
        (
            lambda saved: {"__dict__": [["pieces", []], ["parts", [["whole", saved]]]]},
            r"not \[processes, index\] or null",
        ),
    ],
)
def test_a_damaged_redealt_state_is_refused(state, match, tmp_path):
    """The state an epoch dealt anew on another number of processes records (the batches still to come, each part of
    the stream still to read as [processes, index] and its state), forged: refused when the epoch starts, nothing read."""
    _interrupted("stateful", 0, False, tmp_path, crash_after=13)
    folder = latest_checkpoint(tmp_path)
    assert (
        "whole" == json.loads((folder / "rank-0.json").read_text())["dealt"]
    )  # one process: its state is the whole stream's

    def forge(doc):  # (written as the codec writes a mapping)
        doc["stream"]["holder"] = "redealt"
        doc["stream"]["state"] = state(doc["stream"]["state"])

    helpers.edit_signed_json(folder, "rank-0.json", forge)
    ctx, state_, dl = _setup("stateful", 0)
    resumed = load_checkpoint(ctx, folder, state_)
    with pytest.raises(CheckpointError, match=match):
        run_epoch(ctx, make_step(ctx, _loss([])), dl, resumed)
    assert 0 == dl.base_dataloader.dataset.yielded.value
    ctx.close()


def test_a_stream_saved_with_its_last_read_ahead(tmp_path):
    """Saved at update 31 of 32: the checkpoint holds batch 32; the resumed epoch trains it and reads nothing of epoch 0."""
    ctx, state, dl = _setup("stateful", 0)
    expected_ids: list[int] = []
    expected = loop(run_epoch(ctx, make_step(ctx, _loss(expected_ids)), dl), max_epochs=2)(state)
    ctx.close()

    ctx, state, dl = _setup("stateful", 0)
    before: list[int] = []
    with pytest.raises(Crash):
        run_epoch(
            ctx, checkpoint_every(ctx, 31, tmp_path)(make_step(ctx, _loss(before, crash_after=31 * BATCH))), dl, state
        )
    ctx.close()
    resumed, after, yielded = _resumed("stateful", 0, False, tmp_path)

    assert expected_ids == before + after
    testing.assert_params_equal(expected, resumed)
    assert SAMPLES == yielded  # epoch 1 alone: the stream had nothing left of epoch 0


def _killed_at_23_and_resumed(kind, root, **setup):
    """The run three times, set up with ``setup``: uninterrupted; saving every 10 updates and killed after update 23;
    resumed from update 20. Returns (the ids and state of the first, the ids the second trained, those the third did,
    its state, its warnings, its loader)."""
    ctx, state, dl = _setup(kind, 0, **setup)
    expected_ids: list[int] = []
    expected = loop(run_epoch(ctx, make_step(ctx, _loss(expected_ids)), dl), max_epochs=2)(state)
    ctx.close()

    ctx, state, dl = _setup(kind, 0, **setup)
    before: list[int] = []
    with pytest.raises(Crash):
        run_epoch(
            ctx, checkpoint_every(ctx, 10, root)(make_step(ctx, _loss(before, crash_after=23 * BATCH))), dl, state
        )
    ctx.close()

    ctx, state, dl = _setup(kind, 0, **setup)
    after: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = load_checkpoint(ctx, latest_checkpoint(root), state)
        resumed = loop(run_epoch(ctx, make_step(ctx, _loss(after)), dl), max_epochs=2)(resumed)
    ctx.close()
    return (expected_ids, expected), before, after, resumed, [str(w.message) for w in caught], dl


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_stream_process_0_dispatches_resumes_to_the_uninterrupted_run(kind, tmp_path):
    """dispatch_batches=True (Accelerate's default for a stream wherever it places batches: on a GPU) on one process:
    a DataLoaderDispatcher. Killed after update 23 and resumed from 20, from the state or by reading again. (Before,
    checkpoint_every refused the epoch at its first step, saying the loader was not prepared.)"""
    from accelerate.data_loader import DataLoaderDispatcher

    (expected_ids, expected), before, after, resumed, caught, dl = _killed_at_23_and_resumed(
        kind, tmp_path, dispatch=True
    )
    assert type(dl) is DataLoaderDispatcher
    assert expected_ids == before[: 20 * BATCH] + after
    testing.assert_params_equal(expected, resumed)
    assert (kind == "plain") == any(
        "process 0 reading the epoch's first 21 batches (336 samples) again" in w for w in caught
    )
    # from the state: the rest of epoch 0 after the batch the checkpoint holds, and epoch 1
    assert _yielded(dl) == (SAMPLES - 21 * BATCH + SAMPLES if kind == "stateful" else SAMPLES + SAMPLES)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: Accelerate dispatches a stream's batches where it places them"
)
@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_a_dispatched_stream_on_a_gpu(kind, tmp_path):
    """On a GPU, Accelerate's default for an iterable dataset is to dispatch it (DataLoaderDispatcher), on one process too:
    killed after update 23, resumed from update 20, from the stream's state or by reading it again."""
    from accelerate.data_loader import DataLoaderDispatcher

    (expected_ids, expected), before, after, resumed, _, dl = _killed_at_23_and_resumed(kind, tmp_path, cpu=False)
    assert type(dl) is DataLoaderDispatcher
    assert expected_ids == before[: 20 * BATCH] + after
    testing.assert_params_equal(expected, resumed)


def _linear_over(stream, batch_size):
    """A fresh Context, Linear(1, 1) with SGD, and a prepared loader of ``stream``."""
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(stream, batch_size=batch_size))
    return ctx, state, dl


class _Short(torch.utils.data.IterableDataset):
    """A stream without a state, of ``n`` samples."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return ({"x": torch.tensor([i / 64]), "id": torch.tensor(i)} for i in range(self.n))


def test_a_shorter_stream_read_again_is_refused(tmp_path):
    """A stream read again on a resume that ends before the batches the checkpoint had trained (it changed, or the
    checkpoint's position is forged) is refused with both counts, before a step."""

    def setup(n):
        return _linear_over(_Short(n), 4)

    ctx, state, dl = setup(32)
    step = checkpoint_every(ctx, 5, tmp_path)(make_step(ctx, _loss([])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stream is read again on a resume: said at the save
        run_epoch(ctx, step, dl, state, max_batches=6)
    ctx.close()

    ctx, fresh, dl = setup(12)  # 3 batches: fewer than the 5 the checkpoint trained
    resumed = load_checkpoint(ctx, tmp_path, fresh)
    trained = []
    with (
        warnings.catch_warnings(),
        pytest.raises(
            CheckpointError,
            match=r"the stream ended after 3 of the 6 batches of "
            r"this epoch that the checkpoint had read",
        ),
    ):
        warnings.simplefilter("ignore")  # it is read again: said
        run_epoch(ctx, make_step(ctx, _loss(trained)), dl, resumed)
    assert [] == trained
    ctx.close()


def _json_shards(folder, sizes):
    folder.mkdir(exist_ok=True)
    for f in folder.glob("*.jsonl"):
        f.unlink()
    start = 0
    for k, n in enumerate(sizes):
        (folder / f"part-{k}.jsonl").write_text(
            "".join(json.dumps({"x": [i / 64], "id": i}) + "\n" for i in range(start, start + n))
        )
        start += n


def _json_setup(folder):
    from datasets import load_dataset

    files = sorted(str(p) for p in folder.glob("*.jsonl"))
    return _linear_over(load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch"), 4)


@pytest.mark.parametrize(
    "change, words",
    [
        (None, None),
        ([16, 20, 16, 16], r"part-1\.jsonl .*changed size"),
        ([16, 16, 16, 16, 16], r"part-4\.jsonl .*added"),
        ([16, 16, 16], r"part-3\.jsonl .*removed"),
    ],
)
def test_a_changed_stream_source_is_refused(change, words, tmp_path):
    """A datasets stream records its data files (names and sizes) and shards with its position: a resume onto files
    rewritten, added or removed since is refused naming the file, before a step; the same files resume."""
    data = tmp_path / "data"
    _json_shards(data, [16, 16, 16, 16])
    ctx, state, dl = _json_setup(data)
    save = checkpoint_every(ctx, 5, tmp_path / "root")(make_step(ctx, _loss([])))
    run_epoch(ctx, save, dl, state, max_batches=5)
    ctx.close()
    if change is not None:
        _json_shards(data, change)

    ctx, fresh, dl = _json_setup(data)
    resumed = load_checkpoint(ctx, tmp_path / "root", fresh)
    trained = []
    if words is None:
        run_epoch(ctx, make_step(ctx, _loss(trained)), dl, resumed)
        assert list(range(20, 64)) == trained  # batches 6.. of 16: the rest, once
    else:
        with pytest.raises(CheckpointError, match=r"the stream's source changed since the checkpoint: " + words):
            run_epoch(ctx, make_step(ctx, _loss(trained)), dl, resumed)
        assert [] == trained
    ctx.close()


class _Versioned(Numbers):
    """A user's stream that says what data it reads (``source_id()``): here, a version of its own."""

    version = "v1"

    def source_id(self):
        return {"version": self.version}


def test_a_users_stream_source_id_is_checked(tmp_path):
    def setup(version):
        stream = _Versioned()
        stream.version = version
        return _linear_over(stream, BATCH)

    ctx, state, dl = setup("v1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read again on a resume: said
        run_epoch(ctx, checkpoint_every(ctx, 3, tmp_path)(make_step(ctx, _loss([]))), dl, state, max_batches=3)
    ctx.close()
    ctx, fresh, dl = setup("v2")
    resumed = load_checkpoint(ctx, tmp_path, fresh)
    with (
        warnings.catch_warnings(),
        pytest.raises(CheckpointError, match=r"source changed since the checkpoint: version was 'v1', now 'v2'"),
    ):
        warnings.simplefilter("ignore")
        run_epoch(ctx, make_step(ctx, _loss([])), dl, resumed)
    ctx.close()
