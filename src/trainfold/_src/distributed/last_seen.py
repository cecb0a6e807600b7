"""Where each process was last seen, so that a collective that times out can name the process that did not arrive.

At each stop-agreement round (about once per ``Context(stop_check_s=...)``), each process writes one line to its
process group's store: when, at which micro-batch and update, in which phase. It is written from a thread of its own,
so a store that does not answer never holds up a step, and a round's line replaces the one before: one small write
a second, whatever the run's size. When a collective times out, the processes that are still there read every
process's line (:func:`who_is_missing`): the one seen longest ago, or never, is the one the others waited for.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

#: the store key of each process's line, followed by its rank
PREFIX = "trainfold/last_seen/"


def _store() -> Any:
    """The default process group's store (torch's own, which every launcher gives the group), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no group, or a torch without it: nothing is written, nothing named
        return None


class LastSeen:
    """This process's line in the store, written by a thread of its own (started at the first :meth:`seen`)."""

    def __init__(self) -> None:
        self._line: tuple[int, str] | None = None  # (rank, the line) not written yet
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def seen(self, rank: int, micro_step: int, update: int, phase: str) -> None:
        """Note that this process (``rank``) is at ``micro_step`` (``update``), in ``phase``; written soon after."""
        self._line = (rank, json.dumps([time.time(), micro_step, update, phase]))
        self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._write, name="trainfold-last-seen", daemon=True)
            self._thread.start()

    def _write(self) -> None:
        store = _store()
        while store is not None:
            self._wake.wait()
            self._wake.clear()
            line = self._line
            if line is None:
                continue
            try:
                store.set(f"{PREFIX}{line[0]}", line[1])
            except Exception:  # the store is gone (its host died, the group was destroyed): nothing more to say
                return


def who_is_missing(world: int, me: int, *, wait_s: float = 5.0) -> str | None:
    """A sentence naming the process seen longest ago (or never) by the store, with where it was; None if unknown,
    or if the store did not answer within ``wait_s`` (its host may be the process gone: the error is not held up)."""
    found: list[str | None] = []
    reader = threading.Thread(target=lambda: found.append(_who_is_missing(world, me)), daemon=True)
    reader.start()
    reader.join(wait_s)
    return found[0] if found else None


def _who_is_missing(world: int, me: int) -> str | None:
    """:func:`who_is_missing`, unbounded in time."""
    store = _store()
    if store is None or world < 2:
        return None
    seen: dict[int, list[Any] | None] = {}
    try:
        for rank in range(world):
            key = f"{PREFIX}{rank}"
            seen[rank] = json.loads(store.get(key)) if store.check([key]) else None
    except Exception:  # the store does not answer either: its host is the one gone
        return None
    others = {rank: line for rank, line in seen.items() if rank != me}
    if not others:
        return None
    never = sorted(rank for rank, line in others.items() if line is None)
    if never:
        return f"process {never[0]} was never seen at an agreement round: it is the one the others waited for."
    heard = {rank: line for rank, line in others.items() if line is not None}
    rank = min(heard, key=lambda r: heard[r][0])
    at, micro_step, update, phase = heard[rank]
    return (
        f"process {rank} was last seen {time.time() - at:.0f} s ago, at update {update} (micro-batch {micro_step}), in "
        f"{phase}: it is the one the others waited for (hung, stopped or dead); read its output."
    )
