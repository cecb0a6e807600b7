"""make_step: one training step, composed from small stages."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Callable, Mapping

import attrs
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ._backend import OptimizerOps, backward_fn, inner_optimizer, micro_batch_start, optimizer_ops
from ._guard import NAME as GUARD
from ._guard import GuardedUpdate, NanGuardState
from ._types import Batch, LossFn, Step
from ._validate import add_note, expect_owned, expect_state
from .context import Context
from .metrics import FOLD_EVERY, check_same_names, describe_batch, detached, fold, split_loss_output
from .state import TrainState, copier

Clip = Callable[[torch.nn.Module], Any]


def compute_loss(loss_fn: LossFn, model: torch.nn.Module, batch: Batch, *, need_grad: bool = True) -> tuple[torch.Tensor, Any]:
    """Stage 1: call ``loss_fn(model, batch)`` and check what it returned.

    An exception from ``loss_fn`` is re-raised unchanged, with a note that shows
    the batch's structure (types, shapes, dtypes; never the data).
    """
    try:
        out = loss_fn(model, batch)
    except Exception as exc:
        add_note(exc, f"trainfold: raised by loss_fn on a batch of structure {describe_batch(batch)}")
        raise
    return split_loss_output(out, need_grad=need_grad)


def make_clip(accelerator: Accelerator, clip_grad_norm: float | None, clip_grad_value: float | None) -> Clip | None:
    """Stage 3: the gradient clipping to run once per optimizer update, or None.

    Raises:
        ValueError: a non-positive or non-finite threshold, both given, or any
            given under DeepSpeed (whose config owns clipping).
    """
    for name, v in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive finite number or None (got {v!r}).")
    if clip_grad_norm is not None and clip_grad_value is not None:
        raise ValueError("give clip_grad_norm or clip_grad_value, not both.")
    if clip_grad_norm is None and clip_grad_value is None:
        return None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError(
            "under DeepSpeed, clipping comes from the DeepSpeed config: set 'gradient_clipping' there "
            "and leave clip_grad_norm/clip_grad_value unset in make_step."
        )
    if clip_grad_norm is not None:
        norm = float(clip_grad_norm)
        return lambda model: accelerator.clip_grad_norm_(model.parameters(), norm)
    value = float(clip_grad_value)  # type: ignore[arg-type]
    return lambda model: accelerator.clip_grad_value_(model.parameters(), value)


def record(
    state: TrainState,
    loss: torch.Tensor,
    aux: Any,
    *,
    updated: bool,
    guard: NanGuardState | None = None,
    extras: Mapping[str, Any] | None = None,
) -> TrainState:
    """Stage 5: one new state (``attrs.evolve``, cheaper) with the counters and the micro-batch's values.

    The detached ``(loss, aux)`` joins ``state.unsummed``, with no kernel; every
    ``FOLD_EVERY`` micro-batches they are added to the on-device sums (see
    :meth:`TrainState.summed`). ``extras``, when given, replaces ``state.extras``
    (the token stage's new count).
    """
    check_same_names(state._aux_sums, state.unsummed, aux)
    extras = state.extras if extras is None else extras
    if guard is not None:
        extras = MappingProxyType({**extras, GUARD: guard})
    unsummed = (*state.unsummed, detached(loss, aux))
    if len(unsummed) < FOLD_EVERY:
        loss_sum, aux_sums = state._loss_sum, state._aux_sums
    else:
        loss_sum, aux_sums = fold(state._loss_sum, state._aux_sums, unsummed, mask_nonfinite=GUARD in extras)
        unsummed = ()
    advance = copier(type(state), *_RECORDED)  # positional: a step's one new state costs one constructor call
    return advance(state, state.step + updated, state.micro_step + 1, state.batch_in_epoch + 1, loss_sum, aux_sums, unsummed, extras)


_RECORDED = ("step", "micro_step", "batch_in_epoch", "loss_sum", "aux_sums", "unsummed", "extras")


@attrs.define
class _UpdatePlan:
    """How ``make_step``'s step updates one optimizer, decided the first time it meets it."""

    optimizer: Any
    ops: OptimizerOps
    guarded: GuardedUpdate | None = None

    def guarded_update(self) -> GuardedUpdate:
        """Stage 4 under ``nan_guard`` (decided on its first guarded update: only a guarded step needs it)."""
        if self.guarded is None:
            ops = self.ops
            self.guarded = GuardedUpdate.of(inner_optimizer(self.optimizer), ops.step, fast=ops.fast, scaled=ops.scaled)
        return self.guarded


TOKENS = "tokens"


def _normalize_mode(normalize: str) -> str:
    if normalize not in ("mean", "tokens"):
        raise ValueError(f"normalize must be 'mean' or 'tokens' (got {normalize!r}).")
    return normalize


def token_normalizer(ctx: Context) -> Callable[..., tuple[Mapping[str, Any], torch.Tensor]]:
    """The stage of a ``normalize="tokens"`` step between backward and clipping.

    Per micro-batch it adds ``aux["tokens"]`` to the group's count, kept on the
    device in ``state.extras["tokens"]``. On the micro-batch that updates, it
    sums the count over processes (one all-reduce) and scales the gradients by
    ``accumulation_steps * num_processes / total_tokens``: Accelerate divided
    each summed loss by the accumulation steps and DDP averaged over processes,
    so the result is the gradient of (sum of all token losses) / (all tokens).
    Returns the state's new extras (for :func:`record`) and the micro-batch's
    per-token mean loss (for the logs).
    """
    accelerator = ctx.accelerator
    factor = float(ctx.gradient_accumulation_steps * accelerator.num_processes)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError("normalize='tokens' is not supported under DeepSpeed, which scales gradients itself.")

    def stage(
        state: TrainState, model: torch.nn.Module, loss: torch.Tensor, aux: Any, synced: bool
    ) -> tuple[Mapping[str, Any], torch.Tensor]:
        count = aux.get(TOKENS) if hasattr(aux, "get") else None
        if count is None:
            raise ValueError(
                "make_step(normalize='tokens') needs loss_fn to return (summed_loss, {'tokens': n}) with n the "
                "number of real (non-padding) tokens of the batch, e.g. (labels != -100).sum()."
            )
        group = state.extras.get(TOKENS)
        group = count.detach().float() if group is None else group + count.detach().float()
        if synced:
            total = accelerator.reduce(group, reduction="sum") if accelerator.num_processes > 1 else group
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor / total)
            group = None
        extras = {k: v for k, v in state.extras.items() if k != TOKENS}
        if group is not None:
            extras[TOKENS] = group
        return MappingProxyType(extras), loss.detach() / count.clamp(min=1)

    return stage


