"""Step transformers: ``Step -> Step`` functions that add behaviour around a step.

Compose them with ``toolz.compose``: in ``compose(a, b)(step)``, ``a`` is the
outermost (it sees the batch first and the new state last). Each keeps its
state in ``state.extras[name]``, never in a closure, so it is checkpointed,
snapshotted and branched with the rest of the state.
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Callable, Mapping, cast

import attrs
import torch

from trainfold._src.backend.engine import unwrap
from trainfold._src.backend.optim import inner_optimizer, set_lr
from trainfold._src.base.checks import name_of, named, positive_int
from trainfold._src.base.records import register_record
from trainfold._src.base.types import Batch, read_only
from trainfold._src.compose.tracking import emit, step_key
from trainfold._src.compose.watch import Meter, Watch, as_watch
from trainfold._src.core.checks import returned_state
from trainfold._src.core.context import Context
from trainfold._src.core.runstate import frozen_objects
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import EpochFn, Step, StepTransformer


def max_steps(n: int) -> StepTransformer:
    """Stop the run after ``n`` optimizer updates: sets ``state.stop``, which ``run_epoch`` and ``loop`` obey.

    A state already at ``n`` updates is returned unchanged (stopped) without
    running the step. A budget ends this invocation, not the run: the stopped
    epoch stays open, and a run resumed from its checkpoint with a larger budget
    (or none) goes on from there. It is the run's own end (a final stop:
    ``Stop("max_steps", final=True)``), so the epoch functions composed after
    ``run_epoch`` evaluate, log and save the final model.

    Args:
        n: the budget, in optimizer updates of the whole run (a positive int).

    Returns:
        A step transformer.

    Raises:
        ValueError: ``n`` is not a positive int.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = loop(run_epoch(ctx, max_steps(6)(make_step(ctx, loss_fn)), loader), max_epochs=10)(state)
        >>> state.step, state.stop, state.epoch, state.batch_in_epoch
        (6, Stop(reason='max_steps', final=True, finished=False), 1, 2)
    """
    positive_int("max_steps", n)

    def transform(step: Step) -> Step:
        def limited(state: TrainState, batch: Batch) -> TrainState:
            if state.step >= n:
                return state.with_stop("max_steps", final=True)
            new = step(state, batch)
            return new.with_stop("max_steps", final=True) if new.step >= n else new

        return named(limited, f"max_steps({n})({name_of(step)})")

    return transform


@register_record
@attrs.frozen
class EmaState:
    """``state.extras["ema"]``: the averaged copy of the model (a handle), its decay and update count."""

    model: torch.nn.Module = attrs.field(repr=False, eq=False)
    decay: float
    updates: int = 0


def ema(decay: float = 0.999, *, name: str = "ema") -> StepTransformer:
    """Keep an exponential moving average of the weights, updated on every optimizer update.

    ``ema = decay * ema + (1 - decay) * weights`` on the device (``_foreach_lerp_``),
    after each update the inner step performs (not per micro-batch, not per epoch).
    The average starts as a copy of the weights when the transformer first runs.
    Buffers (BatchNorm statistics) are copied, not averaged. Parameters frozen
    then (``requires_grad=False``: a base under adapters) are not copied: the
    average holds the model's own, which nothing trains. Read it with
    :func:`ema_model`, for example ``evaluate(ctx, loss_fn, loader, model=ema_model)``.

    Args:
        decay: the weight of the old average, in (0, 1).
        name: the ``extras`` key of the average (two EMAs need two names).

    Returns:
        A step transformer.

    Raises:
        ValueError: ``decay`` outside (0, 1).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, ema(0.9)(make_step(ctx, loss_fn)), loader, state)
        >>> state.extras["ema"].updates, type(ema_model(state)).__name__
        (4, 'Linear')
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay must be in (0, 1) (got {decay!r}).")

    def transform(step: Step) -> Step:
        def averaged(state: TrainState, batch: Batch) -> TrainState:
            if name not in state.extras:
                state = state.with_extra(name, EmaState(_ema_copy(state), decay))
            new = step(state, batch)
            if new.step == state.step:
                return new
            current: EmaState = new.extras[name]
            _ema_update(current.model, _unwrap(new), decay)
            return new.with_extra(name, attrs.evolve(current, updates=current.updates + 1))

        return named(averaged, f"ema({decay})({name_of(step)})")

    return transform


