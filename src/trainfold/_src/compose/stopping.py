"""``stop_when``: a stop decided from each batch's values on any process, taken by every process at the same update.

Owned here: the step transformer :func:`stop_when` and its record
:class:`StopWhenState` in ``state.extras[name]``. The decision travels on the
Context's control channel (:mod:`trainfold._src.distributed.control`), the CPU group the signal
agreement uses: no device collective, and a host read of the predicate's
value once per check, not per step.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from trainfold._src.base.checks import name_of, named, positive_int
from trainfold._src.base.records import register_record
from trainfold._src.base.types import Batch
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import Step, StepTransformer
from trainfold._src.distributed.control import max_over_processes

#: What a ``stop_when`` predicate returns: a bool, or a one-element tensor (on the device: read once per check).
Verdict = Any


@register_record
@attrs.frozen
class StopWhenState:
    """``state.extras[name]`` of a :func:`stop_when`: whether its predicate held since the last check, in which epoch.

    ``raised`` is a bool, or a 0-d bool tensor on the device (the predicates'
    values or-ed together, unread until the check).
    """

    raised: Any = attrs.field(default=False, eq=False)
    epoch: int = 0


def stop_when(
    ctx: Context,
    predicate: Callable[[TrainState], Verdict],
    *,
    end: str = "run",
    check_every: int = 10,
    finished: bool = True,
    name: str = "stop_when",
) -> StepTransformer:
    """Stop when ``predicate(state)`` holds on any process: every process stops at the same optimizer update.

    After every micro-batch the predicate sees the new state (its batch's values
    are ``state.last_loss`` and ``state.last_aux``, on the device) and returns a
    bool or a one-element tensor: ``stop_when(ctx, lambda s: s.last_loss < 0.05)``.
    A tensor is not read there: it is or-ed into a flag on the device. Every
    ``check_every`` optimizer updates the flag is read (one host read) and, on
    several processes, agreed over the Context's control channel (one all-reduce
    of one number on the CPU gloo group): if the predicate held on any process
    since the last check, every process stops at this update. This is Accelerate's
    ``set_trigger`` / ``check_trigger``, without a device all-reduce and a read per
    step; with ``check_every=1`` it stops at the same update as they do.

    Args:
        ctx: the run's Context.
        predicate: ``predicate(state) -> bool | tensor``, called after every micro-batch.
        end: ``"run"``: stop the run (``should_stop``; the epoch stays open, as for
            ``max_steps``). ``"epoch"``: end the current epoch only, as if the loader
            had ended there (``state.end_of_epoch``; Accelerate's example's ``break``);
            the next epoch starts afresh: a flag raised in an epoch is dropped at its end.
        check_every: read and agree the flag every this many updates (a decision waits
            up to ``check_every - 1`` updates; nothing raised between checks is missed).
        finished: with ``end="run"``, the run is over for good (``state.stop.finished``: a run
            resumed from its checkpoint stays stopped, as after ``early_stop``). Pass
            False for a stop that a resumed run should go on from (a time budget).
        name: the record's key in ``state.extras`` and the stop's reason (``state.stop.reason``).

    Returns:
        A step transformer.

    Raises:
        ValueError: ``end`` is not ``"run"`` or ``"epoch"``, or ``check_every`` is not a positive int.
        TypeError (when the step runs): the predicate returned something that is not a
            bool or a one-element tensor.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> step = stop_when(ctx, lambda s: s.step >= 3, check_every=1)(make_step(ctx, loss_fn))
        >>> state = loop(run_epoch(ctx, step, loader), max_epochs=5)(state)
        >>> state.step, state.stop
        (3, Stop(reason='stop_when', final=True, finished=True))
    """
    if end not in ("run", "epoch"):
        raise ValueError(f"stop_when: end must be 'run' or 'epoch' (got {end!r}).")
    positive_int("check_every", check_every)
    if not callable(predicate):
        raise TypeError(
            f"stop_when(ctx, predicate): predicate must be a function of the state (got a {type(predicate).__name__})."
        )
    acc = ctx.accelerator
    distributed = acc.num_processes > 1
    fresh = StopWhenState()

    def transform(step: Step) -> Step:
        def stopping(state: TrainState, batch: Batch) -> TrainState:
            new = step(state, batch)
            held = _verdict(name, predicate(new))
            record: StopWhenState | None = new.extras.get(name)
            # a run's stop carries over an epoch's end; an epoch's end is dropped with its epoch
            raised = record.raised if record is not None and (end == "run" or record.epoch == new.epoch) else False
            raised = _either(raised, held)
            if not (acc.sync_gradients and new.step % check_every == 0):
                if raised is False and (record is None or record.raised is False):
                    return new  # nothing to record: no new state made
                return new.with_extra(name, StopWhenState(raised, new.epoch))
            local = bool(raised)  # sync: a flag on the device is read here, once per check
            agreed = local
            if distributed:
                agreed = bool(max_over_processes(ctx.runtime.control, int(local)))  # sync: none more: a host int
            new = new.with_extra(name, attrs.evolve(fresh, epoch=new.epoch))
            if not agreed:
                return new
            if end == "epoch":
                return attrs.evolve(new, end_of_epoch=True)
            return new.with_stop(name, finished=finished, final=True)

        return named(stopping, f"stop_when({name_of(predicate)}, end={end!r})({name_of(step)})")

    return transform


def _verdict(name: str, value: Any) -> Any:
    """The predicate's value as a bool or a 0-d bool tensor (no sync), or a TypeError naming what it was."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"{name}: the predicate returned a tensor of shape {tuple(value.shape)}; return one value "
                "(a bool, or a one-element tensor such as state.last_loss < 0.1)."
            )
        return value.detach().reshape(()).bool()  # sync: none: stays on the device
    if isinstance(value, bool):
        return value
    try:
        import numpy

        if isinstance(value, numpy.bool_):
            return bool(value)  # sync: none: a numpy bool
    except ImportError:  # pragma: no cover - numpy comes with torch
        pass
    raise TypeError(f"{name}: the predicate returned a {type(value).__name__}; return a bool or a one-element tensor.")


def _either(raised: Any, held: Any) -> Any:
    """``raised or held`` without reading a tensor: Python bools stay bools, tensors are or-ed on the device."""
    if raised is True or held is False:
        return raised
    if held is True or raised is False:
        return held
    return torch.logical_or(raised, held)
