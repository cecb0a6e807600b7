"""A Context's background saver: one thread, at most one save in flight, and a gloo group of its own.

What a background save does is ``_background.py``'s; this only runs it and hands
back its outcome.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Saver:
    """A Context's background saver: one thread, one save in flight, and a gloo group of its own on several processes."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._group: Any = None

    def group(self, world: int) -> Any:
        """The group background saves agree on (made at the first one, a collective: every process saves there)."""
        if world > 1 and self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def submit(self, work: Callable[[], None]) -> None:
        if self._pending is not None:
            raise RuntimeError("a background save is already in flight: wait for it first")  # save_checkpoint waits: never here
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainfold-save")
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

