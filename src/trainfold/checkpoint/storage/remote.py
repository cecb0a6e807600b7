"""An fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://``...) as a checkpoint storage: no rename, the manifest is the commit.

Object stores have no rename and no fsync; what they have is a write of one
object that is atomic (it appears whole or not at all). So a checkpoint is
committed by its manifest: every process writes its objects under
``<root>/<name>/``, the processes agree that all of them are complete, and only
then does the main process write ``<root>/<name>/MANIFEST.json``. A checkpoint
without a manifest is never listed or loaded, whatever objects it holds; its
objects are removed at the next commit (under the lock). A checkpoint is removed
manifest first, so it stops being one before any of its objects goes. A save of
a name that exists (the same position saved again) removes the old manifest
before it writes anything: until the new one is committed, the older
checkpoints are the newest.

Reads take each object once, into one buffer filled by ranged reads in
parallel; the caller verifies its size and digest as for a local file. Writes
stream a file's buffers (a tensor's own memory) into the store, hashed as they
go. Every failure of the store (a refused request, a server that does not
answer within the bounded retries) is an ``OSError`` naming the object, so a save
fails on every process together and commits nothing. One writer per root is
``lease.py``'s.
"""

from __future__ import annotations

import errno
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, TypeVar

import attrs

from trainfold.checkpoint import digest as _digest
from trainfold.checkpoint.manifest import DEBRIS, MANIFEST, NAME
from trainfold.checkpoint.storage import lease as _lease
from trainfold.errors import CheckpointError

#: a ranged read's size, and how many run at once
READ_PART = 16 << 20
READ_THREADS = 8
#: what a write hands the store at once (a multipart upload's part)
WRITE_PART = 16 << 20

_T = TypeVar("_T")


def store_call(what: str, fn: Callable[[], _T]) -> _T:
    """``fn()``, its failure an ``OSError`` that says what was being done (a ``CheckpointError`` passes as it is)."""
    try:
        return fn()
    except (CheckpointError, OSError):
        raise
    except Exception as exc:  # botocore's and the other stores' own errors: a failed request to the store
        raise OSError(errno.EIO, f"{what}: {type(exc).__name__}: {exc}") from exc


@attrs.frozen
class RemoteCheckpoint:
    """A checkpoint under an fsspec URL (or a URL that may be one)."""

    fs: Any = attrs.field(repr=False)
    #: the store's path of the checkpoint (``bucket/run/ckpt-...``), and its URL
    where: str
    url: str

    @property
    def name(self) -> str:
        return posixpath.basename(self.where)

    @property
    def path(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url

    def _object(self, name: str) -> str:
        return posixpath.join(self.where, name)

    def committed(self) -> bool:
        return bool(store_call(f"looking for {self.url}/{MANIFEST}", lambda: self.fs.exists(self._object(MANIFEST))))

    def manifest_bytes(self, limit: int) -> bytes:
        path = self._object(MANIFEST)
        try:
            size = store_call(f"reading {self.url}/{MANIFEST}", lambda: self.fs.info(path)["size"])
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.url} is not a trainfold checkpoint: it has no {MANIFEST} (an unfinished save leaves its objects "
                "without one). Pass a checkpoint or the root that holds them."
            ) from None
        if size > limit:
            raise CheckpointError(f"{self.url}/{MANIFEST} is damaged: {size} bytes, more than a manifest can be; refused unread.")
        return bytes(store_call(f"reading {self.url}/{MANIFEST}", lambda: self.fs.cat_file(path)))

    def size(self, name: str) -> int:
        try:
            info = store_call(f"reading {self.url}/{name}", lambda: self.fs.info(self._object(name)))
        except FileNotFoundError:
            raise CheckpointError(f"{self.url}: file {name} is missing; the checkpoint is damaged.") from None
        if info.get("type") != "file":
            raise CheckpointError(f"{self.url}: file {name} is not an object (a prefix of others): refused.")
        return int(info["size"])

    def read(self, name: str, size: int) -> bytearray:
        """The object's ``size`` bytes, read once into one writable buffer by ranged reads in parallel."""
        path, buf = self._object(name), bytearray(size)

        def part(start: int) -> None:
            end = min(start + READ_PART, size)
            data = store_call(f"reading {self.url}/{name}", lambda: self.fs.cat_file(path, start=start, end=end))
            if len(data) != end - start:
                raise CheckpointError(f"{self.url}: file {name} changed size while it was read: altered.")
            buf[start:end] = data

        with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            list(pool.map(part, range(0, size, READ_PART)))
        return buf

    def chunks(self, name: str) -> Iterator[bytes]:
        size = self.size(name)
        for start in range(0, size, READ_PART):
            end = min(start + READ_PART, size)
            yield store_call(f"reading {self.url}/{name}", lambda: self.fs.cat_file(self._object(name), start=start, end=end))

    def names(self) -> list[str]:
        found = store_call(f"listing {self.url}", lambda: self.fs.ls(self.where, detail=False, refresh=True))
        return [posixpath.basename(p.rstrip("/")) for p in found]

    def local_folder(self) -> str | None:
        return None


