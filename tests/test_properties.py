"""Properties over batch sizes, accumulation steps, dataset sizes and schedules (hypothesis)."""

import math

import pytest
import torch
from accelerate import Accelerator
from hypothesis import assume, given, settings, strategies as st

from trainfold import Context, TrainState, evaluate, loop, make_step, run_epoch, testing, warmup_cosine, warmup_linear


def _setup(n, batch_size, ga):
    testing.reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(testing.regression_data(n), batch_size=batch_size))
    return ctx, state, dl


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), batch_size=st.integers(1, 8), ga=st.integers(1, 4), epochs=st.integers(1, 3))
def test_counters_and_epoch_records_are_always_right(n, batch_size, ga, epochs):
    """micro_step counts batches; step counts updates: ceil(batches / ga) an epoch (the last group is flushed)."""
    batches = math.ceil(n / batch_size)
    assume(batches >= ga)
    ctx, state, dl = _setup(n, batch_size, ga)

    final = loop(run_epoch(ctx, make_step(ctx, testing.mse_loss), dl), max_epochs=epochs)(state)

    assert epochs * batches == final.micro_step
    assert epochs * math.ceil(batches / ga) == final.step
    assert (epochs, 0) == (final.epoch, final.batch_in_epoch)
    assert [(e + 1) for e in range(epochs)] == [r.epoch for r in final.history if r.name == "train_loss"]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 50), batch_size=st.integers(1, 16))
def test_evaluate_counts_every_sample_once(n, batch_size):
    """The mean of y over the dataset, through batch means weighted by real samples, is exact."""
    ctx, state, dl = _setup(n, batch_size, 1)

    def y_mean(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y), {"y": y.mean()}

    metrics = evaluate(ctx, y_mean, dl, state).metrics

    y = dl.dataset.tensors[1]
    assert math.isclose(metrics["eval_y"], y.double().mean().item(), rel_tol=1e-5, abs_tol=1e-6)


schedule_args = st.tuples(st.floats(1e-4, 10.0), st.integers(0, 50), st.integers(1, 200), st.floats(0.0, 1e-4)).filter(
    lambda a: a[1] <= a[2]
)


@settings(max_examples=100, deadline=None)
@given(args=schedule_args, kind=st.sampled_from([warmup_cosine, warmup_linear]))
def test_schedules_rise_then_fall_within_their_bounds(args, kind):
    peak, warmup, total, end = args
    schedule = kind(peak, warmup_steps=warmup, total_steps=total, end_lr=end)
    values = [schedule(k) for k in range(total + 5)]

    assert all(-1e-12 <= v <= peak + 1e-12 for v in values)
    assert all(a <= b + 1e-12 for a, b in zip(values[: warmup - 1], values[1:warmup]))  # rises during warmup
    if warmup < total:
        assert math.isclose(values[warmup], peak)  # the peak, where the decay starts
    assert all(a + 1e-12 >= b for a, b in zip(values[warmup:], values[warmup + 1 :]))  # never rises after
    assert math.isclose(values[total], end, abs_tol=1e-9) and values[-1] == values[total]


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=150), mask=st.booleans())
def test_running_sums_equal_what_was_added(values, mask):
    """RunningSums holds up to FOLD_EVERY batches before adding them; its sums are the plain sums all the same."""
    from trainfold._src.base.running_sums import FOLD_EVERY, RunningSums

    sums = RunningSums.zero("cpu", mask_nonfinite=mask)
    for v in values:
        sums = sums.add(torch.tensor(v), {"twice": torch.tensor(2 * v)})

    assert len(values) % FOLD_EVERY == len(sums.pending)
    assert math.isclose(sum(values), sums.loss.item(), rel_tol=1e-4, abs_tol=1e-2)
    assert math.isclose(2 * sum(values), sums.aux["twice"].item(), rel_tol=1e-4, abs_tol=1e-2)


