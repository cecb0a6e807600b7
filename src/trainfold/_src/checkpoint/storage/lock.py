"""One writer per checkpoint root: an exclusive lock held for the run's lifetime.

Owned here: :func:`acquire`, which returns a :class:`PosixLock` (``confirm``,
``release``). The lock is
a POSIX record lock (``lockf``) on ``<root>/.trainfold.lock``, which records the
owner (host, pid, run id). It belongs to the process: Contexts in one process
(trials run one after another, a resume in the same process, the Context of
``with_accumulation``) share it, while a second process (the same job started
twice, a requeued copy whose first copy still runs) gets a ``CheckpointError``
that names the owner. The kernel drops the lock when the owning process dies,
however it dies, so a stale lock of a dead run is simply taken over.

The kernel also drops a POSIX lock when *any* descriptor of the file is closed
by the process, so the process holds one descriptor per root, whatever path
names it (the table is keyed by the folder's device and inode), counted by the
Contexts that use it (:data:`_HELD`, the one process-wide table here: it mirrors
the kernel's per-process lock), and closes it when the last of them releases it.
A lock file removed under a live run (a clean-up script deleted the root) is
taken again at the next save, or refused if another process took it meanwhile.
POSIX locks work across machines only on filesystems that support them (NFS with
its lock manager does; some network filesystems do not).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
from pathlib import Path

import attrs

from trainfold.errors import CheckpointError

LOCK_NAME = ".trainfold.lock"

logger = logging.getLogger("trainfold")

#: the lock this process holds per root (the folder's identity, :func:`_identity`): [descriptor, Contexts using it, run id]
_HELD: dict[str, list[object]] = {}


@attrs.frozen
class PosixLock:
    """This process's hold on a root's lock, for one Context (the storage's :class:`~trainfold._src.checkpoint.storage.Lock`)."""

    key: str
    root: Path

    def confirm(self) -> None:
        confirm(self.key, self.root)

    def release(self) -> None:
        release(self.key)


def acquire(root: Path, run_id: str) -> PosixLock:
    """Lock ``root`` for this process (or count one more user of the lock it holds).

    Raises:
        CheckpointError: another live process holds the lock (named in the message), or the
            lock's path is not a regular file.
    """
    root.mkdir(parents=True, exist_ok=True)
    key = _identity(root)
    held = _HELD.get(key)
    if held is not None:
        confirm(key, root)
        held = _HELD[key]
        held[1] = int(held[1]) + 1  # type: ignore[call-overload]
        return PosixLock(key, root)
    _HELD[key] = [_take(root, run_id), 1, run_id]
    return PosixLock(key, root)


def _identity(root: Path) -> str:
    """The folder itself, not the spelling of its path: its device and inode (a symbolic link, ``..``, a bind mount or
    another spelling of one folder is one root, whose lock this process holds once)."""
    st = os.stat(root)
    return f"{st.st_dev}:{st.st_ino}"


def _take(root: Path, run_id: str) -> int:
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK) or path.is_dir() or path.is_symlink():
            raise CheckpointError(
                f"{path} is not a regular file ({_kind(path)}): trainfold keeps the lock of the folder's one writer there "
                "and never follows a link or writes into a folder for it. Remove it (no run uses it) and save again."
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path} is not a regular file ({_kind(path)}): remove it and save again.")
        _lock(fd, root)
    except CheckpointError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id}).encode(), 0)
    return fd


def confirm(key: str, root: Path) -> None:
    """Check that this process still holds ``root``'s lock; take it again if its file was removed.

    Raises:
        CheckpointError: another process holds it now.
    """
    held = _HELD.get(key)
    if held is None:
        raise CheckpointError(f"{root}: this process no longer holds the folder's lock (its Context was closed).")
    fd = int(held[0])  # type: ignore[call-overload]
    if _same_file(fd, root / LOCK_NAME):
        _lock(fd, root)  # one syscall: still ours
        return
    logger.warning(
        "%s (the lock of the run's checkpoint folder) was removed while this run held it; taking it again.",
        root / LOCK_NAME,
    )
    os.close(fd)
    try:
        held[0] = _take(root, str(held[2]))
    except BaseException:
        _forget(held)
        raise
    _HELD[_identity(root)] = held  # the folder made again is another inode: the same hold, under its new identity too


def release(key: str) -> None:
    """One Context less uses the lock: the last one closes the descriptor, which gives the lock up."""
    held = _HELD.get(key)
    if held is None:
        return
    held[1] = int(held[1]) - 1  # type: ignore[call-overload]
    if int(held[1]) > 0:  # type: ignore[call-overload]
        return
    _forget(held)
    try:
        os.close(int(held[0]))  # type: ignore[call-overload]
    except OSError:
        pass


def _forget(held: list[object]) -> None:
    """Drop a hold from the table, under every identity it was recorded by."""
    for key in [k for k, v in _HELD.items() if v is held]:
        del _HELD[key]


def _lock(fd: int, root: Path) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise CheckpointError(
            f"{root} is being written by another process ({_owner(fd)}): two writers would overwrite each other's "
            "checkpoints. Stop the other run (a requeued copy of this job?) or give this one another folder."
        ) from None


def _same_file(fd: int, path: Path) -> bool:
    try:
        now, ours = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "a symbolic link"
    if path.is_dir():
        return "a directory"
    return "not a regular file"


def _owner(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {info.get('host')}, pid {info.get('pid')}, run {info.get('run_id')}"
    except (OSError, ValueError):
        return "owner unknown"
