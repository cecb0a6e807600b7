"""One writer per checkpoint root: an exclusive lock held for the run's lifetime.

Owned here: :func:`acquire`, :func:`confirm` and :func:`release`. The lock is
a POSIX record lock (``lockf``) on ``<root>/.trainfold.lock``, which records the
owner (host, pid, run id). It belongs to the process: Contexts in one process
(trials run one after another, a resume in the same process) share it, while a
second process (the same job started twice, a requeued copy whose first copy
still runs) gets a ``CheckpointError`` that names the owner. The kernel drops
the lock when the owning process dies, however it dies, so a stale lock of a
dead run is simply taken over. POSIX locks work across machines only on
filesystems that support them (NFS with its lock manager does; some network
filesystems do not).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from ._files import CheckpointError

LOCK_NAME = ".trainfold.lock"


def acquire(root: Path, run_id: str) -> int:
    """Lock ``root`` for this process and return the lock's file descriptor.

    Raises:
        CheckpointError: another live process holds the lock (named in the message).
    """
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        confirm(fd, root)
    except CheckpointError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id}).encode(), 0)
    return fd


def confirm(fd: int, root: Path) -> None:
    """Take (or keep) the lock on ``fd``: a no-op for the process that holds it.

    Raises:
        CheckpointError: another process holds it.
    """
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise CheckpointError(
            f"{root} is being written by another process ({_owner(fd)}): two writers would overwrite each other's "
            "checkpoints. Stop the other run (a requeued copy of this job?) or give this one another folder."
        ) from None


def release(fd: int) -> None:
    """Give the lock up (closing the descriptor releases it)."""
    try:
        os.close(fd)
    except OSError:
        pass


def _owner(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {info.get('host')}, pid {info.get('pid')}, run {info.get('run_id')}"
    except (OSError, ValueError):
        return "owner unknown"
