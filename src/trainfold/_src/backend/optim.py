"""How a step calls the optimizer and backward under each backend, chosen once when the step is built.

Owned here: :func:`optimizer_ops` (the inner torch optimizer directly where
Accelerate's wrapper would add nothing), :func:`backward_fn`, the accumulation
counter Accelerate keeps, and :func:`micro_batch_start` (its gradient-sync flag).
"""

from __future__ import annotations

from typing import Any, Callable, cast

import attrs
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from trainfold._src.backend.engine import shards_parameters


@attrs.frozen
class OptimizerOps:
    """How a step updates parameters: ``step()``, ``zero_grad()``, ``was_skipped()``.

    Each is called only on a synchronising micro-batch (the end of an
    accumulation group); off those, the step calls none of them.
    """

    step: Callable[[], Any]
    zero_grad: Callable[[], Any]
    was_skipped: Callable[[], bool]
    #: the step calls the torch optimizer itself (only on the micro-batches that update)
    fast: bool
    #: the torch optimizer the fast path steps (None on Accelerate's path)
    raw: Any = None
    #: a loss scaler already skips non-finite updates (fp16)
    scaled: bool = False
    #: Accelerate's optimizer wrapper must see every micro-batch (it gates on ``sync_gradients`` itself)
    every_batch: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "every_batch", not self.fast)


def _never_skipped() -> bool:
    return False


def _needs_accelerate_optimizer(accelerator: Accelerator, optimizer: Any) -> bool:
    """True when AcceleratedOptimizer.step does real work: loss scaling, XLA, DeepSpeed, Megatron..."""
    if not isinstance(optimizer, AcceleratedOptimizer) or type(optimizer) is not AcceleratedOptimizer:
        return True  # DeepSpeed's and other engines' wrappers, or a user's subclass
    if optimizer.scaler is not None:
        return True
    if accelerator.distributed_type not in (
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.FSDP,
    ):
        return True
    inner = optimizer.optimizer
    return type(inner).__module__.startswith("lomo_optim")


def optimizer_ops(accelerator: Accelerator, optimizer: Any) -> OptimizerOps:
    """Choose, once, how the step calls the optimizer.

    ``AcceleratedOptimizer.step`` and ``zero_grad`` gate on ``sync_gradients``
    and add loss scaling (fp16), XLA gradient reduction and the LOMO special
    case. Where none of that applies they do nothing the step does not already
    do (it calls them only when synchronising), so the step calls the inner
    torch optimizer directly and skips ~200 us of Python per update
    (an uncached ``is_lomo_available()`` twice and ``inspect.signature``).
    """
    if _needs_accelerate_optimizer(accelerator, optimizer):

        def scaler_skipped() -> bool:
            return bool(optimizer.step_was_skipped)  # sync: none: a host flag Accelerate's scaler sets

        has_flag = getattr(optimizer, "step_was_skipped", None) is not None
        was_skipped = scaler_skipped if has_flag else _never_skipped
        scaled = getattr(optimizer, "scaler", None) is not None
        return OptimizerOps(optimizer.step, optimizer.zero_grad, was_skipped, fast=False, scaled=scaled)
    inner = optimizer.optimizer
    # AcceleratedOptimizer.zero_grad passes set_to_none=True; so does torch's default.
    return OptimizerOps(inner.step, inner.zero_grad, _never_skipped, fast=True, raw=inner)


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (for reading lr and state)."""
    return cast(torch.optim.Optimizer, getattr(optimizer, "optimizer", optimizer))


def set_lr(group: dict[str, Any], value: Any) -> None:
    """Set a parameter group's learning rate, in place where it is a tensor (a compiled update's: see :func:`lr_as_tensor`)."""
    if isinstance(group["lr"], torch.Tensor):
        number = float(value)  # sync: none for a number (a schedule's); the tensor is the update's, on the CPU
        group["lr"].fill_(number)
    else:
        group["lr"] = value


def lr_as_tensor(optimizer: torch.optim.Optimizer) -> None:
    """Make each group's learning rate a 0-d float64 tensor on the CPU, where it is a number.

    A compiled update specialises on a float learning rate: each new value a
    scheduler sets would compile the update again. A tensor is an input of the
    compiled code instead; torch's schedulers fill it in place. float64 holds the
    number exactly (what is saved and logged is the float that was set).
    """
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float64)


def plain_lr(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's (``param_groups``) or scheduler's (``_last_lr``) state dict with learning rates as numbers.

    A compiled update keeps the learning rate as a tensor (:func:`lr_as_tensor`); the
    checkpoint keeps the number, as an eager run's does, so the two read each other's.
    """
    if "param_groups" in state_dict:
        groups = [{**g, "lr": cpu_number(g["lr"])} if "lr" in g else g for g in state_dict["param_groups"]]
        return {**state_dict, "param_groups": groups}
    if "_last_lr" in state_dict:
        return {**state_dict, "_last_lr": [cpu_number(v) for v in state_dict["_last_lr"]]}
    return state_dict


