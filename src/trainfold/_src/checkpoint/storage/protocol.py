"""The interfaces a checkpoint storage implements (see :mod:`trainfold._src.checkpoint.storage`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, Union

#: a buffer a file is written from or read into (bytes, a memoryview of a tensor's memory, a mapped file)
Buffer = Union[bytes, bytearray, memoryview, Any]


class Lock(Protocol):
    """One writer per root, held for the run's lifetime by the main process."""

    def confirm(self) -> None:
        """Check (cheaply) that this process still holds the lock; take it again if it was removed.

        Raises:
            CheckpointError: another process holds it now.
        """

    def release(self) -> None:
        """One user less (a Context closed); the last gives the lock up."""


class Staging(Protocol):
    """A checkpoint being written: invisible until :meth:`commit`."""

    def write(self, name: str, chunks: Iterable[Buffer]) -> dict[str, Any]:
        """Write the file ``name`` from ``chunks``, durably; return its manifest entry (size, digest), hashed as written.

        Raises:
            OSError: the write failed (a full disk: ENOSPC).
        """

    def digest(self, name: str) -> dict[str, Any]:
        """The manifest entry of a file another process wrote (read back and hashed)."""

    def commit(self, manifest: bytes) -> None:
        """Write the manifest last and make the checkpoint visible at once (replacing one of the same name)."""

    def discard(self) -> None:
        """Remove what was written (a failed save); never raises."""


class Stored(Protocol):
    """A checkpoint that a storage holds; ``str()`` of it names it in messages."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Any:
        """What the public API returns for it (``list_checkpoints``, ``latest_checkpoint``): a ``Path`` for a local folder."""

    def committed(self) -> bool:
        """Whether a manifest (or something in its place) is there: a checkpoint, not a root of them."""

    def manifest_bytes(self, limit: int) -> bytes:
        """The manifest's bytes, at most ``limit`` of them.

        Raises:
            CheckpointError: not a checkpoint, no manifest, or one that is not a plain file or is larger than ``limit``.
        """

    def size(self, name: str) -> int:
        """The size of the file ``name``.

        Raises:
            CheckpointError: missing, or not a plain file (a link is refused, never followed).
        """

    def read(self, name: str, size: int, seen: Callable[[memoryview], object] | None = None) -> Buffer:
        """The file's ``size`` bytes as one buffer (tensors are viewed in it, not copied): the size its manifest records.
        ``seen`` (a hasher's update) is given the buffer's bytes, in order, as they arrive in it.

        Raises:
            CheckpointError: missing, not a plain file, of another size (``manifest.wrong_size``), or it changed
                size while it was read.
        """

    def chunks(self, name: str) -> Iterator[bytes]:
        """The file's bytes in pieces (to hash a file without keeping it)."""

    def names(self) -> list[str]:
        """Every file the checkpoint holds, listed or not by its manifest."""

    def local_folder(self) -> str | None:
        """A local folder holding the files (DeepSpeed's loader is pointed at one), or None."""


class Storage(Protocol):
    """A root of checkpoints; ``str()`` of it names it in messages, :attr:`key` tells two roots apart."""

    @property
    def key(self) -> str: ...

    @property
    def shared(self) -> bool:
        """Whether every process of a job sees the same checkpoints there (``memory://`` is one process's)."""

    def exists(self) -> bool:
        """Whether the root is there at all (a folder; on a store, any object under its URL)."""

    def unusable(self) -> str | None:
        """Why no checkpoint could be written here, as far as one request tells (a bucket that does not exist, a
        folder under a file or without write permission); None when nothing is against it."""

    def lock(self, run_id: str) -> Lock:
        """Lock the root for this process's run.

        Raises:
            CheckpointError: another live writer holds it (named), or the lock's place is not usable.
        """

    def checkpoints(self) -> Sequence[Stored]:
        """The checkpoints the root holds under a name trainfold gives, committed or damaged (in no order)."""

    def unfinished(self) -> list[str]:
        """The names of what crashed or unfinished saves left."""

    def checkpoint(self, name: str) -> Stored: ...

    def stage(self, name: str, *, fresh: bool) -> Staging:
        """The place a new checkpoint ``name`` is written; ``fresh`` (the main process, once) empties what a save of it left."""

    def remove(self, name: str) -> None:
        """Remove the committed checkpoint ``name``; it stops looking committed before any of its files goes."""

    def clean(self) -> None:
        """Remove what crashed saves left (called under the lock, after a commit)."""