def _unwrap(state: TrainState) -> torch.nn.Module:
    return unwrap(state.accelerator, state.model)


def _ema_copy(state: TrainState) -> torch.nn.Module:
    """A copy of the model holding its frozen parameters themselves: nothing trains them, so their average is them
    (a base under adapters is not held twice, and an adapter checkpoint writes the average without it)."""
    model = _unwrap(state)
    copied = copy.deepcopy(model, frozen_objects(model))
    copied.requires_grad_(False)
    return copied


@torch.no_grad()
def _ema_update(ema_model: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    pairs = [
        (e, p.detach()) for e, p in zip(ema_model.parameters(), model.parameters()) if e is not p
    ]  # not the shared frozen ones
    if pairs:
        torch._foreach_lerp_([e for e, _ in pairs], [p for _, p in pairs], 1.0 - decay)
    for eb, b in zip(ema_model.buffers(), model.buffers()):
        eb.copy_(b)


def ema_model(state: TrainState, name: str = "ema") -> torch.nn.Module:
    """The averaged model kept by :func:`ema` (pass ``model=ema_model`` to ``evaluate``).

    Args:
        state: a state an :func:`ema` transformer ran on.
        name: the EMA's name (``ema``'s ``name``).

    Returns:
        The averaged model, a module of the model's class: a handle, as the state's model is (the next updates change it in
        place; ``copy.deepcopy`` it to keep one).

    Raises:
        KeyError: no ``ema`` transformer has run on this state.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, ema(0.5)(make_step(ctx, loss_fn)), loader, state)
        >>> "ema_loss" in evaluate(ctx, loss_fn, loader, state, prefix="ema", model=ema_model).metrics
        True
    """
    try:
        return cast(torch.nn.Module, state.extras[name].model)
    except KeyError:
        raise KeyError(
            f"state.extras has no {name!r}: wrap the step with ema(decay) (and run at least one step) "
            "before reading the averaged model."
        ) from None


@register_record
@attrs.frozen
class LogState:
    """``state.extras["log_every"]``: the sums at the last report, and the values reported."""

    step: int
    epoch: int
    batches: int
    sums: Mapping[str, torch.Tensor] = attrs.field(eq=False, repr=False)
    values: Mapping[str, float] = attrs.field(default=MappingProxyType({}), converter=read_only)


def log_every(ctx: Context, n: int, *, watch: bool | Watch = False) -> StepTransformer:
    """Report running means every ``n`` optimizer updates to Accelerate's trackers and the ``trainfold`` logger.

    Every ``n`` updates, the loss and aux sums accumulated since the last report
    are reduced over processes (one all-reduce and one host transfer: the only
    sync), divided by the batches seen, and sent with the learning rate and epoch
    to ``accelerator.log`` (TensorBoard, W&B... as configured with
    ``Accelerator(log_with=...)`` and ``init_trackers``) and to
    ``logging.getLogger("trainfold")`` at INFO, on the main process. The values
    stay in ``state.extras["log_every"].values`` (the progress bar shows them).

    With ``watch`` (``True``, or a :class:`~trainfold.Watch` saying what to measure),
    each report also gives the interval's ``samples_per_s``, ``updates_per_s``,
    ``tokens_per_s`` (real tokens, where the loss counts them), ``flops_per_s`` and
    ``mfu`` (where FLOPs and a peak are known), the shares of its wall time spent
    waiting for data, in the step, updating, checkpointing and agreeing on a stop
    (``time_data`` ...), and peak memory, from the same one reduction: no other
    sync. On several processes it also gives each process's data wait, compute and
    collective wait (their median, max and the process that holds it) and names a
    straggler (``straggler_input``, ``straggler_compute``), from that reduction too.
    The guide "Watching a run" defines each.

    Args:
        ctx: the run's Context.
        n: the period, in optimizer updates (a positive int).
        watch: measure throughput, utilisation, memory and time too (``True`` or a :class:`~trainfold.Watch`).

    Returns:
        A step transformer.

    Raises:
        ValueError: ``n`` is not a positive int.
        TypeError: ``watch`` is not a bool or a ``Watch``.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, log_every(ctx, 2)(make_step(ctx, loss_fn)), loader, state)
        >>> state.extras["log_every"].step, sorted(state.extras["log_every"].values)
        (4, ['epoch', 'loss', 'lr'])
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, log_every(ctx, 2, watch=True)(make_step(ctx, loss_fn)), loader, state)
        >>> values = state.extras["log_every"].values
        >>> values["samples_per_s"] > 0, round(sum(values[k] for k in values if k.startswith("time_")), 6)
        (True, 1.0)
    """
    positive_int("log_every", n)
    watching = as_watch(watch)

    def transform(step: Step) -> Step:
        meter = Meter(ctx, watching) if watching is not None else None

        def logged(state: TrainState, batch: Batch) -> TrainState:
            if state.step % n == 0 and state.step and _reported_before(state) < state.step:
                state = _missed_report(ctx, state, n, meter)
            new = step(state, batch) if meter is None else meter.step(step, state, batch)
            if new.extras is not state.extras and new.extras.get("log_every") is not state.extras.get("log_every"):
                raise ValueError(_composed_twice(n, step))
            if new.step == state.step or new.step % n:
                return new
            with ctx.runtime.in_phase("report"):
                return new.with_extra("log_every", _report(ctx, new, meter))

        return named(logged, f"log_every({n}{', watch' if watching else ''})({name_of(step)})")

    return transform


def _composed_twice(n: int, step: Step) -> str:
    """Why a step with ``log_every`` inside ``log_every(n)`` is refused (the inner one's report came out of ``step``)."""
    return (
        f"log_every({n}) is composed around another log_every, inside {name_of(step)!r}: both keep their last report "
        "in state.extras['log_every'], so each would take the other's report as where its interval began and report "
        "the means of the wrong updates (and, watched, count every batch's samples twice). Use one log_every per step, "
        "with the period you want reports at."
    )


def _reported_before(state: TrainState) -> int:
    last: LogState | None = state.extras.get("log_every")
    return -1 if last is None else last.step


def _missed_report(ctx: Context, state: TrainState, n: int, meter: Meter | None) -> TrainState:
    """``state`` holding the report due at its update, which it does not hold: a checkpoint saved inside that update's
    step, before ``log_every`` (composed outside ``checkpoint_every``) reported it. A resumed run goes on from the next
    update, so it makes that report again, from the same sums (the same values: the loss and aux means, the learning
    rate, the epoch), and sends it to each tracker that lacks it: a kill can land after the checkpoint, before every
    tracker had written it. Where that update ended its epoch, ``run_epoch`` has closed the epoch since: its sums are
    the new sums' ``closed``. Not to the logger (the run before printed it), and without the watch's rates (the
    interval's time was the run before's). Where the state's last report is not the one before it (another period, a
    checkpoint of a run without ``log_every``), no run made this report; where the sums do not hold its batches (they
    restarted on another number of processes), it cannot be made again: the sums are only the next report's start."""
    last: LogState | None = state.extras.get("log_every")
    due = state
    if state.batch_in_epoch == 0 and state.sums.closed is not None:
        sums, batches = state.sums.closed
        due = attrs.evolve(state, epoch=state.epoch - 1, batch_in_epoch=batches, sums=sums)
    began = last.batches if last is not None and last.epoch == due.epoch else 0  # the batch its interval began after
    if (last.step if last is not None else 0) == state.step - n and due.sums.started_at <= began < due.batch_in_epoch:
        return state.with_extra("log_every", _report(ctx, due, meter, again=True))
    values = last.values if last is not None else MappingProxyType({})
    return state.with_extra(
        "log_every",
        LogState(
            state.step, state.epoch, state.batch_in_epoch, MappingProxyType(state.sums.folded().as_dict()), values
        ),
    )


def _report(ctx: Context, state: TrainState, meter: Meter | None = None, *, again: bool = False) -> LogState:
    """The report at ``state``'s update: the means since the last one, sent to the trackers and the logger; ``again``: a
    report the run before made (:func:`_missed_report`), sent only to the trackers that lack it, without the watch's rates."""
    last: LogState | None = state.extras.get("log_every")
    # The folded sums are read, not kept: the run's own sums are added in the same groups
    # with or without logging, so logging never changes train_loss, even in the last bit.
    folded = state.sums.folded()
    sums = folded.as_dict()
    since, base_batches = folded.interval(state.epoch, last)
    totals = (
        meter.totals() if meter is not None else None
    )  # (again too: summed over processes in the precision they were)
    means, summed = folded.means_and_totals(
        ctx.accelerator, state.batch_in_epoch - base_batches, since=since, totals=totals
    )
    values = {**means, "epoch": float(state.epoch)}  # sync: none: a host int
    if state.optimizer is not None:
        lr = inner_optimizer(state.optimizer).param_groups[0]["lr"]
        values["lr"] = float(lr)  # sync: none: a number, or a compiled update's CPU tensor
    if meter is not None and not again:
        values.update(meter.report(state, summed))
    emit(ctx, {step_key(k): v for k, v in values.items()}, state.step, log=not again)
    return LogState(state.step, state.epoch, state.batch_in_epoch, MappingProxyType(sums), values)


def every_steps(n: int, fn: EpochFn) -> StepTransformer:
    """Run the epoch function ``fn`` (an ``evaluate``, a checkpoint) after every ``n``-th optimizer update.

    For evaluation inside long epochs: ``every_steps(500, evaluate(ctx, loss_fn, eval_dl))``.

    Args:
        n: the period, in optimizer updates (a positive int).
        fn: the epoch function to run (``evaluate``, ``save_checkpoint``...).

    Returns:
        A step transformer.

    Raises:
        ValueError: ``n`` is not a positive int.
        TypeError: ``fn`` returned something other than a TrainState (when run).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> step = every_steps(2, evaluate(ctx, loss_fn, loader))(make_step(ctx, loss_fn))
        >>> [r.step for r in run_epoch(ctx, step, loader, state).history if r.name == "eval_loss"]
        [2, 4]
    """
    positive_int("every_steps", n)

    def transform(step: Step) -> Step:
        def periodic(state: TrainState, batch: Batch) -> TrainState:
            new = step(state, batch)
            if new.step != state.step and new.step % n == 0:
                return returned_state(fn, fn(new))
            return new

        return named(periodic, f"every_steps({n}, {name_of(fn)})({name_of(step)})")

    return transform


LR_SCALE = "lr_scale"


def lr_schedule(schedule: Callable[[int], float]) -> StepTransformer:
    """Set every parameter group's learning rate to ``schedule(state.step)`` before each step.

    ``state.step`` counts optimizer updates, identical on every process, so the
    schedule's meaning does not depend on the number of processes or the
    accumulation steps. Use it instead of a torch scheduler, not with one. A
    factor recorded by :func:`~trainfold.reduce_lr_on_plateau` in
    ``state.extras["lr_scale"]`` multiplies the scheduled value.

    Args:
        schedule: ``update -> learning rate``, such as :class:`~trainfold.warmup_cosine`.

    Returns:
        A step transformer.

    Raises:
        Exception: nothing of its own; what ``schedule`` raises comes out of the step that calls it.

    Examples:
        >>> from trainfold import testing, warmup_linear
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> step = lr_schedule(warmup_linear(0.1, warmup_steps=2, total_steps=4))(make_step(ctx, loss_fn))
        >>> state = run_epoch(ctx, step, loader, state)
        >>> state.optimizer.param_groups[0]["lr"]  # set before the 4th update: schedule(3)
        0.05
    """

    def transform(step: Step) -> Step:
        def scheduled(state: TrainState, batch: Batch) -> TrainState:
            lr = schedule(state.step) * state.extras.get(LR_SCALE, 1.0)
            for group in inner_optimizer(state.optimizer).param_groups:
                set_lr(group, lr)
            return step(state, batch)

        return named(scheduled, f"lr_schedule({schedule!r})({name_of(step)})")

    return transform
