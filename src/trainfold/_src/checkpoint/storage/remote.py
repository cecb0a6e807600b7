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
parallel, each streamed into its place (``download.py``); the caller verifies
its size and digest as for a local file. Writes stream a file's buffers (a
tensor's own memory) into the store, hashed as they go. Every failure of the store (a refused request, a server that does not
answer within a request's bounded time, ``requests.py``) is an ``OSError`` naming
the object, so a save fails on every process together and commits nothing. One writer per root is
``lease.py``'s.
"""

from __future__ import annotations

import json
import logging
import mmap
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import attrs

from trainfold._src.checkpoint import digest as _digest
from trainfold._src.checkpoint.manifest import (
    DEBRIS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    NAME,
    removed_while_read,
    wrong_size,
)
from trainfold._src.checkpoint.storage import conditional
from trainfold._src.checkpoint.storage import lease as _lease
from trainfold._src.checkpoint.storage import upload
from trainfold._src.checkpoint.storage.download import read_range
from trainfold._src.checkpoint.storage.requests import call, guarded, protocol_of
from trainfold.errors import CheckpointError, DamagedCheckpoint

logger = logging.getLogger("trainfold")

#: a ranged read's size, and how many run at once
READ_PART = 64 << 20
READ_THREADS = 4


class _OtherSize(Exception):
    """A range read returned another number of bytes than the manifest's size implies."""


@attrs.define
class RemoteCheckpoint:
    """A checkpoint under an fsspec URL (or a URL that may be one): a handle that keeps its manifest once read.

    Mutable on purpose, and only in ``_read``: :meth:`_manifest` fills it with the one request a
    listing makes per checkpoint, and :meth:`forget` empties it when the manifest is removed or replaced.
    """

    fs: Any = attrs.field(repr=False)
    #: the store's path of the checkpoint (``bucket/run/ckpt-...``), and its URL
    where: str
    url: str
    #: its manifest once read (:meth:`_manifest`): a listing's one request per checkpoint serves the whole save or load
    _read: bytes | None = attrs.field(default=None, eq=False, repr=False)

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
        return self._manifest(MAX_MANIFEST_BYTES) is not None

    def manifest_bytes(self, limit: int) -> bytes:
        data = self._manifest(limit)
        if data is None:
            raise CheckpointError(
                f"{self.url} is not a trainfold checkpoint: it has no {MANIFEST} (an unfinished save leaves its objects "
                "without one). Pass a checkpoint or the root that holds them."
            )
        if len(data) > limit:
            raise CheckpointError(
                f"{self.url}/{MANIFEST} is damaged: more than {limit} bytes, more than a manifest can be; refused."
            )
        return data

    def _manifest(self, limit: int) -> bytes | None:
        """The manifest's first ``limit + 1`` bytes (None if there is none), read once per object with one request.

        A committed manifest never changes in place (a save of the same position removes it first, through
        :meth:`RemoteRoot.stage`, which forgets it), so what one listing read serves every later question about it.
        """
        if self._read is None:
            path, what = self._object(MANIFEST), f"reading {self.url}/{MANIFEST}"
            try:  # a ranged read: a hostile, huge object is not read past the limit
                data = call(self.fs, what, "cat_file", path, start=0, end=limit + 1)
            except FileNotFoundError:
                return None
            except OSError:  # a store that refuses the range (S3 does for an empty object): its size first
                size = int(call(self.fs, what, "info", path)["size"])
                data = call(self.fs, what, "cat_file", path, start=0, end=limit + 1) if size else b""
            self._read = bytes(data)
        return self._read

    def forget(self) -> None:
        """Drop the manifest read (it is being removed or replaced)."""
        self._read = None

    def size(self, name: str) -> int:
        try:
            info = call(self.fs, f"reading {self.url}/{name}", "info", self._object(name))
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{self.url}: file {name} is missing; the checkpoint is damaged.") from None
        if info.get("type") != "file":
            raise CheckpointError(f"{self.url}: file {name} is not an object (a prefix of others): refused.")
        return int(info["size"])

    def read(self, name: str, size: int, seen: Callable[[memoryview], object] | None = None) -> mmap.mmap | bytearray:
        """The object's ``size`` bytes, read once into one writable buffer by ranged reads in parallel; ``seen`` is
        given the whole buffer once it is read (the ranges arrive out of order).

        No request asks the size first: the last range asks one byte more, so an object of another size is
        found by the reads themselves (and only then is its size asked, for the message).
        """
        # an anonymous map, as a local file's read: page-aligned, so a tensor at an aligned offset of the file is
        # aligned in it and used in place (a bytearray's 16-byte alignment made every tensor a copy)
        path, buf = self._object(name), mmap.mmap(-1, size) if size else bytearray()
        view = memoryview(buf)

        def part(start: int) -> None:
            end = min(start + READ_PART, size)
            sent = read_range(self.fs, path, start, end + (end == size), view[start:end], f"reading {self.url}/{name}")
            if sent != end - start:
                raise _OtherSize

        try:
            if size == 0:
                raise _OtherSize  # an empty object has no range to ask for: its size is asked instead
            with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
                list(pool.map(part, range(0, size, READ_PART)))
        except (_OtherSize, OSError) as exc:  # missing, shorter (a range past its end) or longer: say which
            actual = self.size(name)
            if actual != size:
                raise wrong_size(self, name, actual, size) from None
            if isinstance(exc, OSError):
                raise
            if size:
                raise CheckpointError(f"{self.url}: file {name} changed size while it was read: altered.") from None
        if seen is not None:
            with memoryview(buf) as whole:
                seen(whole)
        return buf

    def chunks(self, name: str) -> Iterator[bytes]:
        size = self.size(name)
        for start in range(0, size, READ_PART):
            end = min(start + READ_PART, size)
            try:
                yield call(self.fs, f"reading {self.url}/{name}", "cat_file", self._object(name), start=start, end=end)
            except FileNotFoundError:
                raise removed_while_read(self.url, name) from None

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.where)  # adlfs lists from its cache, whatever refresh says
        found = call(self.fs, f"listing {self.url}", "ls", self.where, detail=False, refresh=True)
        return [posixpath.basename(p.rstrip("/")) for p in found]

    def local_folder(self) -> str | None:
        return None


