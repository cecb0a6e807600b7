"""The only module that reads Accelerate's internals or branches on the backend.

Decisions here are taken once, when a step or an evaluation is built, never per
batch.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType


@attrs.frozen
class OptimizerOps:
    """How a step updates parameters: ``step()``, ``zero_grad()``, ``was_skipped()``.

    Each is called only on a synchronising micro-batch (the end of an
    accumulation group); off those, the step calls none of them.
    """

    step: Callable[[], Any]
    zero_grad: Callable[[], Any]
    was_skipped: Callable[[], bool]
    fast: bool
    #: the torch optimizer the fast path steps (None on Accelerate's path)
    raw: Any = None
    #: a loss scaler already skips non-finite updates (fp16)
    scaled: bool = False


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
        skipped = getattr(optimizer, "step_was_skipped", None)
        was_skipped = (lambda: bool(optimizer.step_was_skipped)) if skipped is not None else _never_skipped
        scaled = getattr(optimizer, "scaler", None) is not None
        return OptimizerOps(optimizer.step, optimizer.zero_grad, was_skipped, fast=False, scaled=scaled)
    inner = optimizer.optimizer
    # AcceleratedOptimizer.zero_grad passes set_to_none=True; so does torch's default.
    return OptimizerOps(inner.step, inner.zero_grad, _never_skipped, fast=True, raw=inner)


def real_samples_in_batch(accelerator: Accelerator, batch_size: int) -> int:
    """How many samples of the batch being processed are real, not padding.

    Under ``even_batches`` (Accelerate's default), a dataset that does not fill
    the last round of batches on every process is padded with samples from its
    start. The padding sits at the tail, in process order: the gathered last
    round holds the ``remainder`` real samples first. This is what
    ``gather_for_metrics`` relies on; here each process computes its own share
    so that sums over samples are exact without gathering per-sample values.
    """
    state = accelerator.gradient_state
    if accelerator.num_processes == 1 or not state.end_of_dataloader:
        return batch_size
    remainder = state.remainder
    if remainder is None or remainder <= 0:
        return batch_size  # no padding (exact multiple, drop_last, or unknown length)
    before_me = accelerator.process_index * batch_size
    return max(0, min(batch_size, remainder - before_me))


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (for reading lr and state)."""
    return getattr(optimizer, "optimizer", optimizer)