@settings(max_examples=60, deadline=None)
@given(parents=st.lists(st.integers(0, 10**6), min_size=1, max_size=160))
def test_running_sums_are_values_whatever_earlier_sums_are_added_to_again(parents):
    """Sums added to in a tree (a step called again on an older state, a branch of a sweep): each sums holds exactly
    the batches on its own path from the first, pending and folded, whatever was added to the others since."""
    from trainfold._src.base.running_sums import FOLD_EVERY, RunningSums

    sums, paths = [RunningSums.zero("cpu")], [[]]
    for i, parent in enumerate(parents):
        parent %= len(sums)  # any sums made so far: the newest, or an older one
        value = float(i + 1)
        sums.append(sums[parent].add(torch.tensor(value), {}))
        paths.append([*paths[parent], value])

    for made, path in zip(sums, paths):
        assert [loss.item() for loss, _ in made.pending] == path[len(path) // FOLD_EVERY * FOLD_EVERY :]
        assert sum(path) == made.loss.item()  # integers below 2**24: exact in float32


_CHANGES = {
    "step": st.integers(0, 10**6),
    "micro_step": st.integers(0, 10**6),
    "batch_in_epoch": st.integers(0, 10**6),
    "stop": st.sampled_from(
        [None, __import__("trainfold").Stop("max_steps", final=True), __import__("trainfold").Stop("x", finished=True)]
    ),
    "sums": st.just(None).map(lambda _: __import__("trainfold").RunningSums.zero("cpu")),
    "run_id": st.text(max_size=4),
}


@settings(max_examples=40, deadline=None)
@given(
    changes=st.lists(st.sampled_from(sorted(_CHANGES)), unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: _CHANGES[n] for n in names})
    )
)
def test_the_steps_generated_copier_is_attrs_evolve(changes):
    """The copier the step builds its new state with gives what attrs.evolve gives, for any set of changed fields."""
    import attrs

    from trainfold._src.base.copier import copier

    _, state, _ = _setup(4, 2, 1)

    fast, slow = copier(type(state), *changes)(state, *changes.values()), attrs.evolve(state, **changes)

    assert fast == slow
    assert all(getattr(fast, f.name) is getattr(slow, f.name) for f in attrs.fields(type(state)))


def test_the_copier_with_awkward_fields():
    """The generated code's own names cannot clash with a field's; attrs' kw_only fields go by keyword."""
    import attrs

    from trainfold._src.base.copier import copier

    @attrs.frozen
    class Record:
        state: int
        cls: str
        other: int = attrs.field(default=0, kw_only=True)

    old = Record(1, "a", other=4)

    assert Record(2, "b", other=4) == copier(Record, "state", "cls")(old, 2, "b")
    assert Record(1, "a", other=5) == copier(Record, "other")(old, 5)
    assert old == copier(Record)(old)
    with pytest.raises(TypeError, match=r"Record has no field\(s\) \['missing'\]"):
        copier(Record, "missing")


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
)
def test_finiteness_at_the_extremes(values, dtype):
    """checkpoint/background.py checks a weight's finiteness by its min and max (one pass): the same answer as
    ``isfinite(t).all()`` for every dtype a weight has, NaN and infinities anywhere (and a float32 value that is inf
    once cast to float16 is inf there, as it should be)."""
    from trainfold._src.checkpoint.background import _finite_one

    t = torch.tensor(values, dtype=torch.float32).to(dtype)

    assert bool(_finite_one(t)) == bool(torch.isfinite(t).all())


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 64), min_size=0, max_size=12), world=st.integers(1, 4))
def test_replicated_tensors_are_dealt_once(sizes, world):
    """A sharded save's deal of the tensors every process holds whole (checkpoint/formats/dcp.py's own_share): the
    processes' shares are disjoint and cover every tensor (each written once), and no process gets more bytes than
    another plus the largest tensor (greedy, in name order: the same on every process)."""
    from trainfold._src.checkpoint.formats.dcp import own_share

    tensors = {f"model.t{i}": torch.zeros(n) for i, n in enumerate(sizes)}

    shares = [own_share(tensors, rank, world) for rank in range(world)]

    names = [name for share in shares for name in share]
    assert sorted(names) == sorted(tensors)  # each once
    dealt = [sum(t.numel() * t.element_size() for t in share.values()) for share in shares]
    assert max(dealt) - min(dealt) <= max((4 * n for n in sizes), default=0)
