"""``find_batch_size``: the largest per-process batch that fits, with the accumulation that keeps the global batch.

Owned here: :func:`find_batch_size` and :func:`batch_sizes` (the candidates it
tries). Out-of-memory is recognised as Accelerate's ``find_executable_batch_size``
recognises it (``accelerate.utils.should_reduce_batch_size``).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Generic, TypeVar

import attrs

from trainfold._src.base.checks import positive_int
from trainfold._src.core.context import Context

_T = TypeVar("_T")

#: the policies: keep the global batch by accumulation (trainfold's), or halve the batch and let the global one shrink (Accelerate's)
POLICIES = ("keep_global_batch", "halve")


@attrs.frozen
class BatchSizeFound(Generic[_T]):
    """What :func:`find_batch_size` found: ``train``'s result, and the Context, batch size and accumulation it ran with.

    Continue the run on ``ctx``: the Context passed to ``find_batch_size`` was retired by its first attempt.

    Examples:
        >>> from trainfold import testing
        >>> found = find_batch_size(testing.tiny_setup(seed=0)[0], lambda ctx, batch_size: "trained", global_batch=8)
        >>> found.result, found.batch_size, found.gradient_accumulation_steps
        ('trained', 8, 1)
    """

    result: _T
    ctx: Context = attrs.field(repr=False)
    batch_size: int
    gradient_accumulation_steps: int


#: What Accelerate keeps of every object it prepares: emptied back to its length before a failed attempt.
_PREPARED = ("_models", "_optimizers", "_schedulers", "_dataloaders")


def batch_sizes(per_process: int, start: int | None = None) -> list[int]:
    """The per-process batch sizes to try, largest first: the divisors of ``per_process`` up to ``start``.

    Only divisors, so that ``batch_size * accumulation_steps`` is exactly ``per_process``.

    Examples:
        >>> batch_sizes(24)
        [24, 12, 8, 6, 4, 3, 2, 1]
        >>> batch_sizes(24, start=10)
        [8, 6, 4, 3, 2, 1]
    """
    top = per_process if start is None else min(start, per_process)
    return [b for b in range(top, 0, -1) if per_process % b == 0]


def halvings(start: int) -> list[int]:
    """The batch sizes Accelerate's ``find_executable_batch_size`` tries: ``start`` halved down to 1.

    Examples:
        >>> halvings(24)
        [24, 12, 6, 3, 1]
    """
    sizes = [start]
    while sizes[-1] > 1:
        sizes.append(sizes[-1] // 2)
    return sizes


def find_batch_size(
    ctx: Context,
    train: Callable[[Context, int], _T],
    *,
    global_batch: int,
    start: int | None = None,
    policy: str = "keep_global_batch",
) -> BatchSizeFound[_T]:
    """Run ``train(ctx, batch_size)`` with the largest per-process batch that fits, keeping the global batch by accumulation.

    ``global_batch`` is the number of samples per optimizer update over every
    process. Each attempt takes the next per-process batch size ``b`` from
    :func:`batch_sizes` (divisors of ``global_batch / num_processes``, largest
    first, at most ``start``), sets the accumulation steps to
    ``global_batch / (num_processes * b)`` (:meth:`Context.with_accumulation`) and
    calls ``train(attempt_ctx, b)``, which builds its model, optimizer, loaders and
    state on ``attempt_ctx`` and trains. If it raises out-of-memory (as Accelerate's
    ``find_executable_batch_size`` recognises it: CUDA, XPU, MPS, CPU allocators),
    what the attempt prepared is dropped from the Accelerator, its micro-batches
    are taken off Accelerate's accumulation counter, the garbage is collected and
    the device cache emptied, and the next size is tried; any other
    error is raised. The global batch, hence the optimisation, is the same whatever
    size fits: the run is the one a hand-written loop with that batch size and
    accumulation gives.

    ``policy="halve"`` is Accelerate's instead: the per-process batch is halved from
    ``start`` (or ``global_batch / num_processes``) on each out-of-memory, with the
    accumulation steps the Context has: the global batch shrinks with it, and the
    optimisation changes (scale the learning rate yourself).

    On several processes every process must fail at the same attempt (the same
    model on the same devices does); one that fails alone leaves the others in a
    collective until the process group's timeout.

    Args:
        ctx: the run's Context (retired after the first attempt: ``train`` gets the one to use).
        train: ``train(ctx, batch_size) -> result``.
        global_batch: samples per update over all processes (a multiple of ``num_processes``).
        start: the largest per-process batch to try.
        policy: ``"keep_global_batch"`` (the default) or ``"halve"`` (Accelerate's).

    Returns:
        What the first attempt that fitted returned (``result``), in a :class:`BatchSizeFound` with the
        Context (``ctx``: continue on it), batch size and accumulation steps it ran with.

    Raises:
        ValueError: ``global_batch`` is not a positive multiple of the number of processes, or an unknown policy.
        RuntimeError: even a batch of one sample per process ran out of memory (the last error chained).

    Examples:
        >>> from trainfold import testing
        >>> ctx, *_ = testing.tiny_setup(seed=0)
        >>> def train(ctx, batch_size):
        ...     if batch_size > 4:
        ...         raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # as a GPU would
        ...     return batch_size, ctx.gradient_accumulation_steps
        >>> found = find_batch_size(ctx, train, global_batch=16)
        >>> found.result, found.batch_size, found.gradient_accumulation_steps, found.ctx.gradient_accumulation_steps
        ((4, 4), 4, 4, 4)
    """
    from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

    positive_int("global_batch", global_batch)
    if start is not None:
        positive_int("start", start)
    if policy not in POLICIES:
        raise ValueError(f"find_batch_size: policy must be one of {POLICIES} (got {policy!r}).")
    ctx.check()  # a retired (or closed) Context is refused here, not in the middle of an attempt
    accelerator = ctx.accelerator
    processes = accelerator.num_processes
    if global_batch % processes:
        raise ValueError(
            f"find_batch_size: global_batch={global_batch} is not a multiple of the {processes} processes."
        )
    per_process = global_batch // processes
    keep = policy == "keep_global_batch"
    sizes = batch_sizes(per_process, start) if keep else halvings(start or per_process)
    last: BaseException | None = None
    for batch_size in sizes:
        prepared = {name: len(getattr(accelerator, name, ())) for name in _PREPARED}
        micro_batches = accelerator.step  # Accelerate's accumulation phase, advanced by the failed attempt's batches
        steps = per_process // batch_size if keep else ctx.gradient_accumulation_steps
        attempt = ctx.with_accumulation(steps)
        try:
            return BatchSizeFound(train(attempt, batch_size), attempt, batch_size, steps)
        except Exception as exc:
            if not should_reduce_batch_size(exc):
                raise
            last = exc.with_traceback(None)  # its frames would keep the attempt's tensors alive
        _forget_since(accelerator, prepared)
        accelerator.step = micro_batches  # the next attempt's groups start where this one's did
        gc.collect()
        clear_device_cache()
    raise RuntimeError(
        f"find_batch_size: out of memory even with 1 sample per process (global_batch={global_batch}, accumulation "
        f"{per_process} steps): the model itself does not fit; shard it (FSDP, DeepSpeed) or use a smaller one."
    ) from last


def _forget_since(accelerator: Any, lengths: dict[str, int]) -> None:
    """Drop from the Accelerator's lists what a failed attempt prepared (they were ``lengths`` long before it)."""
    for name, length in lengths.items():
        kept = getattr(accelerator, name, None)
        if isinstance(kept, list):
            del kept[length:]
