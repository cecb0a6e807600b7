"""Where a run's wall time goes: host time per part, added where each part happens, read by ``log_every(watch=...)``.

Owned here: :class:`Clock`, a Context's (``ctx.runtime.clock``). It measures only while a
watcher is on (``log_every(..., watch=True)`` turns it on): otherwise each place that could
time a part pays one attribute read. Nothing here synchronises a device: these are host
times (on a GPU, a step's host time is the time to queue its work; the device's own time
shows where the host waits for it: at a report's one reduction, or in the loader).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

#: The parts :class:`Clock` times, each where it happens.
PARTS = ("data", "update", "checkpoint", "stop")


class Clock:
    """Seconds of host time per part since the last :meth:`take`: ``data`` (waiting for the loader's next batch, in
    ``run_epoch``), ``update`` (the optimizer's step and zeroing, in the step), ``checkpoint`` (the time a save blocks
    training), ``stop`` (the processes' agreement on a stop request).

    Examples:
        >>> clock = Clock()
        >>> clock.add("data", 0.5)  # off: nothing is kept
        >>> clock.on = True
        >>> clock.add("data", 0.5); clock.add("data", 0.25)
        >>> clock.take()["data"]
        0.75
    """

    def __init__(self) -> None:
        self.on = False
        self._spent = dict.fromkeys(PARTS, 0.0)  # (one dict for the run: the loader's timing holds it)
        self.samples = 0  # the samples this process's watched steps took, in all (a watched step adds its batch's)
        self.epoch_began: float | None = None  # when this process began the open epoch's first batch (while on)
        #: the watcher's peak memory since its last report and since the open epoch began (``compose.watch.Peaks``),
        #: or None while memory is not watched: the epoch's end reads it for the epoch's record
        self.peaks: Any = None
        self._epoch_from = 0  # ``samples`` then

    def begin_epoch(self) -> None:
        """Note the open epoch's start, if not noted yet (``run_epoch``, before its first batch; while on)."""
        if self.on and self.epoch_began is None:
            self.epoch_began, self._epoch_from = time.perf_counter(), self.samples

    def end_epoch(self) -> tuple[float, int] | None:
        """The open epoch's seconds since :meth:`begin_epoch` and its samples, and forget them; None where not noted."""
        began, self.epoch_began = self.epoch_began, None
        return None if began is None else (max(time.perf_counter() - began, 1e-9), self.samples - self._epoch_from)

    def add(self, part: str, seconds: float) -> None:
        """Count ``seconds`` of host time to ``part`` (while the clock is on)."""
        if self.on:
            self._spent[part] += seconds

    def take(self) -> dict[str, float]:
        """The seconds per part since the last call, and start again from zero."""
        spent = dict(self._spent)
        for part in PARTS:
            self._spent[part] = 0.0
        return spent

    def timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, each wait for the next counted to ``data`` (used while on: nothing checked per batch)."""
        now, spent = time.perf_counter, self._spent
        while True:
            start = now()
            try:
                batch = next(batches)
            except StopIteration:
                spent["data"] += now() - start
                return
            spent["data"] += now() - start
            yield batch
