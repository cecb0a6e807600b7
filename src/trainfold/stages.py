"""The stages of ``make_step``: what acts on a micro-batch between backward and the optimizer update.

A step is a fixed pipeline, chosen once when ``make_step`` builds it, the way
optax chains gradient transformations::

    loss, aux = loss_fn(model, batch); backward(loss)
    for each stage: stage.on_batch(mb)           # every micro-batch
    if the micro-batch ends an accumulation group:
        for each stage: stage.on_update(mb)      # clip, scale, check the gradients...
        optimizer update (skipped where a gating stage set mb.skip), zero_grad
        for each stage: stage.after_update(mb)   # read counters, decide to stop
    scheduler.step(); record the new state

Owned here: :class:`MicroBatch` (what a stage reads and changes), :class:`Stage`
(a stage's hooks) and the clipping stages :func:`clip_by_norm` and
:func:`clip_by_value`. ``nan_guard`` (:mod:`trainfold.guard`) and token
normalisation (:mod:`trainfold.tokens`) are stages too, contributed from their
own modules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import attrs
import torch

from ._backend import owns_clipping

if TYPE_CHECKING:
    from .context import Context
    from .state import TrainState


@attrs.define(slots=True, eq=False)
class MicroBatch:
    """One micro-batch on its way through a step's stages, after backward.

    It lives for one micro-batch and is never stored: stages change its fields
    in place (the gradients too, in ``model``), and the step then records the
    new state from it.

    Attributes:
        state: the state the step was called with (read it; never change it).
        model: the prepared model, whose ``.grad`` tensors hold this group's gradients.
        loss: the micro-batch's loss as it will be recorded (a stage may replace it,
            e.g. by a per-token mean); the step has already called backward on it.
        aux: the loss function's aux values.
        synced: this micro-batch ends an accumulation group: the optimizer updates now.
        extras: the new state's ``extras`` (replace it with a new mapping to record a
            stage's state, e.g. ``MappingProxyType({**mb.extras, "mine": record})``).
        skip: a 0-d float32 flag on the device, set by a gating stage: the update is
            skipped where it is non-zero (the ``found_inf`` protocol of torch's GradScaler).
        should_stop: the new state's ``should_stop``.
        stop_reason: why a stage set ``should_stop`` (the new state's ``stop_reason``).
    """

    state: TrainState
    model: torch.nn.Module
    loss: torch.Tensor
    aux: Mapping[str, torch.Tensor]
    synced: bool
    extras: Mapping[str, Any]
    skip: torch.Tensor | None = None
    should_stop: bool = False
    stop_reason: str = ""


#: A stage's hook: reads and changes a :class:`MicroBatch`, returns nothing. No host sync.
Hook = Callable[[MicroBatch], None]


@attrs.frozen
class Stage:
    """A stage of ``make_step``'s pipeline: a name and up to three hooks.

    Args:
        name: shown in errors and in the step's repr.
        on_batch: runs on every micro-batch, after backward.
        on_update: runs on the micro-batches that update, before the update
            (gradients are complete and, under DDP, averaged over processes).
        after_update: runs after the update (and ``zero_grad``).
        gates_update: ``on_update`` sets ``mb.skip``; the step then applies each
            update through a gate (decided once per optimizer).
        masks_nonfinite: a non-finite loss adds nothing to the running loss sum and
            is counted in ``train_nonfinite`` instead.

    Pass stages to ``make_step(ctx, loss_fn, stages=[...])``; they run in order
    (each hook kind in the order given). A stage that needs the Context is an
    object whose ``bind(ctx)`` returns a Stage (the built-in ones are); a Stage
    binds to itself.

    Example:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> norms = []
        >>> record = Stage("grad_norm", on_update=lambda mb: norms.append(mb.model.weight.grad.norm()))
        >>> state = run_epoch(ctx, make_step(ctx, loss_fn, stages=[record]), loader, state)
        >>> len(norms)
        4

    .. versionadded:: 0.2.0
    """

    name: str
    on_batch: Hook | None = None
    on_update: Hook | None = None
    after_update: Hook | None = None
    gates_update: bool = False
    masks_nonfinite: bool = False

    def bind(self, ctx: Context) -> Stage:
        """A Stage needs no Context: it is its own bound form."""
        del ctx  # unused
        return self


class StageSpec(Protocol):
    """What ``make_step(stages=...)`` accepts: a :class:`Stage`, or an object whose ``bind(ctx)`` returns one."""

    def bind(self, ctx: Context, /) -> Stage: ...


def bind_all(ctx: Context, specs: tuple[StageSpec, ...]) -> tuple[Stage, ...]:
    """Bind every stage to the Context, once, when the step is built.

    Raises:
        TypeError: an item is not a stage.
    """
    bound = []
    for spec in specs:
        bind = getattr(spec, "bind", None)
        if not callable(bind):
            raise TypeError(
                f"make_step(stages=...) takes Stage objects (or objects with bind(ctx) -> Stage, such as "
                f"clip_by_norm(1.0) or nan_guard(3)); got {spec!r}, a {type(spec).__name__}."
            )
        stage = bind(ctx)
        if not isinstance(stage, Stage):
            raise TypeError(f"{type(spec).__name__}.bind(ctx) returned a {type(stage).__name__}, not a Stage.")
        bound.append(stage)
    return tuple(bound)


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number (got {value!r}).")
    return float(value)


@attrs.frozen
class _Clip:
    kind: str
    threshold: float

    def bind(self, ctx: Context) -> Stage:
        accelerator = ctx.accelerator
        if owns_clipping(accelerator):
            raise ValueError(
                "under DeepSpeed, clipping comes from the DeepSpeed config: set 'gradient_clipping' there "
                "and leave clip_grad_norm/clip_grad_value (and clip_by_norm/clip_by_value) out of make_step."
            )
        threshold = self.threshold
        if self.kind == "norm":
            clip: Callable[..., Any] = accelerator.clip_grad_norm_
        else:
            clip = accelerator.clip_grad_value_

        def on_update(mb: MicroBatch) -> None:
            clip(mb.model.parameters(), threshold)

        return Stage(f"clip_by_{self.kind}({threshold})", on_update=on_update)


def clip_by_norm(max_norm: float) -> StageSpec:
    """A stage that clips the gradients' global norm to ``max_norm``, once per update.

    ``accelerator.clip_grad_norm_`` (which unscales fp16 gradients first and
    handles FSDP's sharded norms), on the micro-batches that update only.
    ``make_step(clip_grad_norm=x)`` is this stage.

    .. versionadded:: 0.2.0
    """
    return _Clip("norm", _positive("clip_grad_norm", max_norm))


def clip_by_value(max_value: float) -> StageSpec:
    """A stage that clips each gradient element to ``[-max_value, max_value]``, once per update.

    ``make_step(clip_grad_value=x)`` is this stage.

    .. versionadded:: 0.2.0
    """
    return _Clip("value", _positive("clip_grad_value", max_value))