@attrs.frozen
class RemoteStaging:
    """A checkpoint being written under its final prefix, without its manifest until :meth:`commit`."""

    checkpoint: RemoteCheckpoint
    #: the root's URL: its lease fences the commit
    root_url: str

    def __str__(self) -> str:
        return f"{self.checkpoint.url} (uncommitted)"

    def write(self, name: str, chunks: Iterable[Any]) -> dict[str, Any]:
        ckpt = self.checkpoint
        digest = _digest.new()

        def hashed() -> Iterator[Any]:
            for chunk in chunks:
                digest.update(chunk)
                yield chunk

        path, what = ckpt._object(name), f"writing {ckpt.url}/{name}"
        if protocol_of(ckpt.fs) in ("s3", "s3a"):
            size = upload.upload_s3(ckpt.fs, path, hashed(), what)
        else:
            size = guarded(what, lambda: upload.upload(ckpt.fs, path, hashed()))
        return _digest.entry(size, digest)

    def digest(self, name: str) -> dict[str, Any]:
        h, size = _digest.new(), 0
        for chunk in self.checkpoint.chunks(name):
            h.update(chunk)
            size += len(chunk)
        return _digest.entry(size, h)

    def commit(self, manifest: bytes) -> None:
        """Write the manifest under the root's lease: only while this job holds it (``lease.fenced_commit``), and only
        where no manifest is (a job that took the lock over may have finished this very commit already)."""
        ckpt = self.checkpoint
        _lease.fenced_commit(self.root_url, ckpt.name, manifest, lambda: _create_manifest(ckpt, manifest))

    def discard(self) -> None:
        _remove_quietly(self.checkpoint)


def _create_manifest(ckpt: RemoteCheckpoint, manifest: bytes) -> None:
    """Write the checkpoint's manifest only if it has none (``If-None-Match: *`` where the store offers it).

    One that is there already with these bytes is this commit, finished by a job that took the lock over; with
    other bytes it is another job's commit, which is left as it is.

    Raises:
        CheckpointError: another manifest is there.
    """
    path, what = ckpt._object(MANIFEST), f"committing {ckpt.url}"
    try:
        if protocol_of(ckpt.fs) in conditional.CONDITIONAL:
            conditional.create(ckpt.fs, path, manifest, what)
        else:  # no condition to issue there (the object storage guide says so)
            call(ckpt.fs, what, "pipe_file", path, manifest)
    except conditional.Lost:
        if bytes(call(ckpt.fs, what, "cat_file", path)) != manifest:
            raise CheckpointError(
                f"{ckpt.url} was committed by another job meanwhile (its manifest is not this save's): this save "
                "committed nothing and removed nothing."
            ) from None
    ckpt.forget()


