"""The stages of ``make_step``: what acts on a micro-batch between backward and the optimizer update.

A step is a fixed pipeline, chosen once when ``make_step`` builds it, the way
optax chains gradient transformations:

    loss, aux = loss_fn(model, batch); backward(loss)
    for each stage: stage.on_batch(mb)           # every micro-batch
    if the micro-batch ends an accumulation group:
        for each stage: stage.on_update(mb)      # clip, scale, check the gradients...
        optimizer update (skipped where a gating stage set mb.skip), zero_grad
        for each stage: stage.after_update(mb)   # read counters, decide to stop
    scheduler.step(); record the new state

Owned here: :class:`MicroBatch` (what a stage reads and changes), :class:`Stage`
(a stage's hooks) and the clipping stages :func:`clip_by_norm` and
:func:`clip_by_value`. ``nan_guard`` (:mod:`trainfold._src.core.guard`) and token
normalisation (:mod:`trainfold._src.core.tokens`) are stages too, contributed from their
own modules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import attrs
import torch

from trainfold._src.backend.engine import owns_clipping
from trainfold._src.base.running_sums import WEIGHT
from trainfold._src.core.stop import Stop

if TYPE_CHECKING:
    from trainfold._src.core.context import Context
    from trainfold._src.core.state import TrainState


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
        stop: the new state's :class:`~trainfold.Stop` (None: the run goes on); a stage that
            stops the run sets it (``mb.stop = Stop("nan_guard")``).

    Examples:
        >>> from trainfold import testing
        >>> seen = []
        >>> watch = Stage(name="watch", on_batch=lambda mb: seen.append((mb.synced, mb.loss.ndim)))
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> _ = run_epoch(ctx, make_step(ctx, loss_fn, stages=[watch]), loader, state)
        >>> seen
        [(True, 0), (True, 0), (True, 0), (True, 0)]
    """

    state: TrainState
    model: torch.nn.Module
    loss: torch.Tensor
    aux: Mapping[str, torch.Tensor]
    synced: bool
    extras: Mapping[str, Any]
    skip: torch.Tensor | None = None
    stop: Stop | None = None


#: A stage's hook: reads and changes a :class:`MicroBatch`, returns nothing. No host sync.
Hook = Callable[[MicroBatch], None]