def cpu_number(value: Any) -> Any:
    """A 0-d CPU tensor's number (a compiled update's learning rate, read when a checkpoint or snapshot is taken)."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.device.type == "cpu":
        return value.item()  # sync: none: a CPU tensor
    return value


def micro_batch_start(accelerator: Accelerator) -> Callable[[], None] | None:
    """What ``accelerator.accumulate(model)`` does for a micro-batch on one process, or None on several.

    On one process ``accumulate`` enters no ``no_sync`` context (that is for
    DDP): it only calls ``_do_sync()``, which sets ``sync_gradients`` and
    advances Accelerate's micro-batch counter. The step calls this instead,
    without a generator-based context manager and an ExitStack per micro-batch.
    With one accumulation step ``sync_gradients`` is always True and the
    counter's phase always 0, so the call is made only if something else left
    ``sync_gradients`` False. Under several processes, and under FSDP even on one
    (Accelerate turns FSDP2's gradient sync off inside an accumulation group, which
    with bf16 parameters changes the arithmetic), the step enters
    ``accelerator.accumulate`` itself (None).
    """
    if accelerator.use_distributed or shards_parameters(accelerator):
        return None
    if accelerator.gradient_accumulation_steps > 1:
        return cast("Callable[[], None]", accelerator._do_sync)
    gradient_state, do_sync = accelerator.gradient_state, accelerator._do_sync

    def keep_synced() -> None:
        if not gradient_state.sync_gradients:
            do_sync()

    return keep_synced


def backward_fn(accelerator: Accelerator) -> Callable[[torch.Tensor], Any]:
    """``accelerator.backward``, or the same computation without its wrapper where it only divides.

    Without DeepSpeed, Megatron, a loss scaler or a LOMO optimizer,
    ``accelerator.backward(loss)`` is ``(loss / accumulation_steps).backward()``;
    with one accumulation step the division is skipped (``x / 1`` is ``x``, bit
    for bit).
    """
    plain = (
        accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
        and accelerator.scaler is None
    )
    if not plain or getattr(accelerator, "has_lomo_optimizer", False):
        return cast("Callable[[torch.Tensor], Any]", accelerator.backward)
    steps = accelerator.gradient_accumulation_steps
    if steps == 1:
        return torch.Tensor.backward

    def divided(loss: torch.Tensor) -> None:
        (loss / steps).backward()

    return divided


def loss_scaler(accelerator: Accelerator | None) -> Any:
    """Accelerate's fp16 ``GradScaler``, or None."""
    return getattr(accelerator, "scaler", None)


def accumulation_counter(accelerator: Accelerator | None) -> int:
    """Accelerate's count of micro-batches (``accelerator.step``): its phase decides the next sync."""
    return int(getattr(accelerator, "step", 0))


def set_accumulation_counter(accelerator: Accelerator, value: int) -> None:
    """Put Accelerate's micro-batch count back (a resumed run continues its accumulation group)."""
    accelerator.step = value


def gradient_sync(accelerator: Accelerator) -> Any:
    """Accelerate's process-wide ``GradientState``; its ``sync_gradients`` says whether this micro-batch updates."""
    return accelerator.gradient_state
