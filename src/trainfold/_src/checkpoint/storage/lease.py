"""One writer per checkpoint root on an object store: a lock object created only if absent, held by a lease its owner renews.

The lock is ``<root>/.trainfold.lock``, a small JSON object naming its owner
(host, pid, run id), a token of this hold, and when the lease ends. It is
created with a conditional write that succeeds only if no such object exists
(``If-None-Match: *``): of two jobs that start on one root, one gets it and the
other a ``CheckpointError`` naming the owner. The owner renews the lease from a
thread every third of its length with a write conditional on the lock's ETag
(``If-Match``). A job that finds the lock watches it for one lease: renewed,
its owner is alive and the job is refused; not renewed, the owner is gone (a
killed job leaves its lock behind) and the job takes it over with a write
conditional on the ETag it watched, so of two takers one wins. An owner whose
renewal finds another ETag has lost the lock: its next save raises instead of
writing beside the job that took it over. No clocks are compared.

The lease also fences the commit (:meth:`LeaseLock.fenced_commit`): the owner
rewrites the lock, conditional on its ETag, with the commit in it (name and
manifest), and only then writes the manifest, so an owner that stalled past its
lease and was taken over commits nothing. A job that takes a lock over is handed
the commit recorded in it (``inherited``), which the root's storage finishes. A
lock removed under a live job that no other job took is created again.

Conditional writes are what S3 (and S3-protocol servers that honour them),
GCS and Azure Blob offer; trainfold issues them through s3fs for ``s3://``,
through adlfs (Azure's ``upload_blob`` with ``overwrite=False``, and an ``etag`` with
``MatchConditions.IfNotModified``) for ``az://`` and ``abfs://``, and emulates them
in-process for ``memory://``. On any other store (``gs://`` among them: gcsfs passes
no generation condition) it cannot make sure of one writer, and says so once (a
warning); see the object storage guide (docs/guides/object-storage.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
import weakref
from typing import Any, Callable

from trainfold._src.base.checks import user_stacklevel
from trainfold._src.checkpoint.storage import conditional
from trainfold._src.checkpoint.storage.requests import call, protocol_of
from trainfold.errors import CheckpointError

LOCK_NAME = ".trainfold.lock"
#: how long a lease lasts unless renewed, unless ``TRAINFOLD_LOCK_LEASE_S`` says otherwise (its owner renews it every third)
LEASE_S = 30.0
#: the longest lease a lock may declare and be waited for (a forged lock cannot make a job wait longer)
MAX_LEASE_S = 600.0
#: how often a job waiting on another's lease looks at the lock
POLL_S = 0.5
#: the most of a lock a job taking it over reads: the owner and a commit in flight (a manifest, escaped as a JSON string)
MAX_LOCK_BYTES = 4 << 20

logger = logging.getLogger("trainfold")

#: the lock this process holds per root URL: [LeaseLock, Contexts using it]
_HELD: dict[str, list[Any]] = {}


def lease_s() -> float:
    """The lease this process's locks take: ``TRAINFOLD_LOCK_LEASE_S`` seconds, or :data:`LEASE_S`.

    Raises:
        ValueError: the variable is not a positive number of seconds up to :data:`MAX_LEASE_S`.
    """
    text = os.environ.get("TRAINFOLD_LOCK_LEASE_S")
    if text is None:
        return LEASE_S
    try:
        value = float(text)  # sync: none: a lease file's text
    except ValueError:
        value = float("nan")  # sync: none: a host number
    if not 0 < value <= MAX_LEASE_S:
        raise ValueError(
            f"TRAINFOLD_LOCK_LEASE_S={text!r}: the lease of a checkpoint root's lock must be a number of seconds "
            f"above 0 and at most {MAX_LEASE_S:.0f}."
        )
    return value


class LeaseLock:
    """This process's hold on a root's lease lock (the storage's :class:`~trainfold._src.checkpoint.storage.Lock`)."""

    def __init__(self, fs: Any, path: str, url: str, run_id: str) -> None:
        self.fs, self.path, self.url, self.run_id = fs, path, url, run_id
        self.token = uuid.uuid4().hex
        self.etag = ""
        self.lost: str | None = None
        #: the commit this owner is making (:meth:`fenced_commit`), written into the lock while it is made
        self.committing: dict[str, str] | None = None
        #: the commit a stalled or dead owner had fenced but maybe not finished, found in the lock this job took over
        self.inherited: dict[str, Any] | None = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease_s = lease_s()
        self.writes = 0

    def body(self) -> bytes:
        """The lock's next bytes: never the same twice (``write`` counts them), since a watcher tells a renewal by
        the ETag changing, and ``expires`` alone repeats when this host's wall clock stands still."""
        self.writes += 1
        owner: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": self.run_id,
            "token": self.token,
            "write": self.writes,
            "expires": time.time() + self.lease_s,
            "lease_s": self.lease_s,
        }
        if self.committing is not None:
            owner["committing"] = self.committing
        return json.dumps(owner).encode()

    def take(self) -> None:
        """Create the lock, or take over one whose lease ran out.

        Raises:
            CheckpointError: a live owner holds it (named).
        """
        if protocol_of(self.fs) not in conditional.CONDITIONAL:
            warnings.warn(
                f"trainfold: {self.url} is on a store for which trainfold issues no conditional writes: two jobs "
                "started on this root are not kept apart (see trainfold's object storage guide).",
                stacklevel=user_stacklevel(),
            )
        try:
            conditional.create(self.fs, self.path, self.body())
            self.etag = conditional.tag(self.fs, self.path)
        except conditional.Lost:
            self._take_over()
        self._start_renewing()

    def _take_over(self) -> None:
        """Take over a lock whose owner is gone: one whose lease is not renewed for a whole lease.

        This job watches the lock for the owner's lease (``lease_s``, plus a margin): a renewal (another ETag)
        means the owner is alive, and this job is refused; none means it died (a
        killed job leaves its lock behind), and this job takes it, conditional on the
        ETag it watched. Watching for a renewal, not comparing clocks, is what makes
        this safe between machines whose clocks differ.
        """
        etag, owner = conditional.tag(self.fs, self.path), _read_owner(self.fs, self.path, MAX_LOCK_BYTES)
        declared = owner.get("lease_s")
        watch_s = LEASE_S
        if isinstance(declared, (int, float)) and declared > 0:
            watch_s = min(float(declared), MAX_LEASE_S)  # sync: none: JSON
        # every takeover watches one lease: a stale lock costs a restart that long, never a second writer
        logger.warning(
            "%s is locked by %s; waiting up to %.0f s for its lease to run out (a job that was "
            "killed leaves its lock behind).",
            self.url,
            _describe(owner),
            watch_s + 2 * POLL_S,
        )
        deadline = time.monotonic() + watch_s + 2 * POLL_S
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            if not conditional.exists(self.fs, self.path):  # released meanwhile: create it as a first owner does
                try:
                    conditional.create(self.fs, self.path, self.body())
                    self.etag = conditional.tag(self.fs, self.path)
                    return
                except conditional.Lost:
                    raise CheckpointError(self._refusal(_read_owner(self.fs, self.path))) from None
            if conditional.tag(self.fs, self.path) != etag:
                raise CheckpointError(self._refusal(_read_owner(self.fs, self.path)))
        try:
            self.etag = conditional.replace(self.fs, self.path, self.body(), etag)
        except conditional.Lost:
            raise CheckpointError(self._refusal(_read_owner(self.fs, self.path))) from None
        # the body read before watching is the one replaced (any write since would have changed the ETag)
        committing = owner.get("committing")
        self.inherited = committing if isinstance(committing, dict) else None
        logger.warning(
            "took over the lock of %s, whose owner did not renew it for its whole lease (%s).",
            self.url,
            _describe(owner),
        )

    def _refusal(self, owner: dict[str, Any]) -> str:
        return (
            f"{self.url} is being written by another job ({_describe(owner)}, which renews its lease): two writers would "
            "overwrite each other's checkpoints. Stop the other job (a requeued copy of this one?) or give this one another root."
        )

    def renew(self) -> None:
        """Extend the lease (a write conditional on the ETag this process wrote last)."""
        with self._guard:
            if self.lost is None:
                self._write_conditionally()

    def _write_conditionally(self) -> None:
        """Write the lock's body if this job still holds it (its ETag unchanged); else record that it was lost.

        A lock removed by hand (no job took it: nothing is there) is created again, as a local root's lock is;
        one created meanwhile by another job is lost to it. Called with ``_guard`` held.
        """
        try:
            self.etag = conditional.replace(self.fs, self.path, self.body(), self.etag)
            return
        except conditional.Gone:
            try:
                conditional.create(self.fs, self.path, self.body())
                self.etag = conditional.tag(self.fs, self.path)
                logger.warning(
                    "%s (the lock of the run's checkpoint root) was removed while this job held it, "
                    "and no other job had taken it; taking it again.",
                    self.path,
                )
                return
            except conditional.Lost:
                pass
        except conditional.Lost:
            pass
        self.lost = _describe(_read_owner(self.fs, self.path))
        self._stop.set()

    def fenced_commit(self, name: str, manifest: bytes, write: Any) -> None:
        """Commit checkpoint ``name`` only while holding the lease: the fence and the commit are one conditional write.

        The lock is rewritten, conditional on the ETag this job wrote last, with the commit in it (the checkpoint's
        name and its manifest); only if that write succeeds is ``write`` (the manifest, created only if absent)
        called. A job that stalled past its lease (a GC pause, SIGSTOP, a swapped-out node) finds another ETag and
        commits nothing; a job that takes the lock over from an owner stalled after its fence finds the commit in the
        lock and finishes it (``inherited``). The record stays in the lock until ``write`` returns.

        Raises:
            CheckpointError: this job no longer holds the lock (it was taken over); nothing was committed.
        """
        with self._guard:
            if self.lost is None:
                self.committing = {"name": name, "manifest": manifest.decode()}
                self._write_conditionally()
            if self.lost is not None:
                self.committing = None
                raise CheckpointError(self._lost_message(f"{name} was not committed: "))
        try:
            write()
        finally:
            self.committing = None  # the next renewal writes the lock without it

    def _start_renewing(self) -> None:
        ref = weakref.ref(self)

        def renewing(stop: threading.Event, every_s: float) -> None:
            while not stop.wait(every_s):
                live = ref()
                if live is None:
                    return
                try:
                    live.renew()
                except Exception as exc:  # the store unreachable for a moment: the next renewal tries again
                    logger.warning("renewing the lock of %s failed (%s); retrying.", live.url, exc)
                del live

        self._thread = threading.Thread(
            target=renewing, args=(self._stop, self.lease_s / 3), name="trainfold-lease", daemon=True
        )
        self._thread.start()

    def confirm(self) -> None:
        self.renew()
        if self.lost is not None:
            raise CheckpointError(self._lost_message())

    def _lost_message(self, what: str = "") -> str:
        return (
            f"{self.url}: {what}this job no longer holds the root's lock: its lease ran out (the store unreachable, or the "
            f"job stalled for over {self.lease_s:.0f} s) and another job took it over ({self.lost}). Nothing more is written "
            "there, and nothing of the other job's is removed; stop this job, or give it another root."
        )

    def release_now(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._guard:
            if self.lost is None:
                try:
                    if conditional.tag(self.fs, self.path) == self.etag:
                        call(self.fs, "removing the lock", "rm", self.path)
                except OSError:  # the store unreachable: the lease runs out on its own
                    pass
            self.lost = "released"


class Held:
    """One Context's use of this process's lease lock on a root."""

    def __init__(self, key: str) -> None:
        self.key = key

    def confirm(self) -> None:
        held = _HELD.get(self.key)
        if held is None:
            raise CheckpointError(f"{self.key}: this process no longer holds the root's lock (its Context was closed).")
        held[0].confirm()

    def release(self) -> None:
        held = _HELD.get(self.key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _HELD[self.key]
            held[0].release_now()


def acquire(fs: Any, path: str, url: str, run_id: str, on_take: Callable[[dict[str, Any] | None], None]) -> Held:
    """Lock the root at ``url`` for this process (or count one more user of the lock it holds).

    ``on_take`` runs once, when this process takes the lock (not when it counts one more user), with the commit
    a previous owner had fenced in the lock (None if none): the root's storage finishes it and removes what dead
    saves left.

    Raises:
        CheckpointError: another live job holds it.
        OSError: the store refused (no bucket, no permission, unreachable).
    """
    held = _HELD.get(url)
    if held is not None:
        held[0].confirm()
        held[1] += 1
        return Held(url)
    lock = LeaseLock(fs, path, url, run_id)
    lock.take()
    _HELD[url] = [lock, 1]
    try:
        on_take(lock.inherited)
    except BaseException:
        Held(url).release()
        raise
    return Held(url)


def fenced_commit(url: str, name: str, manifest: bytes, write: Callable[[], None]) -> None:
    """Commit checkpoint ``name`` of the root at ``url`` under this process's lease (:meth:`LeaseLock.fenced_commit`).

    Raises:
        CheckpointError: this process does not hold the root's lock, or lost it; nothing was committed.
    """
    held = _HELD.get(url)
    if held is None:
        raise CheckpointError(
            f"{url}: this process no longer holds the root's lock (its Context was closed): {name} was not committed."
        )
    held[0].fenced_commit(name, manifest, write)


def _read_owner(fs: Any, path: str, limit: int = 4096) -> dict[str, Any]:
    """The lock's body (its first ``limit`` bytes: a longer one, or one that is not a JSON object, says nothing)."""
    try:
        owner = json.loads(bytes(call(fs, "reading the lock", "cat_file", path, start=0, end=limit)))
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _describe(owner: dict[str, Any]) -> str:
    return f"host {owner.get('host')}, pid {owner.get('pid')}, run {owner.get('run_id')}" if owner else "owner unknown"
