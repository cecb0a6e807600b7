"""How a step applies an optimizer update: plainly, or gated by a flag a stage computed on the device.

Owned here: :class:`Update` (one optimizer's update, decided the first time a
step meets that optimizer), the gated strategies (:func:`skip_on_device`,
:func:`skip_after_read`, :func:`left_to_scaler`) and :class:`Updates`, which
finds them. The decisions are kept on the optimizer itself, so they live exactly
as long as it does: a step function used for many trials holds none of their
optimizers or models.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
from accelerate import Accelerator

from trainfold._src.backend.optim import OptimizerOps, optimizer_ops
from trainfold._src.core.compiling import Compile, step_and_zero_of, update_of

#: ``apply(skip)``: step and zero the gradients; where the 0-d ``skip`` flag is non-zero, leave the weights.
Apply = Callable[["torch.Tensor | None"], None]


@attrs.frozen
class Update:
    """How one optimizer is updated: Accelerate's calls (``ops``) and, for a gated step, ``apply``.

    ``ops.every_batch`` is True where Accelerate's optimizer wrapper must see every
    micro-batch (loss scaling, XLA, DeepSpeed); otherwise the step calls the
    optimizer only on the micro-batches that end an accumulation group.
    """

    ops: OptimizerOps
    apply: Apply


def plain(ops: OptimizerOps) -> Apply:
    """The update with no gate (a flag, if any, is ignored)."""
    step, zero_grad = ops.step, ops.zero_grad

    def apply(skip: torch.Tensor | None) -> None:
        step()
        zero_grad()

    return apply


def gated(ops: OptimizerOps) -> Apply:
    """The update skipped where the flag is set, the cheapest way this optimizer allows.

    On the device for a fused torch optimizer called directly (no host sync),
    by Accelerate's fp16 loss scaler (which skips non-finite updates itself),
    and after one host read of the flag for any other optimizer.
    """
    if ops.scaled:
        skip_or_step = left_to_scaler(ops.step)
    elif ops.fast and supports_found_inf(ops.raw):
        skip_or_step = skip_on_device(ops.raw)
    else:
        skip_or_step = skip_after_read(ops.step)
    zero_grad = ops.zero_grad

    def apply(skip: torch.Tensor | None) -> None:
        if skip is None:
            ops.step()
        else:
            skip_or_step(skip)
        zero_grad()

    return apply


#: The attribute of an optimizer that holds its decided updates, by kind (plain, gated).
_ATTRIBUTE = "_trainfold_updates"


class Updates:
    """A step's :class:`Update` per optimizer, decided on first use and kept on the optimizer.

    A cache in the step (even a weak-keyed one) would outlive the optimizer or
    keep it alive: an ``Update`` holds the optimizer's bound methods. Kept in the
    optimizer's own ``__dict__``, it goes when the optimizer goes.
    """

    def __init__(self, accelerator: Accelerator, *, gate: bool, compile: Compile | None = None) -> None:
        self._accelerator = accelerator
        self._gate = gate
        self._make = gated if gate else plain
        self._compile = compile
        # a compiled update is this step's own (its settings, its compiled code); a plain one is every step's
        self._key: Any = gate if compile is None else (gate, self)

    def of(self, optimizer: Any) -> Update:
        """The update for ``optimizer`` (the prepared one a TrainState holds)."""
        known = optimizer.__dict__.get(_ATTRIBUTE)
        update = None if known is None else known.get(self._key)
        if update is None:
            ops = optimizer_ops(self._accelerator, optimizer)
            if self._compile is not None:
                ops = compiled(ops, self._compile, gated=self._gate)
            update = Update(ops, self._make(ops))
            optimizer.__dict__.setdefault(_ATTRIBUTE, {})[self._key] = update
        return update


def compiled(ops: OptimizerOps, spec: Compile, *, gated: bool = False) -> OptimizerOps:
    """``ops`` with the torch optimizer's ``step`` compiled.

    An update with no gate always zeroes the gradients right after the step: there
    ``step`` is the two compiled as one (:func:`~trainfold._src.core.compiling.step_and_zero_of`)
    and ``zero_grad`` does nothing. A gated update may skip the step and still zero
    the gradients: there only the step is compiled.

    Raises:
        ValueError: Accelerate's optimizer wrapper must run on every micro-batch here
            (fp16 loss scaling, XLA, an engine's wrapper): there is no plain update to compile.
    """
    if not ops.fast:
        raise ValueError(
            "make_step(compile=...): the optimizer's update cannot be compiled here: Accelerate's optimizer "
            "wrapper must run it (fp16 loss scaling, XLA, or a wrapper of another engine). Compile the rest "
            "with Compile(optimizer=False)."
        )
    if gated:
        return attrs.evolve(ops, step=update_of(ops.raw, spec))
    return attrs.evolve(ops, step=step_and_zero_of(ops.raw, spec), zero_grad=zeroed_by_step)


def zeroed_by_step() -> None:
    """An update's ``zero_grad`` where its ``step`` has set the gradients to None already."""


def supports_found_inf(optimizer: Any) -> bool:
    """Fused torch optimizers skip an update on the device when given ``found_inf``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))  # sync: none: a class flag


def skip_on_device(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    """A fused optimizer's update, skipped on the device where ``flag`` is set: no host sync."""

    def apply(flag: torch.Tensor) -> None:
        # The protocol torch's GradScaler uses: the fused kernel skips the update (and undoes
        # its step count) where found_inf is non-zero.
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = flag  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]

    return apply


def skip_after_read(step: Callable[[], Any]) -> Callable[[torch.Tensor], None]:
    """Any other optimizer's update, applied after reading ``flag`` on the host (one sync per update)."""

    def apply(flag: torch.Tensor) -> None:
        if not flag:  # sync: once per update, only for a non-fused optimizer under a gating stage
            step()

    return apply


def left_to_scaler(step: Callable[[], Any]) -> Callable[[torch.Tensor], None]:
    """The update under the fp16 loss scaler, which skips non-finite updates itself and must see every step."""

    def apply(flag: torch.Tensor) -> None:
        del flag  # unused: the scaler checks the gradients itself
        step()

    return apply
