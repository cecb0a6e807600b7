"""make_step: one training step, a fixed pipeline of stages chosen when the step is built."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from trainfold._src.backend.optim import backward_fn, gradient_sync, micro_batch_start
from trainfold._src.base.copier import copier
from trainfold._src.base.running_sums import RunningSums
from trainfold._src.base.types import Batch, LossFn
from trainfold._src.core.clock import Clock
from trainfold._src.core.compiling import Compile, compile_regions, compile_spec, loss_of
from trainfold._src.core.checks import describe, expect_args, expect_owned, expect_state
from trainfold._src.core.context import Context
from trainfold._src.core.loss import compute_loss
from trainfold._src.core.stages import (
    MicroBatch,
    Stage,
    StageSpec,
    bind_all,
    clip_by_norm,
    clip_by_value,
    is_norm_clip,
    recording_norm,
)
from trainfold._src.core.state import TrainState
from trainfold._src.core.stop import Stop
from trainfold._src.core.types import Step
from trainfold._src.core.update import Updates
from trainfold._src.distributed.last_seen import Phase


def record(
    state: TrainState,
    loss: torch.Tensor,
    aux: Mapping[str, torch.Tensor],
    *,
    updated: bool,
    sums: RunningSums | None = None,
    extras: Mapping[str, Any] | None = None,
    stop: Stop | None = None,
) -> TrainState:
    """The last stage: one new state with the counters advanced and the micro-batch's values added.

    ``step`` +1 if ``updated``, ``micro_step`` and ``batch_in_epoch`` +1, the
    detached ``(loss, aux)`` added to the running sums (no kernel: see
    :class:`~trainfold.RunningSums`); ``sums`` and ``extras``, when given, replace
    the state's; ``stop``, when given, is the new state's (with ``extras`` only).
    """
    sums = (state.sums if sums is None else sums).add(loss, aux)
    if extras is None:
        advance = copier(type(state), "step", "micro_step", "batch_in_epoch", "sums")
        return advance(state, state.step + updated, state.micro_step + 1, state.batch_in_epoch + 1, sums)
    advance = copier(type(state), "step", "micro_step", "batch_in_epoch", "sums", "extras", "stop")
    return advance(
        state,
        state.step + updated,
        state.micro_step + 1,
        state.batch_in_epoch + 1,
        sums,
        extras,
        state.stop if stop is None else stop,
    )


def normalize_mode(normalize: str, where: str = "make_step") -> str:
    """``normalize`` if it is ``"mean"`` or ``"tokens"``; a ValueError naming ``where`` otherwise."""
    if normalize not in ("mean", "tokens"):
        raise ValueError(f"{where}: normalize must be 'mean' or 'tokens' (got {normalize!r}).")
    return normalize


def stages_of(
    *,
    clip_grad_norm: float | None,
    clip_grad_value: float | None,
    normalize: str,
    stages: Sequence[StageSpec],
    record_grad_norm: bool = False,
) -> tuple[StageSpec, ...]:
    """The stages ``make_step``'s options stand for, in order: token scaling, clipping (or the norm), then ``stages``.

    ``record_grad_norm`` makes the norm clipping (``clip_grad_norm``, or a ``clip_by_norm`` among ``stages``) record the
    norm it computes; without one, a stage that records the norm without clipping goes where the clipping would.
    """
    if clip_grad_norm is not None and clip_grad_value is not None:
        raise ValueError("give clip_grad_norm or clip_grad_value, not both.")
    if not isinstance(record_grad_norm, bool):
        raise TypeError(f"record_grad_norm must be True or False (got {record_grad_norm!r}).")
    chosen: list[StageSpec] = []
    if normalize_mode(normalize) == "tokens":
        from trainfold._src.core.tokens import (
            normalize_tokens,  # the option's stage, from its own module: the pipeline knows no feature
        )

        chosen.append(normalize_tokens())
    given = tuple(stages)
    clipping = [i for i, spec in enumerate(given) if is_norm_clip(spec)]
    if clip_grad_norm is not None:
        chosen.append(
            recording_norm(clip_by_norm(clip_grad_norm)) if record_grad_norm else clip_by_norm(clip_grad_norm)
        )
    elif record_grad_norm and clipping:  # the user's own clip_by_norm records the norm it computes
        given = tuple(recording_norm(spec) if i == clipping[0] else spec for i, spec in enumerate(given))
    elif record_grad_norm:
        chosen.append(recording_norm())  # before clip_by_value: the norm of the gradients as computed
    if clip_grad_value is not None:
        chosen.append(clip_by_value(clip_grad_value))
    return (*chosen, *given)


def make_step(
    ctx: Context,
    loss_fn: LossFn,
    *,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    normalize: str = "mean",
    stages: Sequence[StageSpec] = (),
    record_grad_norm: bool = False,
    compile: bool | Compile = False,
) -> Step:
    """Build a training step ``(state, batch) -> state``.

    Per batch, exactly what Accelerate's canonical loop does:

        with accelerator.accumulate(model):          # accumulation, no_sync under DDP
            loss, aux = loss_fn(model, batch)        # model forward under autocast
            accelerator.backward(loss)               # / accumulation steps, loss scaling
            stages: on_batch                         # e.g. count tokens
            if accelerator.sync_gradients:           # last micro-batch of a group
                stages: on_update                    # clip (once per update), check...
                optimizer.step(); optimizer.zero_grad()   # skipped where a stage flagged it
                stages: after_update
            scheduler.step()                         # Accelerate steps it on updates only

    and then one new state (:func:`record`): ``step`` +1 on an update the
    scaler did not skip, ``micro_step`` and ``batch_in_epoch`` +1, the detached
    loss and aux added to the on-device running sums. No host-device
    synchronisation happens (no ``.item()``); Accelerate's own fp16
    ``GradScaler`` is the exception, as in any fp16 loop.

    The pipeline is chosen here, once: the stages (:class:`~trainfold.Stage`),
    and the update (plain, or gated by a stage's flag). Where Accelerate's
    wrappers have nothing to do, the step skips them, also decided here: on one
    process ``accumulate`` is only its ``_do_sync()`` (and with no accumulation,
    not even that); without a loss scaler or DeepSpeed ``backward`` is
    ``(loss / steps).backward()``; and the torch optimizer is called directly on
    updates. The parameters are the same, bit for bit (the equivalence tests
    cover every configuration).

    Args:
        ctx: the run's Context.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``; see :class:`~trainfold.LossFn`.
        clip_grad_norm: clip the gradients' global norm to this value on every update
            (the stage :func:`~trainfold.clip_by_norm`).
        clip_grad_value: clip each gradient element to ``[-v, v]`` on every update
            (the stage :func:`~trainfold.clip_by_value`).
        normalize: ``"mean"`` (the default): the loss is a batch mean, and
            Accelerate divides it by the accumulation steps. ``"tokens"``: the
            loss is a sum over real tokens and ``aux["tokens"]`` their number; the
            update uses the gradient of the summed loss over all real tokens of the
            accumulation group on all processes (the stage
            :func:`~trainfold.normalize_tokens`).
        stages: more stages, after those the options stand for: ``nan_guard(3)``,
            or your own :class:`~trainfold.Stage`.
        record_grad_norm: record the gradients' global norm at every update, the one way to: ``train_grad_norm``
            in the history (the epoch's mean over updates) and ``train/grad_norm`` from ``log_every``, kept on
            the device with no sync of its own. With clipping by norm (``clip_grad_norm``, or a
            :func:`~trainfold.clip_by_norm` stage) it is the norm the clipping computes, before clipping;
            without, the norm alone (training unchanged bit for bit).
        compile: ``True`` or a :class:`~trainfold.Compile`: compile the loss with the model inside it (or the
            model's repeated blocks) and the optimizer's update with ``torch.compile``. The first call compiles
            (the warm-up) and checks that dynamo compiled each part. The model is not wrapped: its
            checkpoints are an eager run's. See the guide "Compiling a step".

    Returns:
        A plain function ``step(state, batch) -> state``.

    Raises:
        ValueError: bad clipping options; a stage refused this Context; ``compile`` under DeepSpeed.
        TypeError/ValueError (when called): the loss_fn returned something that is
            not a 0-d floating loss with a gradient.
        RuntimeError (at the first call): ``compile`` was asked and dynamo compiled nothing.

    Examples:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> ctx = Context(accelerator=Accelerator(cpu=True))
        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        >>> step = make_step(ctx, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        >>> new = step(state, (torch.tensor([[1.0]]), torch.tensor([[1.0]])))
        >>> (state.step, new.step), new.model.weight.item()
        ((0, 1), 2.0)
    """
    expect_args("make_step", "make_step(ctx, loss_fn, ...)", ctx, "loss_fn", loss_fn)
    ctx.check()
    accelerator = ctx.accelerator
    bound = bind_all(
        ctx,
        stages_of(
            clip_grad_norm=clip_grad_norm,
            clip_grad_value=clip_grad_value,
            normalize=normalize,
            stages=stages,
            record_grad_norm=record_grad_norm,
        ),
    )
    spec = compile_spec(ctx, compile)
    start = micro_batch_start(accelerator)
    backward = backward_fn(accelerator)
    updates = Updates(
        accelerator,
        gate=any(s.gates_update for s in bound),
        compile=spec if spec is not None and spec.optimizer else None,
    )
    clock, phase = ctx.runtime.clock, ctx.runtime.phase
    step_loss = loss_of(loss_fn, spec) if spec is not None and not spec.regions else loss_fn
    micro_batch = (
        _staged(step_loss, backward, updates, bound, clock, phase)
        if bound
        else _plain(step_loss, backward, updates, clock, phase)
    )
    if spec is not None and spec.regions:
        micro_batch = _compiling_regions(micro_batch, spec)
    sync = gradient_sync(accelerator)

    def step(state: TrainState, batch: Batch) -> TrainState:
        if getattr(state, "accelerator", None) is not accelerator:
            _refuse_call(ctx, state, batch)
        if start is not None:
            start()
            return micro_batch(state, batch, sync.sync_gradients)
        with accelerator.accumulate(state.model):  # DDP's no_sync off the last micro-batch of a group
            return micro_batch(state, batch, sync.sync_gradients)

    names = "".join(f", {s.name}" for s in bound)
    step.__qualname__ = step.__name__ = f"step[{getattr(loss_fn, '__name__', 'loss_fn')}{names}]"
    return step


def _refuse_call(ctx: Context, state: Any, batch: Any) -> None:
    """Explain a call of a step with something else than ``(state, batch)`` of this Context (off the hot path)."""
    if isinstance(batch, TrainState) and not isinstance(state, TrainState):
        raise TypeError(
            f"step(state, batch): the arguments are swapped: the TrainState comes first, the batch second (got {describe(state)} first)."
        )
    expect_owned("step", ctx, expect_state("step", state))


#: One micro-batch of a step: ``(state, batch, synced) -> state``.
_MicroBatch = Callable[[TrainState, Batch, bool], TrainState]


def _compiling_regions(micro_batch: _MicroBatch, spec: Compile) -> _MicroBatch:
    """``micro_batch``, giving the model's repeated blocks their compiled ``forward`` first (once per model: kept on it)."""

    def compiling(state: TrainState, batch: Batch, synced: bool) -> TrainState:
        compile_regions(state.model, spec)
        return micro_batch(state, batch, synced)

    return compiling


def _plain(loss_fn: LossFn, backward: Any, updates: Updates, clock: Clock, phase: Phase) -> _MicroBatch:
    """The pipeline with no stages: loss, backward, update, scheduler, record."""

    def micro_batch(state: TrainState, batch: Batch, synced: bool) -> TrainState:
        compute = clock.compute  # (a watcher's, naming stragglers: None otherwise)
        began = compute.begin(state.model) if compute is not None else 0.0
        loss, aux = compute_loss(loss_fn, state.model, batch)
        backward(loss)
        if compute is not None:
            compute.end(began, synced=synced)
        ops = updates.of(state.optimizer).ops
        if synced or ops.every_batch:
            start = time.perf_counter() if clock.on else 0.0  # (the update's host time, while a watcher looks)
            before, phase.now = phase.now, "update"
            ops.step()
            ops.zero_grad()
            phase.now = before
            if start:
                clock.add("update", time.perf_counter() - start)
        if state.scheduler is not None:
            state.scheduler.step()
        return record(state, loss, aux, updated=synced and not ops.was_skipped())

    return micro_batch


def _staged(
    loss_fn: LossFn, backward: Any, updates: Updates, stages: tuple[Stage, ...], clock: Clock, phase: Phase
) -> _MicroBatch:
    """The pipeline with stages: their hooks run in order, each kind only where it is given."""
    on_batch = tuple(s.on_batch for s in stages if s.on_batch is not None)
    on_update = tuple(s.on_update for s in stages if s.on_update is not None)
    after_update = tuple(s.after_update for s in stages if s.after_update is not None)
    masks = any(s.masks_nonfinite for s in stages)

    def micro_batch(state: TrainState, batch: Batch, synced: bool) -> TrainState:
        model = state.model
        compute = clock.compute
        began = compute.begin(model) if compute is not None else 0.0
        loss, aux = compute_loss(loss_fn, model, batch)
        backward(loss)
        if compute is not None:
            compute.end(began, synced=synced)
        mb = MicroBatch(state, model, loss, aux, synced, state.extras, None, state.stop)
        for hook in on_batch:
            hook(mb)
        update = updates.of(state.optimizer)
        if synced:
            for hook in on_update:
                hook(mb)
            start = time.perf_counter() if clock.on else 0.0
            before, phase.now = phase.now, "update"
            update.apply(mb.skip)
            phase.now = before
            if start:
                clock.add("update", time.perf_counter() - start)
            for hook in after_update:
                hook(mb)
        elif update.ops.every_batch:
            update.apply(None)
        if state.scheduler is not None:
            state.scheduler.step()
        sums = state.sums if state.sums.mask_nonfinite or not masks else state.sums.masking()
        updated = synced and not update.ops.was_skipped()
        return record(state, mb.loss, mb.aux, updated=updated, sums=sums, extras=mb.extras, stop=mb.stop)

    return micro_batch
