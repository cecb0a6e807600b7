"""Where each process was last seen, so that a collective that times out can name the process that did not arrive.

At each stop-agreement round (about once per ``Context(stop_check_s=...)``), each process notes where it is: at which
micro-batch and update. What it is doing, in a word (its :class:`Phase`: waiting for data, in the forward and backward,
the update, a checkpoint, an evaluation), is set where it changes, by one attribute write, and sent with each write of
the line: a hung process's line says what it is doing, a stopped one's what it did at its last write (at most a
heartbeat before it stopped). A thread of its own writes the note to the process group's store, with the
time it was made and the time of the write, at once and then every :data:`HEARTBEAT_S` seconds: a store that does not
answer never holds up a step, and each line replaces the one before (one small write a second, whatever the run's
size). When a collective times out, the processes that are still there read every process's line
(:func:`who_is_missing`). Those waiting in the collective still write (their thread runs), so one whose line has not
been written for :data:`SILENT_S` seconds is stopped or dead: the oldest such is named. Where every process still
writes, the one whose note is oldest (hung in a step), or that never wrote, is named.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

#: the store key of each process's line, followed by its rank
PREFIX = "trainfold/last_seen/"
#: seconds between two writes of a process's line while it lives (its heartbeat)
HEARTBEAT_S = 1.0
#: a line not written for this long: its process is stopped or dead (three heartbeats missed, with room for a slow store)
SILENT_S = 3.5


def _store() -> Any:
    """The default process group's store (torch's own, which every launcher gives the group), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no group, or a torch without it: nothing is written, nothing named
        return None


class Phase:
    """What this process is doing, in a word (``now``), set where that changes: ``"data"`` (waiting for the loader's
    next batch, in ``run_epoch``), ``"forward/backward"`` (in a step, outside its update), ``"update"`` (the optimizer's
    step), ``"report"`` (``log_every``'s reduction), ``"checkpoint"``, ``"evaluation"``, ``"stop agreement"``; else
    ``"training"`` (between epochs, or in the user's own code)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = "training"


class LastSeen:
    """This process's line in the store, written by a thread of its own (started at the first :meth:`seen`, ended by
    :meth:`stop`), with the process's :class:`Phase` at each write."""

    def __init__(self) -> None:
        self.phase = Phase()
        self._note: tuple[int, float, int, int] | None = None  # (rank, when, micro-batch, update)
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def seen(self, rank: int, micro_step: int, update: int) -> None:
        """Note that this process (``rank``) is at ``micro_step`` (``update``); written soon after, with its phase."""
        self._note = (rank, time.time(), micro_step, update)
        self._wake.set()
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._write, name="trainfold-last-seen", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the writes (the Context closes: its process group goes)."""
        self._stopped = True
        self._wake.set()

    def _write(self) -> None:
        store = _store()
        while store is not None and not self._stopped:
            note = self._note
            if note is not None:
                rank, *where = note
                try:
                    store.set(f"{PREFIX}{rank}", json.dumps([time.time(), *where, self.phase.now]))
                except Exception:  # the store is gone (its host died, the group was destroyed): nothing more to say
                    return
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()


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
    now = time.time()
    silent = [rank for rank, line in heard.items() if now - line[0] > SILENT_S]
    if silent:  # its writer thread stopped too: the process is stopped (SIGSTOP, a frozen node) or dead
        rank = min(silent, key=lambda r: heard[r][0])
        written, _, micro_step, update, phase = heard[rank]
        return (
            f"process {rank} has not been heard from for {now - written:.0f} s (stopped or dead); it was last seen at "
            f"update {update} (micro-batch {micro_step}), in {phase}: it is the one the others waited for; read its "
            "output, or its node's."
        )
    rank = min(heard, key=lambda r: heard[r][1])
    _, at, micro_step, update, phase = heard[rank]
    return (
        f"process {rank} was last seen {now - at:.0f} s ago, at update {update} (micro-batch {micro_step}), in "
        f"{phase}: it is the one the others waited for (hung, stopped or dead); read its output."
    )
