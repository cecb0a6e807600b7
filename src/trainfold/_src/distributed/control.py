"""The control channel between processes: a CPU (gloo) group for the small decisions a run agrees on.

Owned here: the lazily made group, the per-epoch agreement on batch counts, and
the process group's timeout (what the error says when a collective waits too
long). Nothing here touches the device: a decision agreed on this channel never
waits for a CUDA step to finish, and a step never waits for it.
"""

from __future__ import annotations

import datetime
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from trainfold._src.base.checks import add_note
from trainfold._src.distributed.last_seen import who_is_missing


class Control:
    """A Context's control channel: its gloo group, made by every process at its first use.

    ``torch.distributed.new_group`` is a collective, so the first use must be at
    the same point on every process (``run_epoch``'s start, or an agreement
    round); every later operation is issued in the same order on every process.
    """

    def __init__(self) -> None:
        self._group: Any = None

    def group(self) -> Any:
        """The gloo group, with the default group's timeout (the Context's): a process that waits here for one that
        hangs gives up when it would in any other collective (a new group's own default is 30 minutes)."""
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=current_timeout())
        return self._group

    def forget(self) -> None:
        """Drop the group (the process group it belongs to is being destroyed)."""
        self._group = None


def gather_ints(control: Control, values: list[int], *, deadline_s: float | None = None) -> list[list[int]] | None:
    """Every process's ``values`` (same length on all), in rank order; None if the deadline passed first.

    With ``deadline_s`` the wait is a poll, so a process whose peers never
    arrive (they are stuck elsewhere) gets None back instead of waiting for the
    group's timeout; the caller then raises, and the launcher stops the others.
    """
    import torch.distributed as dist

    group = control.group()
    mine = torch.tensor(values, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, mine, group=group, async_op=True)
    if deadline_s is not None:
        until = time.monotonic() + deadline_s
        while not work.is_completed():
            if time.monotonic() > until:
                return None
            time.sleep(0.001)
    work.wait()
    return [p.tolist() for p in parts]  # sync: none, CPU tensors of the control channel


def max_over_processes(control: Control, value: int) -> int:
    """The largest of every process's ``value``: one blocking all-reduce of one number on the control channel.

    Every process must call it at the same point. No device work: a CPU tensor of the gloo group.
    """
    import torch.distributed as dist

    local = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=control.group())
    return int(local[0])  # sync: none, a CPU tensor


def set_timeout(timeout: datetime.timedelta) -> None:
    """Set the default process group's timeout (every collective after this uses it)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout)


def current_timeout() -> datetime.timedelta | None:
    """The default process group's timeout, as its backend reports it (None if it cannot be read)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        group = dist.distributed_c10d._get_default_group()
        for device in group._device_types:
            backend = group._get_backend(device)
            timeout = getattr(getattr(backend, "options", None), "_timeout", None)
            if isinstance(timeout, datetime.timedelta):
                return timeout
    except (RuntimeError, AttributeError, ValueError):
        return None
    return None


def looks_like_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that gave up waiting (gloo's and NCCL's wording)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text or "watchdog" in text)


def check_same_length(control: Control, length: int | None, where: str) -> None:
    """Refuse, on every process, an epoch whose processes have different numbers of batches.

    One process would wait forever in DDP's gradient all-reduce, another in the
    end-of-epoch reduction. One all-gather on the control channel per epoch.

    Raises:
        ValueError: the lengths differ (each process's is named).
    """
    lengths = [n for (n,) in gather_ints(control, [-1 if length is None else length]) or []]
    if len(set(lengths)) > 1:
        shown = ", ".join(f"rank {r}: {'unknown' if n < 0 else n}" for r, n in enumerate(lengths))
        raise ValueError(
            f"{where}: the processes have different numbers of batches this epoch ({shown}): one would wait "
            "forever for the others in a collective. Prepare the loader with ctx.prepare_loaders and keep "
            "Accelerate's even_batches=True (the default), or give every process the same number of batches."
        )


def check_same_count(control: Control, batches: int, *, wait_s: float) -> None:
    """At the end of an epoch of unknown length: fail, instead of hanging, if the processes ran different numbers of batches.

    Raises:
        RuntimeError: the others did not end their epochs within ``wait_s`` (they
            have more batches and wait for this process in a collective), or ended
            them after other numbers of batches.
    """
    counts = gather_ints(control, [batches], deadline_s=wait_s)
    if counts is None:
        raise RuntimeError(
            f"run_epoch: this process's loader ended after {batches} batches, but the other processes had not "
            f"ended their epochs {wait_s:.0f} s later: their loaders have more batches (a loader of unknown length "
            "that is not split evenly), and they wait for this one in a collective. Give every process the same "
            "number of batches (Accelerate's even_batches=True, or an IterableDataset that yields as many on each)."
        )
    if len({n for (n,) in counts}) > 1:
        shown = ", ".join(f"rank {r}: {n}" for r, (n,) in enumerate(counts))
        raise RuntimeError(
            f"run_epoch: the processes ran different numbers of batches this epoch ({shown}): give every process the same number."
        )


@contextmanager
def explaining_timeouts(processes: int) -> Iterator[None]:
    """Add to a collective's timeout error (in a run of ``processes`` processes) what it means and where the timeout is set."""
    try:
        yield
    except RuntimeError as exc:
        if processes > 1 and looks_like_timeout(exc):
            import torch.distributed as dist

            missing = who_is_missing(processes, dist.get_rank()) if dist.is_initialized() else None
            who = missing or "read the other processes' output."
            add_note(
                exc,
                f"trainfold: a collective waited for the process group's timeout ({current_timeout()}) for another "
                f"process, which is hung or has died: {who} Set the timeout with "
                "Context(accelerator, timeout=datetime.timedelta(minutes=5)) to notice sooner.",
            )
        raise


def gather_to_main(group: Any, value: Any) -> list[Any] | None:
    """Every process's ``value`` over ``group`` in rank order, on the group's first process (None on the others): each
    process sends its own value, and only the first receives them all (an all-gather would send every value to every
    process: a world size's worth to each)."""
    import torch.distributed as dist

    first = dist.get_global_rank(group, 0) if group is not None else 0
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(value, out, dst=first, group=group)
    return out


def gather_objects(group: Any, value: Any) -> list[Any]:
    """Every process's ``value`` over ``group`` (small, picklable: it travels between this run's own processes), in rank order."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
