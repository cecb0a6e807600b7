"""Ending a process group without hanging on gloo's worker threads."""

from __future__ import annotations

import time

#: how long a closing process lets go of the GIL before its process group is destroyed (see :func:`settle_collectives`)
SETTLE_S = 0.05


def settle_collectives() -> None:
    """Let the process group's worker threads finish with the collectives that already completed, so that the group can be destroyed.

    A gloo worker thread drops its reference to a collective after the caller has
    seen it complete. When that reference is the last, freeing the collective's
    tensors takes the GIL. If the group is destroyed just then by a thread that
    holds the GIL, its destructor joins that worker thread, which waits for the GIL:
    the process hangs for good (torch 2.13 on CPU). That thread holds the GIL when
    ``destroy_process_group`` drops the last reference, and when a DDP model, whose
    reducer keeps the group, is freed after the run closed. A short 2-process job
    through :func:`~trainfold.testing.run_distributed` hung about once in five calls.
    Sleeping lets go of the GIL, so the worker threads finish first; called before the
    group is destroyed (:meth:`~trainfold.Context.close`, and the Context's wrapper of
    ``accelerator.end_training``), and only where there is one.

    Examples:
        >>> from trainfold._src.distributed.teardown import settle_collectives
        >>> settle_collectives()  # no process group here: returns at once
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        time.sleep(SETTLE_S)
