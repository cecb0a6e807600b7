"""History: a run's epoch records, read by metric name like a read-only mapping of names to their values."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainfold import History

names = st.sampled_from(["train_loss", "eval_loss", "eval_accuracy"])
epochs = st.lists(st.dictionaries(names, st.floats(allow_nan=False), min_size=1), max_size=6)


def _history(per_epoch):
    h = History()
    for epoch, values in enumerate(per_epoch, 1):
        h = h.add(epoch=epoch, step=10 * epoch, values=values)
    return h


def test_history_reads_by_name():
    h = _history([{"train_loss": 0.5}, {"train_loss": 0.25, "eval_loss": 0.3}])

    assert (0.5, 0.25) == h["train_loss"]
    assert (0.3,) == h.get("eval_loss")
    assert h.get("eval_accuracy") is None
    assert () == h.get("eval_accuracy", ())
    assert ("train_loss", "eval_loss") == h.keys()
    assert [("train_loss", (0.5, 0.25)), ("eval_loss", (0.3,))] == list(h.items())
    assert [(0.5, 0.25), (0.3,)] == list(h.values())


def test_history_iterates_records():
    """Iterating gives the records, oldest first (their epoch and update with each value), as ``len`` counts them."""
    h = _history([{"train_loss": 0.5}, {"train_loss": 0.25, "eval_loss": 0.3}])

    assert [("train_loss", 1, 10), ("train_loss", 2, 20), ("eval_loss", 2, 20)] == [
        (r.name, r.epoch, r.step) for r in h
    ]
    assert 3 == len(h)


@given(epochs)
def test_history_items_match_lookups(per_epoch):
    """Each item is a name and what ``h[name]`` gives; the names are those recorded, in order of first appearance."""
    h = _history(per_epoch)

    assert list(h.keys()) == list(dict.fromkeys(n for values in per_epoch for n in values))
    assert all(values == h[name] for name, values in h.items())


def test_history_missing_name_lists_the_recorded():
    with pytest.raises(KeyError, match=r"no metric 'eval_loss' has been recorded; recorded: \['train_loss'\]"):
        _history([{"train_loss": 0.5}])["eval_loss"]