def make_step(
    ctx: Context,
    loss_fn: LossFn,
    *,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    normalize: str = "mean",
) -> Step:
    """Build a training step ``(state, batch) -> state``.

    Per batch, exactly what Accelerate's canonical loop does::

        with accelerator.accumulate(model):          # accumulation, no_sync under DDP
            loss, aux = loss_fn(model, batch)        # model forward under autocast
            accelerator.backward(loss)               # / accumulation steps, loss scaling
            if accelerator.sync_gradients:           # last micro-batch of a group
                clip (norm or value), once per update
                optimizer.step()
            scheduler.step()                         # Accelerate steps it on updates only
            if accelerator.sync_gradients:
                optimizer.zero_grad()

    and then one update of the state (:func:`record`): ``step`` +1 on an update
    the scaler did not skip, ``micro_step`` and ``batch_in_epoch`` +1, the
    detached loss and aux kept for the on-device running sums (added every 64
    micro-batches; see ``TrainState.unsummed``). No host-device synchronisation happens (no
    ``.item()``); Accelerate's own fp16 ``GradScaler`` is the exception, as in
    any fp16 loop.

    Where Accelerate's wrappers have nothing to do, the step skips them, decided
    here, once: on one process ``accumulate`` is only its ``_do_sync()`` (and
    with no accumulation, not even that); without a loss scaler or DeepSpeed
    ``backward`` is ``(loss / steps).backward()``; and
    the torch optimizer is called directly on updates. The parameters are the
    same, bit for bit (the equivalence tests cover every configuration).

    Args:
        ctx: the run's Context.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``; see :class:`~trainfold.LossFn`.
        clip_grad_norm: clip the gradients' global norm to this value on every update.
        clip_grad_value: clip each gradient element to ``[-v, v]`` on every update.
        normalize: ``"mean"`` (the default): the loss is a batch mean, and
            Accelerate divides it by the accumulation steps. ``"tokens"``: for
            sequence models whose batches hold different numbers of real
            (non-padding) tokens, ``loss_fn`` returns the **sum** of the token
            losses and ``aux["tokens"]``, the number of real tokens; the update
            then uses the gradient of the summed loss divided by the number of
            real tokens of the whole accumulation group on all processes (one
            all-reduce per update, on the device), which is what one big batch
            would give. See :func:`token_normalizer`.

    Returns:
        A plain function ``step(state, batch) -> state``.

    Raises:
        ValueError: bad clipping options.
        TypeError/ValueError (when called): the loss_fn returned something that is
            not a 0-d floating loss with a gradient.

    Example:
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

    .. versionadded:: 0.1.0
    """
    ctx.check()
    accelerator = ctx.accelerator
    clip = make_clip(accelerator, clip_grad_norm, clip_grad_value)
    start = micro_batch_start(accelerator)
    backward = backward_fn(accelerator)
    tokens = token_normalizer(ctx) if _normalize_mode(normalize) == "tokens" else None

    def step(state: TrainState, batch: Batch) -> TrainState:
        if state.accelerator is not accelerator:
            expect_owned("step", ctx, expect_state("step", state))
        if start is not None:
            start()
            return micro_batch(state, batch)
        with accelerator.accumulate(state.model):  # DDP's no_sync off the last micro-batch of a group
            return micro_batch(state, batch)

    def micro_batch(state: TrainState, batch: Batch) -> TrainState:
        model = state.model
        plan = _plan_for(state)
        ops = plan.ops
        guard = state.extras.get(GUARD) if state.extras else None
        extras = None
        loss, aux = compute_loss(loss_fn, model, batch)
        backward(loss)
        synced = accelerator.sync_gradients
        if tokens is not None:
            extras, loss = tokens(state, model, loss, aux, synced)
        if synced or not ops.fast:
            if synced and clip is not None:
                clip(model)
            if synced and guard is not None:  # stage 4 under nan_guard: update only if every gradient is finite
                guard = plan.guarded_update()(guard)
            else:
                ops.step()
        if state.scheduler is not None:
            state.scheduler.step()
        if synced or not ops.fast:
            ops.zero_grad()
        return record(state, loss, aux, updated=synced and not ops.was_skipped(), guard=guard, extras=extras)

    cache: dict[int, _UpdatePlan] = {}

    def _plan_for(state: TrainState) -> _UpdatePlan:
        # Decided once per optimizer (a state restored from a checkpoint keeps the same one).
        plan = cache.get(id(state.optimizer))
        if plan is None or plan.optimizer is not state.optimizer:
            plan = cache[id(state.optimizer)] = _UpdatePlan(state.optimizer, optimizer_ops(accelerator, state.optimizer))
        return plan

    step.__qualname__ = step.__name__ = f"step[{getattr(loss_fn, '__name__', 'loss_fn')}]"
    return step
