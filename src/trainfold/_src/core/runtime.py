"""Runtime: what a Context's runs hold and change, in one openly mutable object.

A :class:`~trainfold.Context` is a frozen value: the Accelerator and the
settings a run was made with. What changes while runs go on — the locks on
checkpoint roots, the thread that writes background saves, the channel the
processes agree on, the signal handlers, which checkpoint each root holds,
the warnings already given, the states given back, the digests of frozen tensors — lives here, reached as
``ctx.runtime``, and is changed only through the methods below, each named by
what it does.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Sequence

from trainfold._src.backend.trackers import flush_trackers
from trainfold._src.core.clock import Clock
from trainfold._src.distributed.control import Control
from trainfold._src.distributed.interrupt import Handlers, Interrupt
from trainfold._src.distributed.launcher import LauncherWatch, started_by_launcher
from trainfold._src.distributed.saver import Saver


class Runtime:
    """What a Context's runs hold and change: services, and what happened so far.

    One per Context, made with it (``ctx.runtime``); a Context made by
    :meth:`~trainfold.Context.with_accumulation` gets its own. Nothing of it is
    checkpointed: a resumed run starts with a fresh one.

    Services, each with its own lifetime and documentation:
        control: the CPU channel the processes agree on (stop requests, batch counts, a save's outcome).
        interrupt: the stop request a signal sets, agreed at step boundaries.
        saver: the thread that writes ``async_save`` checkpoints (one in flight at most).
        handlers: the signal handlers installed from the Context's creation to :meth:`close`.
        launcher: the watch that ends this process when the launcher that started it is gone (``LauncherWatch``;
            None where no torchrun started it, or ``Context(exit_with_launcher=False)``), from the Context's creation to
            :meth:`close`.
        clock: the host time of a run's parts (the loader, the update, a save, a stop's agreement), kept while
            ``log_every(..., watch=True)`` watches.
        phase: what this process is doing, in a word, set where it changes (:meth:`in_phase`), for a timeout to say
            where a process that did not arrive was.

    What happened, changed only by the named methods:
        the checkpoint roots locked (:meth:`keep_lock`, by ``save_checkpoint``'s first save to a root;
        :meth:`close` releases them); the position of the checkpoint this process last saved to or loaded
        from each root (:meth:`note_held`, by ``save_checkpoint`` and ``load_checkpoint``; read by
        ``checkpoint_every(...).at_end`` so that the end of a run is not saved twice); the warnings given once (:meth:`warn_once`, by ``run_epoch`` and the
        trackers); the models of states given back (:meth:`release`, by ``Context.release``); the digest
        of each frozen parameter, with the bytes of this process's shard it was taken of (:meth:`remember_digest`,
        by adapter checkpoints: a sharded base is gathered again only after a shard changed); what a
        ``checkpoint_every`` step last returned per root (:meth:`note_stepped`); the update of the last checkpoint taken,
        around which the trackers write (:meth:`checkpointing`, :meth:`wrote_at`); and
        whether the Context was closed (:meth:`close`, by ``Context.close``).

    Args:
        processes: the number of processes of the run.
        stop_check_s: the length of a stop-agreement round, in seconds.
        signals: the signals that request a stop (none: no handler is installed).
        stop_deadline_s: how long a request may wait to be acted on before the signal acts as without trainfold.
        exit_with_launcher: watch the launcher (where torchrun started this process).

    Examples:
        >>> from accelerate import Accelerator
        >>> from trainfold import Context
        >>> runtime = Context(accelerator=Accelerator(cpu=True), signals=()).runtime
        >>> runtime.warn_once("a key"), runtime.warn_once("a key"), runtime.closed
        (True, False, False)
    """

    def __init__(
        self,
        processes: int,
        stop_check_s: float,
        signals: Sequence[int],
        stop_deadline_s: float | None = None,
        *,
        exit_with_launcher: bool = False,
    ) -> None:
        self.control = Control()
        self.launcher = LauncherWatch() if exit_with_launcher and started_by_launcher() else None
        self.interrupt = Interrupt(processes, stop_check_s, self.control, enabled=bool(signals))  # sync: none: a flag
        self.saver = Saver()
        self.handlers = Handlers(self.interrupt, signals, stop_deadline_s)
        self.clock = Clock()
        #: what this process is doing, in a word (``last_seen.Phase``): set where it changes, sent with its last-seen line
        self.phase = self.interrupt.last_seen.phase
        self._locks: dict[str, Any] = {}
        self._held: dict[str, Any] = {}
        self._warned: set[str] = set()
        self._released: weakref.WeakSet[Any] = weakref.WeakSet()
        self._digests: dict[str, tuple[weakref.ref[Any], Any, str]] = {}
        self._tracker_holds: dict[str, dict[str, int]] = {}
        #: the update of the last checkpoint this process saved: what is logged at it after the save, a tracker that
        #: writes behind writes at once (a resumed run does not log it again)
        self.checkpointed_step: int | None = None
        #: the update of the checkpoint this Context last loaded (None: none, or one at update 0), and whether trainfold's
        #: init_trackers started the trackers: a resumed run's trackers started otherwise hold updates twice
        self.resumed_from: int | None = None
        self.trackers_by_trainfold = False
        self._stepped: dict[str, Any] = {}
        self._ended_unstepped: set[str] = set()
        self._at_close: list[Callable[[], None]] = []
        self._closed = False

    @contextlib.contextmanager
    def in_phase(self, name: str) -> Iterator[None]:
        """Say this process is in ``name`` (``"checkpoint"``, ``"evaluation"``...) until the block ends, then in what it
        was in before."""
        before, self.phase.now = self.phase.now, name
        try:
            yield
        finally:
            self.phase.now = before

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: the Context's process group and trackers are gone."""
        return self._closed

    def holds_lock(self, root: str) -> bool:
        """Whether this process took part in locking the checkpoint root ``root`` (a storage key)."""
        return root in self._locks

    def lock_for(self, root: str) -> Any:
        """The lock held on the root ``root``: the storage's lock on the main process, None on the others or when none is held."""
        return self._locks.get(root)

    def keep_lock(self, root: str, lock: Any) -> None:
        """Hold ``lock`` (None on a process other than the main one) on ``root`` until :meth:`close`."""
        self._locks[root] = lock

    def note_held(self, root: str, position: Any) -> None:
        """Record that ``root`` holds a checkpoint of ``position``: this process saved it there, or loaded it from there."""
        self._held[root] = position

    def held_position(self, root: str) -> Any:
        """The position noted for ``root`` by :meth:`note_held`, or None."""
        return self._held.get(root)

    def warn_once(self, key: str) -> bool:
        """True the first time ``key`` is asked for, False after: a warning said once per Context (or per run, in the key)."""
        if key in self._warned:
            return False
        self._warned.add(key)
        return True

    @property
    def tracker_holds(self) -> dict[str, dict[str, int]]:
        """Per tracker, per key, the last step an append-only tracker already held when a resumed run started it (see
        ``init_trackers``): what is sent again up to that step is not logged twice. Empty once the run has passed them."""
        return self._tracker_holds

    def hold_tracker_steps(self, tracker: str, holds: dict[str, int]) -> None:
        """Note what ``tracker`` holds (``{key: last step}``); an empty ``holds`` forgets it."""
        if holds:
            self._tracker_holds[tracker] = dict(holds)
        else:
            self._tracker_holds.pop(tracker, None)

    def release(self, model: Any) -> None:
        """Mark a state's model as given back: the loops refuse it from now on (held weakly)."""
        self._released.add(model)

    def is_released(self, model: Any) -> bool:
        """Whether ``model`` was given back with :meth:`release`."""
        return model in self._released

    def remember_digest(self, name: str, tensor: Any, stamp: Any, digest: str) -> None:
        """Note ``digest`` as the digest of ``tensor`` (held weakly) as ``stamp`` describes it (the digest of this
        process's bytes of it, its dtype...: what changes when its values do), under ``name``."""
        self._digests[name] = (weakref.ref(tensor), stamp, digest)

    def remembered_digest(self, name: str, tensor: Any, stamp: Any) -> str | None:
        """The digest noted under ``name`` if it was taken of this very ``tensor`` with this ``stamp``, else None."""
        noted = self._digests.get(name)
        if noted is None or noted[0]() is not tensor or noted[1] != stamp:
            return None
        return noted[2]

    def checkpointing(self, accelerator: Any, step: int) -> None:
        """A checkpoint of update ``step`` is about to be taken: the trackers that write behind write what they were given
        (a kill after the checkpoint loses none of it), and what they are given at ``step`` after it is written at once
        (:meth:`wrote_at`): a resumed run does not log it again."""
        flush_trackers(accelerator)
        self.checkpointed_step = step

    def wrote_at(self, accelerator: Any, step: int) -> None:
        """Values were logged at update ``step``: if that is the last checkpoint's, the trackers write them at once."""
        if step == self.checkpointed_step:
            flush_trackers(accelerator)

    def note_stepped(self, root: str, state: Any) -> None:
        """Record ``state`` as the newest a ``checkpoint_every`` step of ``root`` returned (read at close)."""
        self._stepped[root] = state

    def last_stepped(self, root: str) -> Any:
        """The newest state a ``checkpoint_every`` step of ``root`` returned, or None before its first step."""
        return self._stepped.get(root)

    def note_end_before_steps(self, root: str) -> None:
        """Record that ``checkpoint_every(...).at_end`` of ``root`` ran before any of its steps."""
        self._ended_unstepped.add(root)

    def ended_before_steps(self, root: str) -> bool:
        """Whether :meth:`note_end_before_steps` was called for ``root``."""
        return root in self._ended_unstepped

    def at_close(self, check: Callable[[], None]) -> None:
        """Run ``check`` when the Context closes, before anything is released (what a run left undone is said then)."""
        self._at_close.append(check)

    def close(self) -> None:
        """Run the checks given to :meth:`at_close`; forget the saver's and control channel's groups, release the roots'
        locks, put the signal handlers back.

        The caller has waited for the save in flight (``Context.close`` does).
        """
        checks, self._at_close = self._at_close, []
        for check in checks:
            check()
        self.saver.forget()
        for lock in self._locks.values():
            if lock is not None:
                lock.release()
        self._locks.clear()
        self.control.forget()
        self.handlers.uninstall()
        self.interrupt.last_seen.stop()
        if self.launcher is not None:
            self.launcher.stop()
        self._closed = True