@attrs.frozen
class RemoteStaging:
    """A checkpoint being written under its final prefix, without its manifest until :meth:`commit`."""

    checkpoint: RemoteCheckpoint

    def __str__(self) -> str:
        return f"{self.checkpoint.url} (uncommitted)"

    def write(self, name: str, chunks: Iterable[Any]) -> dict[str, Any]:
        ckpt = self.checkpoint
        digest, size = _digest.new(), 0

        def upload() -> None:
            nonlocal size
            with ckpt.fs.open(ckpt._object(name), "wb", block_size=WRITE_PART) as f:
                for chunk in chunks:
                    f.write(chunk)
                    digest.update(chunk)
                    size += memoryview(chunk).nbytes

        store_call(f"writing {ckpt.url}/{name}", upload)
        return _digest.entry(size, digest)

    def digest(self, name: str) -> dict[str, Any]:
        h, size = _digest.new(), 0
        for chunk in self.checkpoint.chunks(name):
            h.update(chunk)
            size += len(chunk)
        return _digest.entry(size, h)

    def commit(self, manifest: bytes) -> None:
        ckpt = self.checkpoint
        store_call(f"committing {ckpt.url}", lambda: ckpt.fs.pipe_file(ckpt._object(MANIFEST), manifest))

    def discard(self) -> None:
        _remove_quietly(self.checkpoint)


def _remove_quietly(ckpt: RemoteCheckpoint) -> None:
    try:
        if ckpt.fs.exists(ckpt.where):
            ckpt.fs.rm(ckpt.where, recursive=True)
    except Exception:  # a failed save's clean-up: what is left is removed at the next commit
        pass


@attrs.frozen
class RemoteRoot:
    """A root of checkpoints under an fsspec URL."""

    fs: Any = attrs.field(repr=False)
    where: str
    url: str

    @property
    def key(self) -> str:
        return self.url

    @property
    def shared(self) -> bool:
        return not self.url.startswith("memory://")

    def __str__(self) -> str:
        return self.url

    def lock(self, run_id: str) -> _lease.Held:
        return _lease.acquire(self.fs, posixpath.join(self.where, _lease.LOCK_NAME), self.url, run_id)

    def _listing(self) -> list[str]:
        try:
            found = store_call(f"listing {self.url}", lambda: self.fs.ls(self.where, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return [posixpath.basename(p.rstrip("/")) for p in found]

    def checkpoints(self) -> list[RemoteCheckpoint]:
        return [c for c in (self.checkpoint(n) for n in self._listing() if NAME.fullmatch(n)) if c.committed()]

    def unfinished(self) -> list[str]:
        names = [n for n in self._listing() if NAME.fullmatch(n) or DEBRIS.fullmatch(n)]
        return sorted(n for n in names if not self.checkpoint(n).committed())

    def checkpoint(self, name: str) -> RemoteCheckpoint:
        return RemoteCheckpoint(self.fs, posixpath.join(self.where, name), f"{self.url}/{name}")

    def stage(self, name: str, *, fresh: bool) -> RemoteStaging:
        ckpt = self.checkpoint(name)
        if fresh:  # the same position saved again: it stops being a checkpoint first, then its objects go
            manifest = ckpt._object(MANIFEST)
            if ckpt.committed():
                store_call(f"replacing {ckpt.url}", lambda: ckpt.fs.rm(manifest))
            _remove_quietly(ckpt)
        return RemoteStaging(ckpt)

    def remove(self, name: str) -> None:
        ckpt = self.checkpoint(name)
        store_call(f"removing {ckpt.url}", lambda: ckpt.fs.rm(ckpt._object(MANIFEST)))
        _remove_quietly(ckpt)

    def clean(self) -> None:
        for name in self.unfinished():
            _remove_quietly(self.checkpoint(name))
