"""Signals as a request to stop at the next step boundary, agreed by every process within a bounded time.

For the whole life of a Context (from its creation to ``ctx.close()``), the
signals it names (SIGINT and SIGTERM by default) do not kill the process: the
first one is a request to stop, honoured at the next optimizer update, when an
evaluation ends, or before a loop's next epoch, so a final checkpoint can be
written (see :class:`Handlers`). A launcher's echo of the signal stays a request; the
signal again a second later, or a request nothing acted on within the Context's
``stop_deadline_s``, acts as it would without trainfold.

On one process the request is seen at the next step boundary. On several, a
signal may reach one process only (a scheduler that signals one task, a user
who kills one pid), and every process must stop at the same step or the next
collective mismatches. So every process takes part in agreement *rounds* on the
control channel (a CPU gloo group, :mod:`trainfold._src.distributed.control`), whether or not
it saw a signal: at agreed micro-batches each launches an asynchronous
all-reduce of ``(its signal, its seconds per micro-batch)`` and, one round
later, reads the previous round's result, which is then the same on every
process. Launching costs ~30 us of CPU and reading a finished all-reduce
nothing: no step waits for it, no step synchronises with the device. The round
length is re-chosen from each round's measured speed so that a round takes
about ``Context(stop_check_s=...)`` seconds: a signal on any process stops every
process within two rounds and the optimizer update in progress (rounds fall at
the ends of accumulation groups, so the run stops at an update).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import weakref
from typing import Any, Sequence

import torch

from trainfold._src.distributed.control import Control, max_over_processes
from trainfold._src.distributed.last_seen import LastSeen

log = logging.getLogger("trainfold")

#: ``next_check`` when nothing is due: no round, no request (one process)
NEVER = 1 << 62
#: the most micro-batches between two rounds (a round of very fast steps)
MAX_PERIOD = 100_000


class Interrupt:
    """The stop request a Context carries: set by a signal, agreed at step boundaries.

    It is a signal from outside the run, not run state (it is not checkpointed).
    ``run_epoch`` (and ``checkpoint_every``) call :meth:`check` when
    ``state.micro_step >= next_check``: one integer comparison per micro-batch.
    A stop is agreed only at the end of an accumulation group: the run stops
    at an optimizer update.

    Args:
        processes: the number of processes of the run.
        interval_s: the target length of an agreement round, in seconds.
        control: the control channel the rounds use (several processes).
        enabled: False when the Context catches no signal: no round is ever run.
    """

    def __init__(self, processes: int, interval_s: float, control: Control, *, enabled: bool = True) -> None:
        self.requested = 0  # the signal this process received, 0 for none
        self.distributed = processes > 1 and enabled
        self.next_check = 0 if self.distributed else NEVER
        self._interval = interval_s
        self._control = control
        self._decided = (-1, 0)  # (micro_step, agreed signal) of the last check
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._launched = (0.0, 0)  # (monotonic time, micro_step) of the last launch
        self._period = 1
        self._speed = 0.0
        #: a stop was agreed since the request: it is being acted on (a final checkpoint, the end of the run)
        self.agreed = False
        #: where this process was at its last round, for a timeout to name a process that stopped coming
        self.last_seen = LastSeen()

    def request(self, signum: int) -> None:
        """Ask the run to stop (what the signal handler does)."""
        self.requested = int(signum)
        if not self.distributed:
            self.next_check = 0

    def check(self, micro_step: int, synced: bool, update: int = 0) -> int:
        """The signal every process agreed to stop at after this micro-batch, or 0 (the same on every process).

        Called when ``micro_step >= next_check``, with ``synced``: this
        micro-batch ended an accumulation group (Accelerate's ``sync_gradients``).
        A round falls due only at the end of a group, so a run stops at an
        optimizer update, never holding half a group's gradients; the rounds are
        the same micro-batches on every process. A second call at the same
        micro-batch returns the first's answer. Each round also says where this
        process is (``update``), for a timeout to name a process that stopped coming.
        """
        if not synced:
            return 0
        if self._decided[0] == micro_step:
            return self._decided[1]
        if self.distributed:
            phase = self.last_seen.phase
            before, phase.now = phase.now, "stop agreement"
            try:
                agreed = self._round(micro_step, update)
            finally:
                phase.now = before
        else:
            agreed = self.requested
        self._decided = (micro_step, agreed)
        self.agreed = self.agreed or bool(agreed)  # sync: none: a host int
        return agreed

    def agree_now(self) -> int:
        """The signal any process received, agreed now with one blocking all-reduce (the same on every process).

        For the end of a phase without step boundaries (an evaluation); every
        process must call it at the same point.
        """
        agreed = max_over_processes(self._control, self.requested) if self.distributed else self.requested
        self.agreed = self.agreed or bool(agreed)  # sync: none: a host int
        return agreed

    def clear(self) -> None:
        """Forget the request once the stop has been honoured (a host that runs many trials goes on)."""
        self.requested = 0
        self.agreed = False
        self._decided = (-1, 0)
        if not self.distributed:
            self.next_check = NEVER
            return
        # Every process clears at the same point (after the same agreed decision): a round still in
        # flight may carry the honoured signal, so it is drained and dropped, and the next
        # micro-batch starts the rounds afresh.
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        self._launched = (0.0, 0)
        self.next_check = 0

    def drain(self, deadline_s: float) -> None:
        """Wait (at most ``deadline_s``) for the agreement round still in flight, then forget it.

        Every process launched it, so it completes; waiting for it before the process
        group is destroyed means no collective is left running on a group being torn
        down. A peer that died never joins it: then the round is dropped at the deadline.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work = pending[0]
        until = time.monotonic() + deadline_s
        while not work.is_completed() and time.monotonic() < until:
            time.sleep(0.001)

    def seconds_per_batch(self) -> float:
        """The slowest process's seconds per micro-batch, as the last round measured it (0.0 before any)."""
        return self._speed

    def _round(self, micro_step: int, update: int) -> int:
        import torch.distributed as dist

        self.last_seen.seen(dist.get_rank(), micro_step, update)

        if self._pending is not None:
            work, result = self._pending
            work.wait()  # launched a round ago on every process: done, or nearly
            self._pending = None
            signum, speed = int(result[0]), float(result[1])  # sync: none, a CPU tensor
            if signum:
                self.next_check = micro_step  # a second caller at this micro-batch gets the same answer
                return signum
            self._speed = speed
            self._period = max(1, min(MAX_PERIOD, math.floor(self._interval / speed))) if speed > 0 else 1
        now = time.monotonic()
        then, at = self._launched
        speed = (now - then) / (micro_step - at) if at and micro_step > at else 0.0
        flags = torch.tensor([float(self.requested), speed], dtype=torch.float64)  # sync: none: host numbers
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control.group(), async_op=True)
        self._pending = (work, flags)
        self._launched = (now, micro_step)
        self.next_check = micro_step + self._period
        return 0


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