@attrs.frozen
class Stage:
    """A stage of ``make_step``'s pipeline: a name and up to three hooks.

    Attributes:
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

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> norms = []
        >>> record = Stage("grad_norm", on_update=lambda mb: norms.append(mb.model.weight.grad.norm()))
        >>> state = run_epoch(ctx, make_step(ctx, loss_fn, stages=[record]), loader, state)
        >>> len(norms)
        4
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
    """What ``make_step(stages=...)`` accepts: a :class:`Stage`, or an object whose ``bind(ctx)`` returns one.

    Examples:
        >>> import attrs
        >>> @attrs.frozen
        ... class CountUpdates:  # a spec: bound once, when make_step builds the step
        ...     def bind(self, ctx):
        ...         return Stage(name="count", on_update=lambda mb: None)
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> run_epoch(ctx, make_step(ctx, loss_fn, stages=[CountUpdates()]), loader, state).step
        4
    """

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
    return float(value)  # sync: none: an option's number


#: The aux name under which a stage records the gradient norm of each update (see :func:`recording_norm`).
GRAD_NORM = "grad_norm"


@attrs.frozen
class _Clip:
    kind: str
    threshold: float
    record: bool = False

    def bind(self, ctx: Context) -> Stage:
        accelerator = ctx.accelerator
        if owns_clipping(accelerator):
            what = (
                "the gradient norm is DeepSpeed's (engine.get_global_grad_norm())"
                if math.isinf(self.threshold)
                else ("clipping comes from the DeepSpeed config: set 'gradient_clipping' there")
            )
            raise ValueError(
                f"under DeepSpeed, {what}; leave clip_grad_norm/clip_grad_value/record_grad_norm (and clip_by_norm, "
                "clip_by_value) out of make_step."
            )
        threshold = self.threshold
        name = "record_grad_norm" if math.isinf(threshold) else f"clip_by_{self.kind}({threshold})"
        if self.kind == "norm":
            clip: Callable[..., Any] = accelerator.clip_grad_norm_
        else:
            clip = accelerator.clip_grad_value_
        if not self.record:

            def on_update(mb: MicroBatch) -> None:
                clip(mb.model.parameters(), threshold)

            return Stage(name, on_update=on_update)

        # The norm of each update, as aux "grad_norm" weighted by "grad_norm@weight" (1 on updates, 0 on the other
        # micro-batches): the running sums then average it over updates, reduced with the loss (no sync of its own).
        zero = torch.zeros((), device=accelerator.device)
        one = torch.ones((), device=accelerator.device)
        weight = GRAD_NORM + WEIGHT

        def on_batch(mb: MicroBatch) -> None:
            mb.aux = {**mb.aux, GRAD_NORM: zero, weight: zero}

        def on_update_recording(mb: MicroBatch) -> None:
            norm = clip(mb.model.parameters(), threshold)
            mb.aux = {
                **mb.aux,
                GRAD_NORM: norm.detach().float().reshape(()),  # sync: none: a cast on the device
                weight: one,
            }

        return Stage(name, on_batch=on_batch, on_update=on_update_recording)


def clip_by_norm(max_norm: float) -> StageSpec:
    """A stage that clips the gradients' global norm to ``max_norm``, once per update.

    ``accelerator.clip_grad_norm_`` (which unscales fp16 gradients first and
    handles FSDP's sharded norms), on the micro-batches that update only.
    ``make_step(clip_grad_norm=x)`` is this stage.

    ``make_step(..., record_grad_norm=True)`` makes it record the norm it computes
    (before clipping): ``train_grad_norm`` in the history, ``train/grad_norm`` from
    ``log_every``.

    Args:
        max_norm: the largest global L2 norm of the gradients (a positive finite number).

    Returns:
        A stage spec for ``make_step(..., stages=[...])``; it binds to the Context when the step is built.

    Raises:
        ValueError: ``max_norm`` is not a positive finite number; under DeepSpeed (when ``make_step``
            binds it), whose config does the clipping.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, make_step(ctx, loss_fn, stages=[clip_by_norm(0.5)], record_grad_norm=True), loader, state)
        >>> round(state.metrics["train_grad_norm"], 4)  # the mean norm before clipping, over the epoch's updates
        3.7525
    """
    return _Clip("norm", _positive("clip_grad_norm", max_norm))


def recording_norm(spec: StageSpec | None = None) -> StageSpec:
    """``make_step(record_grad_norm=True)``'s stage: ``spec`` (a :func:`clip_by_norm`) made to record the norm it
    computes before clipping, or, for None, a stage that records the norm without clipping.

    The norm is ``accelerator.clip_grad_norm_(params, inf)``'s (fp16 gradients unscaled, FSDP's shards combined;
    the gradients are multiplied by exactly 1.0, so training is unchanged bit for bit). It is kept on the device
    in the running sums as the aux value ``grad_norm``, weighted so that its means are over updates, not
    micro-batches; ``state.last_aux["grad_norm"]`` is the last update's norm (0 on a micro-batch that did not update).
    """
    if spec is None:
        return _Clip("norm", math.inf, True)
    if not isinstance(spec, _Clip):
        raise TypeError(f"only a clip_by_norm stage records the norm it computes (got {spec!r}).")
    return attrs.evolve(spec, record=True)


def is_norm_clip(spec: StageSpec) -> bool:
    """Whether ``spec`` is a :func:`clip_by_norm` stage."""
    return isinstance(spec, _Clip) and spec.kind == "norm"


def clip_by_value(max_value: float) -> StageSpec:
    """A stage that clips each gradient element to ``[-max_value, max_value]``, once per update.

    ``make_step(clip_grad_value=x)`` is this stage.

    Args:
        max_value: the largest absolute value of a gradient element (a positive finite number).

    Returns:
        A stage spec for ``make_step(..., stages=[...])``.

    Raises:
        ValueError: ``max_value`` is not a positive finite number; under DeepSpeed (when ``make_step`` binds it).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> run_epoch(ctx, make_step(ctx, loss_fn, stages=[clip_by_value(0.1)]), loader, state).step
        4
    """
    return _Clip("value", _positive("clip_grad_value", max_value))
