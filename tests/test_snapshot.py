"""snapshot/restore: a state as a true value; branches from one snapshot equal fresh runs."""

import functools
import attrs
import pytest
import torch
from hypothesis import given, settings, strategies as st

from trainfold import make_step, restore, run_epoch, snapshot, testing

import helpers


_setup = functools.partial(
    helpers.setup,
    ga=2,
    n=40,
    dropout=0.3,
    optimizer=lambda params: torch.optim.AdamW(params, lr=0.01),
    scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
)


def _set_lr(state, lr):
    for g in state.optimizer.param_groups:
        g["lr"] = lr
    return state


def test_a_snapshot_is_detached_from_the_live_state():
    ctx, state, dl = _setup()
    snap = snapshot(state)
    before = {k: v.clone() for k, v in snap.weights.items()}

    trained = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)

    testing.assert_params_changed(before, trained)
    for k in before:
        assert torch.equal(before[k], snap.weights[k])  # the snapshot kept the old values
    assert 0 == snap.step and 5 == trained.step


def test_restore_round_trips():
    """restore(snapshot(s)) has s's counters, history and weights."""
    ctx, state, dl = _setup()
    state = run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    snap = snapshot(state)
    params = testing.parameters(state)

    run_epoch(ctx, make_step(ctx, helpers.ce_loss), dl, state)
    back = restore(ctx, snap, state)

    assert back == state  # values equal: counters, history, extras
    testing.assert_params_equal(params, back)


def test_two_branches_from_one_snapshot_equal_two_fresh_runs():
    """Epoch 1 shared; epoch 2 with lr 0.01 or 0.05: each branch equals a run that never branched."""
    step_of = lambda ctx: make_step(ctx, helpers.ce_loss)

    fresh = {}
    for lr in (0.01, 0.05):
        ctx, state, dl = _setup()
        state = run_epoch(ctx, step_of(ctx), dl, state)
        fresh[lr] = run_epoch(ctx, step_of(ctx), dl, _set_lr(state, lr))

    ctx, state, dl = _setup()
    state = run_epoch(ctx, step_of(ctx), dl, state)
    snap = snapshot(state)
    for lr in (0.05, 0.01):  # in the other order, to show nothing leaks between branches
        branch = run_epoch(ctx, step_of(ctx), dl, _set_lr(restore(ctx, snap, state), lr))
        testing.assert_params_equal(fresh[lr], branch)
        assert fresh[lr].history == branch.history


@settings(max_examples=10, deadline=None)
@given(k=st.integers(0, 9))
def test_a_snapshot_mid_accumulation_resumes_the_group(k):
    """Snapshot after k micro-batches (accumulation 2), restore, continue: the same as never stopping."""
    ctx, state, dl = _setup()
    batches = list(dl)
    step = make_step(ctx, helpers.ce_loss)
    expected = testing.parameters(testing.run_steps(step, state, batches))

    ctx, state, dl = _setup()
    batches = list(dl)  # the same random draws as above before the first step
    state = testing.run_steps(step := make_step(ctx, helpers.ce_loss), state, batches[:k])
    snap = snapshot(state)
    state = testing.run_steps(step, state, batches[k:])  # diverge first...
    back = restore(ctx, snap, state)  # ...then go back
    final = testing.run_steps(step, back, batches[k:])

    testing.assert_params_equal(expected, final)


def test_a_snapshot_keeps_nan_guard_flags_apart():
    """The guard's flags still on the device are copied: the live run writing more changes nothing in the snapshot."""
    from trainfold import nan_guard

    ctx, state, dl = _setup(ga=1)
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        return helpers.ce_loss(model, batch) * (float("nan") if calls["n"] in (2, 3) else 1.0)

    step = make_step(ctx, loss_fn, stages=[nan_guard(5, check_every=100)])
    batches = list(dl)
    state = testing.run_steps(step, state, batches[:2])  # the 2nd skipped
    snap = snapshot(state)
    live = testing.run_steps(step, state, batches[2:4])  # the 3rd skipped
    back = restore(ctx, snap, live)

    assert (2, 1, 1) == (
        back.extras["nan_guard"].unread,
        back.extras["nan_guard"].skipped,
        back.extras["nan_guard"].consecutive,
    )
    assert (4, 2, 0) == (
        live.extras["nan_guard"].unread,
        live.extras["nan_guard"].skipped,
        live.extras["nan_guard"].consecutive,
    )
    assert snap.values.extras["nan_guard"].flags.values.data_ptr() != live.extras["nan_guard"].flags.values.data_ptr()


def test_restore_is_curried_and_checks_the_model():
    """`restore` is curried with the state last and refuses another model before changing anything."""
    from toolz import pipe

    from trainfold import restore, snapshot

    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    snap = snapshot(state)
    trained = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)

    assert 0 == pipe(trained, restore(ctx, snap)).step

    other_snap = attrs.evolve(snap, weights={"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
    before = testing.parameters(trained)
    with pytest.raises(
        ValueError, match=r"restore: the snapshot is from another model: parameter 'weight' has shape \(2, 2\)"
    ):
        restore(ctx, other_snap, trained)
    testing.assert_params_equal(before, trained)
