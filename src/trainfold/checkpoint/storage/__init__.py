"""Checkpoint storages: where a checkpoint's bytes go, how a save is committed, and how one writer is made sure of.

A storage knows nothing of what the bytes are (that is a format's, and the
manifest's); a format knows nothing of where they go. The save and load protocol
(``checkpoint/save.py``, ``load.py``, ``root.py``) speaks to three small interfaces:

- :class:`Storage`, a root of checkpoints: its lock, the checkpoints it holds,
  a place to write a new one, removing one, cleaning what crashed saves left;
- :class:`Staging`, a checkpoint being written: each process writes its files
  (their manifest entries come back, hashed as written), then the main process
  commits it with the manifest, atomically;
- :class:`Stored`, a committed checkpoint: its manifest's bytes, each file's
  size and bytes (read once, verified by the caller as it reads), the names it holds.

The interfaces are in ``protocol.py``. Today's one storage is a local POSIX folder (``local.py``: fsync, rename, a
``lockf`` lock); :func:`open_root` and :func:`checkpoint_at` choose the storage
of a path.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainfold.checkpoint.storage.local import LocalCheckpoint, LocalRoot
from trainfold.checkpoint.storage.protocol import Lock, Staging, Storage, Stored

__all__ = ["Lock", "Staging", "Storage", "Stored", "checkpoint_at", "open_root"]


def open_root(root: str | os.PathLike[str]) -> Storage:
    """The storage of a root of checkpoints."""
    return LocalRoot(root)


def checkpoint_at(path: str | os.PathLike[str]) -> Stored:
    """``path`` as one checkpoint (whether it is one is for its manifest to say: :meth:`Stored.committed`, ``read_manifest``)."""
    return LocalCheckpoint(Path(path))