def _remove_quietly(ckpt: RemoteCheckpoint) -> None:
    """Remove every object under the checkpoint's prefix: one listing, and one request to delete them."""
    try:
        found = call(ckpt.fs, f"removing {ckpt.url}", "find", ckpt.where)
        if found:
            call(ckpt.fs, f"removing {ckpt.url}", "rm", found)
    except OSError:  # a failed save's clean-up: what is left is removed at the next commit
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

    def exists(self) -> bool:
        return bool(call(self.fs, f"looking for {self.url}", "exists", self.where))  # sync: none: a store's answer

    def unusable(self) -> str | None:
        if self.url.startswith("memory://"):
            return None
        bucket = self.where.split("/", 1)[0]
        if call(self.fs, f"looking for the bucket of {self.url}", "exists", bucket):
            return None
        return (
            f"the bucket (or container) {bucket!r} does not exist on this store: check its name (a typo?), or create it"
        )

    def lock(self, run_id: str) -> _lease.Held:
        return _lease.acquire(self.fs, posixpath.join(self.where, _lease.LOCK_NAME), self.url, run_id, self._taken)

    def _taken(self, inherited: dict[str, Any] | None) -> None:
        """This job has just taken the root's lock: finish the commit a previous owner fenced in it, then remove what
        dead saves left (no other job writes here now; a stalled one commits nothing, its fence fails)."""
        if inherited is not None:
            self._finish(inherited)
        for name in self.unfinished():
            _remove_quietly(self.checkpoint(name))

    def _finish(self, inherited: dict[str, Any]) -> None:
        """Write the manifest of a commit its owner fenced and may not have written, if its files are all there."""
        name, manifest = inherited.get("name"), inherited.get("manifest")
        if not (
            isinstance(name, str)
            and NAME.fullmatch(name)
            and isinstance(manifest, str)
            and len(manifest) <= MAX_MANIFEST_BYTES
        ):
            logger.warning(
                "%s: the lock taken over records a commit that is not one trainfold makes; ignored.", self.url
            )
            return
        ckpt = self.checkpoint(name)
        try:
            files = json.loads(manifest).get("files", {})
            missing = sorted(set(files) - set(ckpt.names())) if isinstance(files, dict) else ["(no files)"]
        except (ValueError, AttributeError, RecursionError):
            missing = ["(a manifest that is not JSON)"]
        if missing:
            logger.warning(
                "%s: the previous owner's commit of %s lacks %s; it stays uncommitted (and is removed).",
                self.url,
                name,
                ", ".join(missing[:3]),
            )
            return
        try:
            _create_manifest(ckpt, manifest.encode())
            logger.warning(
                "%s: finished the commit of %s, which the previous owner of the lock had begun.", self.url, name
            )
        except CheckpointError:
            pass  # another manifest is there: that commit was made

    def _listing(self) -> list[str]:
        # adlfs lists from its cache, whatever refresh says: a stale listing hid a checkpoint saved again, whose old
        # manifest then stayed
        self.fs.invalidate_cache(self.where)
        try:
            found = call(self.fs, f"listing {self.url}", "ls", self.where, detail=False, refresh=True)
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
        if (
            fresh and name in self._listing()
        ):  # the same position saved again: it stops being a checkpoint first, then its objects go
            if ckpt.committed():
                call(ckpt.fs, f"replacing {ckpt.url}", "rm", ckpt._object(MANIFEST))
                ckpt.forget()
            _remove_quietly(ckpt)
        return RemoteStaging(ckpt, self.url)

    def remove(self, name: str) -> None:
        ckpt = self.checkpoint(name)
        call(ckpt.fs, f"removing {ckpt.url}", "rm", ckpt._object(MANIFEST))
        ckpt.forget()
        _remove_quietly(ckpt)

    def clean(self) -> None:
        """Nothing after a commit: on a store a job that stalled past its lease could otherwise remove the objects of the
        job that took its lock over; what dead saves left is removed when a job takes the lock (:meth:`_taken`)."""
