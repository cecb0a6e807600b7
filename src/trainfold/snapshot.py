"""snapshot and restore: a training state as a true value, for tests, time travel and branching."""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any, Mapping

import attrs
import torch

from . import _rng
from ._backend import inner_optimizer
from ._validate import expect_owned, expect_state
from .context import Context
from .state import TrainState


@attrs.frozen(eq=False)
class Snapshot:
    """A detached copy of a run at one moment: nothing in it is shared with the live objects.

    It holds the TrainState's values (counters, history, running sums,
    transformer states, EMA copies), the model's weights and gradients, the
    optimizer, scheduler and loss-scaler states, Accelerate's accumulation
    counter and the global random states. Take one with :func:`snapshot`, put it
    back with :func:`restore` (as often as you like: restoring copies again).
    """

    values: TrainState = attrs.field(repr=False)
    weights: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    grads: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    optimizer: Any = attrs.field(repr=False)
    scheduler: Any = attrs.field(repr=False)
    scaler: Any = attrs.field(repr=False)
    accelerate_step: int
    rng: _rng.RngStates = attrs.field(repr=False)

    @property
    def step(self) -> int:
        return self.values.step

    @property
    def epoch(self) -> int:
        return self.values.epoch


def detach(value: Any) -> Any:
    """A copy of a state value that shares no tensor with it (tensors cloned, modules deep-copied).

    Handles what a TrainState holds: tensors, modules, read-only and plain
    mappings, tuples, lists, attrs records (trainfold's and yours) and plain
    immutable values; anything else is deep-copied.
    """
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.nn.Module):
        return copy.deepcopy(value)
    if isinstance(value, MappingProxyType):
        return MappingProxyType({k: detach(v) for k, v in value.items()})
    if isinstance(value, dict):
        return {k: detach(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(detach(v) for v in value)
    if attrs.has(type(value)):
        return attrs.evolve(value, **{f.alias: detach(getattr(value, f.name)) for f in attrs.fields(type(value)) if f.init})
    return copy.deepcopy(value)


def _detached_values(state: TrainState) -> TrainState:
    """The state's values with every tensor (and EMA module) copied and no live handle."""
    return detach(attrs.evolve(state, model=None, optimizer=None, scheduler=None, accelerator=None, cursor=None))


def snapshot(state: TrainState) -> Snapshot:
    """Copy everything a run needs to continue from here into a detached :class:`Snapshot`.

    The copy costs one copy of the weights, gradients and optimizer state (on
    their devices): take snapshots at the moments you need them, not every step.

    Example:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> snap = snapshot(state)
        >>> trained = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
        >>> back = restore(ctx, snap, trained)
        >>> back.step, torch.equal(back.model.weight, snap.weights["weight"])
        (0, True)

    .. versionadded:: 0.1.0
    """
    state = expect_state("snapshot", state)
    acc = state.accelerator
    model = acc.unwrap_model(state.model) if acc is not None else state.model
    scaler = getattr(acc, "scaler", None)
    return Snapshot(
        values=_detached_values(state),
        weights={k: v.detach().clone() for k, v in model.state_dict().items()},
        grads={n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        optimizer=copy.deepcopy(inner_optimizer(state.optimizer).state_dict()),
        scheduler=None if state.scheduler is None else copy.deepcopy(state.scheduler.state_dict()),
        scaler=None if scaler is None else copy.deepcopy(scaler.state_dict()),
        accelerate_step=int(getattr(acc, "step", 0)),
        rng=_rng.capture(),
    )


def restore(ctx: Context, snap: Snapshot, state: TrainState) -> TrainState:
    """Put a :class:`Snapshot` back into ``state``'s model, optimizer and scheduler; return its values.

    The weights, gradients, optimizer, scheduler and scaler states, Accelerate's
    accumulation counter and the global random states become the snapshot's
    (copied, so the snapshot can be restored again); the returned state carries
    the snapshot's counters, history and extras with ``state``'s handles. Two
    branches restored from one snapshot and given the same batches compute the
    same parameters as two fresh runs.

    The loader's own position is not part of a snapshot: restore at an epoch
    boundary and call ``run_epoch``, or feed the batches yourself.

    Example:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> snap = snapshot(state)
        >>> a = run_epoch(ctx, make_step(ctx, loss_fn), loader, restore(ctx, snap, state))
        >>> wa = a.model.weight.detach().clone()
        >>> b = run_epoch(ctx, make_step(ctx, loss_fn), loader, restore(ctx, snap, a))
        >>> torch.equal(wa, b.model.weight), (a.step, b.step)
        (True, (4, 4))

    .. versionadded:: 0.1.0
    """
    state = expect_owned("restore", ctx, expect_state("restore", state))
    acc = ctx.accelerator
    model = acc.unwrap_model(state.model)
    model.load_state_dict(snap.weights, strict=True)
    for name, p in model.named_parameters():
        p.grad = snap.grads[name].clone() if name in snap.grads else None
    inner_optimizer(state.optimizer).load_state_dict(copy.deepcopy(snap.optimizer))
    if state.scheduler is not None and snap.scheduler is not None:
        state.scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
    if acc.scaler is not None and snap.scaler is not None:
        acc.scaler.load_state_dict(copy.deepcopy(snap.scaler))
    acc.step = snap.accelerate_step
    _rng.restore(snap.rng)
    values = detach(snap.values)
    return attrs.evolve(values, model=state.model, optimizer=state.optimizer, scheduler=state.scheduler, accelerator=state.accelerator, cursor=None)
