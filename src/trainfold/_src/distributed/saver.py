"""A Context's background saver: one thread, at most one save in flight, and a gloo group of its own.

What a background save does is ``trainfold/checkpoint/background.py``'s; this only runs it and hands
back its outcome.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


def _finish_at_exit(saver: weakref.ref[Saver]) -> None:
    """At interpreter shutdown, before ``concurrent.futures`` refuses new work: commit the save in flight, or fail loudly.

    A script that ends without ``ctx.close()`` (or ``with Context(...)``) would
    otherwise lose its last background save: Python's shutdown stops the thread
    pools the write uses, the half-written folder is removed, and the process
    exits 0. Registered with ``threading._register_atexit``, whose callbacks run
    in reverse order of registration, so this one (registered at the first
    background save, after ``concurrent.futures`` registered its own) runs first.
    A save that fails here is printed and the process exits with status 1: a lost
    checkpoint is never silent.
    """
    live = saver()
    if live is None or live._pending is None:
        return
    try:
        live.wait()
    except BaseException as exc:  # every failure is reported, then the exit status says so
        message = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write(
            f"trainfold: the checkpoint being written in the background when the program ended failed; it was not committed:\n{message}"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)  # the interpreter is shutting down with status 0: only this can still say it failed


class Saver:
    """A Context's background saver: one thread, one save in flight, and a gloo group of its own on several processes."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._group: Any = None
        self._at_exit = False

    def group(self, world: int) -> Any:
        """The group background saves agree on (made at the first one, a collective: every process saves there), with
        the default group's timeout (the Context's)."""
        if world > 1 and self._group is None:
            import torch.distributed as dist

            from trainfold._src.distributed.control import current_timeout

            self._group = dist.new_group(backend="gloo", timeout=current_timeout())
        return self._group

    def submit(self, work: Callable[[], None]) -> None:
        if self._pending is not None:
            raise RuntimeError(
                "a background save is already in flight: wait for it first"
            )  # save_checkpoint waits: never here
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainfold-save")
        if not self._at_exit:  # once per saver: a program that ends with the save in flight waits for it
            threading._register_atexit(_finish_at_exit, weakref.ref(self))  # type: ignore[attr-defined]  # CPython's hook for thread pools
            self._at_exit = True
        self._pending = self._pool.submit(work)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def forget(self) -> None:
        """Drop the thread and the group (the process group is being destroyed); call :meth:`wait` first."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool, self._pending, self._group = None, None, None
