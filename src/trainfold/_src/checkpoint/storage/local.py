"""A local POSIX folder as a checkpoint storage: fsynced writes, a commit by rename, a ``lockf`` lock.

A root holds one folder per checkpoint (``ckpt-<update>``). A save writes into
``.tmp-<name>`` (every file fsynced as it is written), writes the manifest last,
fsyncs the folder and renames it into place, then fsyncs the root: a crash at
any moment leaves either no checkpoint of that name or a complete one. A save of
a name that exists swaps through ``.old-<name>``; a removed checkpoint is first
renamed to ``.del-<name>``, so it never looks committed half-deleted. What
crashed saves leave (``.tmp-``, ``.old-``, ``.del-``) is cleaned under the lock.

Reads never follow a link: a file a manifest lists must be a regular file in
the folder, and is read once, as one private map of it.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import attrs

from trainfold._src.base.io import fsync_dir, read_into, write_durably
from trainfold._src.checkpoint import digest as _digest
from trainfold._src.checkpoint.manifest import DEBRIS, MANIFEST, NAME, removed_while_read, wrong_size
from trainfold._src.checkpoint.storage import lock as _lock
from trainfold.errors import CheckpointError, DamagedCheckpoint

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _read_all(path: Path, limit: int) -> bytes:
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as f:
            return f.read(limit + 1)
    except FileNotFoundError:
        raise removed_while_read(path.parent, path.name) from None


@attrs.frozen
class LocalCheckpoint:
    """A committed checkpoint folder (or a path that may be one)."""

    path: Path

    def committed(self) -> bool:
        manifest = self.path / MANIFEST
        return manifest.exists() or manifest.is_symlink()

    @property
    def name(self) -> str:
        return self.path.name

    def __str__(self) -> str:
        return str(self.path)

    def manifest_bytes(self, limit: int) -> bytes:
        folder = self.path
        if folder.is_symlink() or not folder.is_dir():
            raise CheckpointError(f"{folder} is not a checkpoint folder (a checkpoint is a directory, not a link).")
        path = folder / MANIFEST
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{folder} is not a trainfold checkpoint: it has no {MANIFEST} (an interrupted save leaves only "
                "a .tmp-* folder). Pass a checkpoint folder or the root that holds them."
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{folder}: {MANIFEST} is not a regular file (a link or a special file): refused, not followed."
            )
        if st.st_size > limit:
            raise CheckpointError(
                f"{path} is damaged: {st.st_size} bytes, more than a manifest can be; refused unread."
            )
        return _read_all(path, limit)

    def size(self, name: str) -> int:
        """``lstat`` of a file the manifest lists: it must be a regular file in the folder, not a link."""
        try:
            st = os.lstat(self.path / name)
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{self.path}: file {name} is missing; the checkpoint is damaged.") from None
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(
                f"{self.path}: file {name} is a symbolic link; a checkpoint holds regular files only: refused, not followed."
            )
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{self.path}: file {name} is not a regular file: refused.")
        return st.st_size

    def read(self, name: str, size: int, seen: Callable[[memoryview], object] | None = None) -> bytearray | mmap.mmap:
        """The file read once into memory of its own (``base/io.read_into``, which gives ``seen`` each part as it is
        read): what is verified is what is used; no link followed."""
        actual = self.size(name)
        if actual != size:
            raise wrong_size(self.path, name, actual, size)
        try:
            return read_into(self.path / name, size, seen)
        except ValueError:
            raise CheckpointError(f"{self.path}: file {name} changed size while it was read: altered.") from None
        except FileNotFoundError:
            raise removed_while_read(self.path, name) from None

    def chunks(self, name: str) -> Iterator[bytes]:
        try:
            fd = os.open(self.path / name, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            raise removed_while_read(self.path, name) from None
        with os.fdopen(fd, "rb") as f:
            yield from iter(lambda: f.read(1 << 22), b"")

    def names(self) -> list[str]:
        try:
            return [p.name for p in self.path.iterdir()]
        except FileNotFoundError:
            raise removed_while_read(self.path.parent, self.path.name) from None

    def local_folder(self) -> str | None:
        return str(self.path)


def _write(path: Path, chunks: Iterable[Any]) -> dict[str, Any]:
    """Write ``chunks`` to ``path``, fsynced, hashing them as they go; return the manifest entry."""
    digest = _digest.new()
    return _digest.entry(write_durably(path, chunks, digest.update), digest)


@attrs.frozen
class LocalStaging:
    """``<root>/.tmp-<name>``: a checkpoint folder being written, renamed into place by :meth:`commit`."""

    root: Path
    name: str

    @property
    def tmp(self) -> Path:
        return self.root / f".tmp-{self.name}"

    def __str__(self) -> str:
        return str(self.tmp)

    def write(self, name: str, chunks: Iterable[Any]) -> dict[str, Any]:
        if not self.tmp.is_dir():  # the main process made it before any process writes: this one sees another folder
            raise FileNotFoundError(
                errno.ENOENT,
                f"{self.tmp} is not there, though the main process made it: this process sees another folder under the "
                "same name, so the root is not shared by every process (a node's own disk or /dev/shm on several "
                "nodes?); give every process a root they all see",
            )
        return _write(self.tmp / name, chunks)

    def digest(self, name: str) -> dict[str, Any]:
        stored = LocalCheckpoint(self.tmp)
        size = stored.size(name)
        h = _digest.new()
        for chunk in stored.chunks(name):
            h.update(chunk)
        return _digest.entry(size, h)

    def commit(self, manifest: bytes) -> None:
        _write(self.tmp / MANIFEST, [manifest])
        fsync_dir(self.tmp)
        final = self.root / self.name
        if final.exists():  # the same position saved again: swap, then drop the old one
            old = final.with_name(f".old-{final.name}")
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(self.tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(self.tmp, final)
        fsync_dir(self.root)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@attrs.frozen
class LocalRoot:
    """A local folder of checkpoints."""

    folder: Path = attrs.field(converter=Path)

    @property
    def key(self) -> str:
        return os.path.realpath(self.folder)  # a link's target: one root, however it is spelled

    @property
    def shared(self) -> bool:
        return True  # on several machines, only if the folder is on a shared filesystem (the checkpoints guide says so)

    def exists(self) -> bool:
        return self.folder.is_dir()

    def unusable(self) -> str | None:
        place = self.folder
        while (
            not place.exists() and place != place.parent
        ):  # the folder is made at the first save: its nearest existing ancestor
            place = place.parent
        if not place.is_dir():
            return f"{place} is a file, not a folder"
        if not os.access(place, os.W_OK | os.X_OK):
            return f"this process may not write in {place}"
        return None

    def __str__(self) -> str:
        return str(self.folder)

    def lock(self, run_id: str) -> _lock.PosixLock:
        return _lock.acquire(self.folder, run_id)

    def checkpoints(self) -> list[LocalCheckpoint]:
        if not self.folder.is_dir():
            return []
        return [
            LocalCheckpoint(p)
            for p in self.folder.iterdir()
            if NAME.fullmatch(p.name) and not p.is_symlink() and p.is_dir() and (p / MANIFEST).exists()
        ]

    def unfinished(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(p.name for p in self.folder.iterdir() if DEBRIS.fullmatch(p.name))

    def checkpoint(self, name: str) -> LocalCheckpoint:
        return LocalCheckpoint(self.folder / name)

    def stage(self, name: str, *, fresh: bool) -> LocalStaging:
        staging = LocalStaging(self.folder, name)
        if fresh:
            if staging.tmp.exists():
                shutil.rmtree(staging.tmp)  # a save of this name that died half-way (ours: we hold the lock)
            staging.tmp.mkdir()
        return staging

    def remove(self, name: str) -> None:
        doomed = self.folder / f".del-{name}"
        os.replace(self.folder / name, doomed)  # never a half-deleted folder that still looks committed
        shutil.rmtree(doomed, ignore_errors=True)

    def clean(self) -> None:
        """Remove what crashed saves left (``.tmp-``, ``.del-``, ``.old-`` folders): ours, since we hold the lock."""
        for name in self.unfinished():
            p = self.folder / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
