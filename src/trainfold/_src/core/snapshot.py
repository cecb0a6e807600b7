"""snapshot and restore: a training state as a true value, for tests, time travel and branching."""

from __future__ import annotations

from typing import Any, overload

from toolz import curry

from trainfold._src.core.checks import expect_owned, expect_state
from trainfold._src.core.context import Context
from trainfold._src.core.runstate import RunState, StateMismatch, capture, check_fits, put_back
from trainfold._src.core.state import TrainState

#: A detached copy of a run at one moment (see :func:`snapshot`): the same
#: :class:`~trainfold._src.core.runstate.RunState` a checkpoint writes to files.
Snapshot = RunState


def snapshot(state: TrainState) -> Snapshot:
    """Copy everything a run needs to continue from here into a detached :class:`Snapshot`.

    It holds the TrainState's values (counters, history, running sums,
    transformer states, EMA copies), the model's weights and gradients, the
    optimizer, scheduler and loss-scaler states, Accelerate's accumulation
    counter and the global random states: the same parts a checkpoint writes.
    Nothing in it is shared with the live objects. The copy costs one copy of
    the weights, gradients and optimizer state (on their devices): take
    snapshots at the moments you need them, not every step.

    Args:
        state: the state to copy.

    Returns:
        The run's moment as a :class:`Snapshot`, detached from the live objects.

    Raises:
        TypeError: ``state`` is not a TrainState.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> snap = snapshot(state)
        >>> trained = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
        >>> back = restore(ctx, snap, trained)
        >>> back.step, torch.equal(back.model.weight, snap.weights["weight"])
        (0, True)
    """
    return capture(expect_state("snapshot", state), copied=True)


@overload
def restore(ctx: Context, snap: Snapshot) -> Any: ...
@overload
def restore(ctx: Context, snap: Snapshot, state: TrainState) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def restore(ctx: Context, snap: Snapshot, state: TrainState) -> TrainState:
    """Put a :class:`Snapshot` back into ``state``'s model, optimizer and scheduler; return its values.

    The weights, gradients, optimizer, scheduler and scaler states, Accelerate's
    accumulation counter and the global random states become the snapshot's
    (copied, so the snapshot can be restored again); the returned state carries
    the snapshot's counters, history and extras with ``state``'s handles. Two
    branches restored from one snapshot and given the same batches compute the
    same parameters as two fresh runs. Curried with the state last, like every
    primitive: ``restore(ctx, snap)`` is an epoch function.

    The loader's own position is not part of a snapshot: restore at an epoch
    boundary and call ``run_epoch``, or feed the batches yourself.

    Args:
        ctx: the run's Context.
        snap: a :func:`snapshot` of a state of this model.
        state: the state whose objects receive it (curried: ``restore(ctx, snap)`` is an epoch function).

    Returns:
        The snapshot's values with ``state``'s handles.

    Raises:
        ValueError: the snapshot is of another model, optimizer layout or
            scheduler (checked before anything is changed).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> snap = snapshot(state)
        >>> a = run_epoch(ctx, make_step(ctx, loss_fn), loader, restore(ctx, snap, state))
        >>> wa = a.model.weight.detach().clone()
        >>> b = run_epoch(ctx, make_step(ctx, loss_fn), loader, restore(ctx, snap, a))
        >>> torch.equal(wa, b.model.weight), (a.step, b.step)
        (True, (4, 4))
    """
    state = expect_owned("restore", ctx, expect_state("restore", state))
    try:
        check_fits(snap, state)
    except StateMismatch as exc:
        raise ValueError(f"restore: the snapshot {exc}") from None
    return put_back(snap, state)