#: a repeat of a signal sooner than this after the one before is its echo, not a person asking again: torchrun
#: forwards the SIGTERM (or the terminal's SIGINT) it received to workers that already received their own
ECHO_S = 1.0
#: how long an expired request waits for the main thread to take the signal before the process exits without it
_LAST_RESORT_S = 10.0


class Handlers:
    """The signal handlers a Context installs for its whole life (main thread only), and puts back when it closes.

    The first of the Context's signals is a request to stop (:meth:`Interrupt.request`),
    honoured at the next step boundary, at the end of an evaluation, or between two
    epochs of a loop, wherever it arrived: in a step, an evaluation, a metric, your
    epoch functions, a tracker's flush, the wait for the last background save.
    A copy that follows it within :data:`ECHO_S` (SLURM signals every process of a job
    step, and torchrun forwards its own copy milliseconds later) stays a request. A
    request must not keep a process alive that nothing will stop, so the signal acts as
    it would without trainfold (the previous handler, or the default: SIGTERM ends the
    process, SIGINT raises ``KeyboardInterrupt``) when it comes again at least
    :data:`ECHO_S` later before a stop was agreed, or when no stop was agreed within
    ``deadline_s`` of it (no epoch running, a step hung in a tracker's log). Once a stop
    is agreed (a final checkpoint being written), a repeated signal changes nothing.

    Handlers of several live Contexts chain: a signal is a request to each of them.
    """

    def __init__(self, interrupt: Interrupt, signals: Sequence[int], deadline_s: float | None = None) -> None:
        self._interrupt = weakref.ref(interrupt)
        self._previous: dict[int, Any] = {}
        self._last = 0.0
        self._deadline_s = deadline_s
        self._watch: threading.Timer | None = None
        self._expired = False
        self._acted = threading.Event()  # the handler ran on an expired request (it passed the signal on)
        self.installed = False
        if not signals or threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only: a Context made elsewhere leaves them to the host
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)
        self.installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        interrupt = self._interrupt()
        if interrupt is None or not self.installed:  # the Context is gone or closed: what was there before decides
            self._pass_on(signum, frame)
            return
        if self._expired:  # the deadline passed with nothing acting on the request (see _expire)
            self._acted.set()
            self.uninstall()
            self._pass_on(signum, frame)
            return
        now, last = time.monotonic(), self._last
        self._last = now
        self._request_previous(signum)
        if not interrupt.requested:
            interrupt.request(signum)
            self._start_watch(interrupt, signum)
            log.warning(
                "%s received: stopping at the next step boundary (a final checkpoint is written where you "
                "save); %s again ends the process at once.",
                signal_name(signum),
                "Ctrl-C" if signum == signal.SIGINT else signal_name(signum),
            )
            return
        if not interrupt.agreed and now - last >= ECHO_S:  # asked again, not a launcher's echo, before any stop: now
            log.warning("%s received again before the run could stop: acting on it now.", signal_name(signum))
            self.uninstall()
            self._pass_on(signum, frame)
            return
        log.info("%s received again: the stop already requested goes on.", signal_name(signum))

    def _start_watch(self, interrupt: Interrupt, signum: int) -> None:
        """Act on the request as without trainfold if no stop is agreed within the deadline (a daemon timer)."""
        if self._deadline_s is None:
            return
        if self._watch is not None:
            self._watch.cancel()
        self._watch = threading.Timer(self._deadline_s, self._expire, (weakref.ref(interrupt), signum))
        self._watch.daemon = True
        self._watch.start()

    def _expire(self, interrupt_ref: Any, signum: int) -> None:
        interrupt = interrupt_ref()
        if interrupt is None or not self.installed or not interrupt.requested or interrupt.agreed:
            return  # honoured, cleared or closed meanwhile
        log.error(
            "%s was not acted on within %.0f s (no epoch, evaluation or loop reached a point to stop at; a step "
            "may be hung): acting on it as without trainfold. Context(stop_deadline_s=...) sets the wait.",
            signal_name(signum),
            self._deadline_s,
        )
        self._expired = True
        signal.pthread_kill(
            threading.main_thread().ident or 0, signum
        )  # the main thread runs the handler, which passes it on
        if not self._acted.wait(
            _LAST_RESORT_S
        ):  # its handler cannot run (the signal blocked, a C call that never returns)
            log.error(
                "%s: the main thread did not take the signal within %.0f s: the process exits now.",
                signal_name(signum),
                _LAST_RESORT_S,
            )
            logging.shutdown()
            os._exit(128 + signum)  # what a shell reports for a process that the signal ended

    def _request_previous(self, signum: int) -> None:
        """Every live Context in the process sees the request: a Context's handler made before this one is asked too."""
        previous = self._previous.get(signum)
        owner = getattr(previous, "__self__", None)
        if isinstance(owner, Handlers) and owner.installed:
            earlier = owner._interrupt()
            if earlier is not None and not earlier.requested:
                earlier.request(signum)
                owner._last = self._last
            owner._request_previous(signum)

    def _pass_on(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)  # the default disposition: ends the process

    def uninstall(self) -> None:
        """Put back the handlers found at install; a handler installed after this one keeps calling it (it passes on)."""
        if not self.installed:
            return
        self.installed = False
        if self._watch is not None and threading.current_thread() is not self._watch:
            self._watch.cancel()
        if threading.current_thread() is not threading.main_thread():
            return  # cannot be changed from here: the handler passes every signal on
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, previous)
