"""Where a run's wall time goes: host time per part, added where each part happens, read by ``log_every(watch=...)``.

Owned here: :class:`Clock`, a Context's (``ctx.runtime.clock``). It measures only while a
watcher is on (``log_every(..., watch=True)`` turns it on): otherwise each place that could
time a part pays one attribute read. Nothing here synchronises a device: these are host
times (on a GPU, a step's host time is the time to queue its work; the device's own time
shows where the host waits for it: at a report's one reduction, or in the loader).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

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
        #: per process (``Watch(stragglers=...)`` on several processes): this process's :class:`Compute`, else None
        self.compute: Compute | None = None
        #: and how often this epoch's reports named a straggler (``compose.stragglers.Named``), else None
        self.named: Any = None

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

    def spent(self, part: str) -> float:
        """The seconds counted to ``part`` since the last :meth:`take` (read, not reset)."""
        return self._spent[part]

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


class Compute:
    """This process's compute and collective waiting, per host clock, for naming a straggler (a watched run on several
    processes, ``Watch(stragglers=...)``).

    Per micro-batch, ``compute`` is the time from the micro-batch's start (its batch in hand) to the moment its
    backward's last gradient was ready, and ``collective`` the rest of the backward: under DDP, the wait for the
    gradients' all-reduce, where the processes that finished first wait for the last one. A process that computes
    slowly has the larger ``compute``, the others the larger ``collective``: the all-reduce, which makes every process's
    step time the same, does not hide it. The moment is the last call of a hook after a parameter's gradient is
    accumulated (``register_post_accumulate_grad_hook``), learnt on the first synced backward and kept on that one
    parameter alone: the hooks observe, the gradients and the collectives are DDP's as ever. Where no hook is called
    (FSDP, DeepSpeed, no trainable parameter), ``collective`` stays 0 and the whole micro-batch counts as compute.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> compute = Compute()
        >>> began = compute.begin(model)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> compute.end(began, synced=True)
        >>> compute.last is not None, len(compute.handles), compute.seconds > 0
        (True, 1, True)
    """

    def __init__(self) -> None:
        self.seconds = 0.0  # compute since the last take
        self.collective = 0.0  # collective waiting since the last take
        self.ready = 0.0  # when the running backward's watched gradient was last ready (0: not yet)
        self.model_id: int | None = None
        self.handles: list[Any] = []
        self.last: int | None = None  # the parameter whose gradient the first synced backward made last (by index)
        self.learning = True

    def begin(self, model: Any) -> float:
        """A micro-batch begins: hook ``model``'s parameters (a new model: all, to learn which is last); now."""
        if id(model) != self.model_id:
            self._hook(model)
        self.ready = 0.0
        return time.perf_counter()

    def end(self, began: float, *, synced: bool) -> None:
        """Its backward returned: add its compute and, where it synced, its wait for the collectives."""
        now = time.perf_counter()
        ready = self.ready if self.ready else now
        if synced:
            self.seconds += ready - began
            self.collective += now - ready
            if self.learning and self.last is not None:
                self._keep(self.last)
        else:  # (no_sync: no collective)
            self.seconds += now - began

    def take(self) -> tuple[float, float]:
        """The compute and collective seconds since the last call, and start again from zero."""
        taken, self.seconds, self.collective = (self.seconds, self.collective), 0.0, 0.0
        return taken

    def _hook(self, model: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.model_id, self.last, self.learning = [], id(model), None, True
        params = [p for p in model.parameters() if p.requires_grad]
        for index, param in enumerate(params):
            self.handles.append(param.register_post_accumulate_grad_hook(self._noted(index)))

    def _noted(self, index: int) -> Callable[[Any], None]:
        def noted(_param: Any) -> None:
            self.ready, self.last = time.perf_counter(), index

        return noted

    def _keep(self, last: int) -> None:
        """Keep the hook of the parameter whose gradient came last, and remove the others (their calls cost per step)."""
        for index, handle in enumerate(self.handles):
            if index != last:
                handle.remove()
        self.handles, self.learning = [self.handles[last]], False
