"""The conditional writes of each store: create an object only if absent, replace it only while it has an ETag.

What one writer per root rests on (``lease.py``'s lock, the commit's manifest created only where none is): S3
(``If-None-Match: *``, ``If-Match``) through s3fs, Azure Blob (``overwrite=False``, an ``etag`` with
``MatchConditions.IfNotModified``) through adlfs, and ``memory://`` emulated in-process. On any other store there is
no condition to issue: :func:`replace` compares the ETag first (best effort) and :data:`CONDITIONAL` says which are
kept apart.
"""

from __future__ import annotations

import threading
from typing import Any

from trainfold._src.checkpoint.storage.requests import call, protocol_of

MEMORY = threading.Lock()  # memory://'s conditional writes: the store lives in this process
S3, AZURE = ("s3", "s3a"), ("abfs", "az", "abfss")
#: the stores whose writes trainfold makes conditional (memory:// in-process)
CONDITIONAL = (*S3, *AZURE, "memory")


class Lost(Exception):
    """A conditional write found another ETag (or, creating, an object already there)."""


class Gone(Lost):
    """A conditional replacement found no object at all (removed by hand, a clean-up script), not another version."""


def fresh(fs: Any, path: str) -> None:
    """Forget what the filesystem cached of ``path`` and its folder's listing: adlfs answers ``info`` and ``exists``
    from a listing it made earlier (a lock's watcher would never see its owner renew the lease)."""
    fs.invalidate_cache(path)
    fs.invalidate_cache(fs._parent(path))


def read_etag(fs: Any, path: str, what: str = "reading the lock") -> str:
    """The object's ETag, asked of the store (never of the filesystem's cache)."""
    fresh(fs, path)
    info = call(fs, what, "info", path)
    return str(info.get("ETag") or info.get("etag") or info.get("created") or "")


def create(fs: Any, path: str, body: bytes, what: str = "creating the lock") -> None:
    """Write ``path`` only if it does not exist (``If-None-Match: *``); raise Lost if it does."""
    kind = protocol_of(fs)
    if kind == "memory":
        with MEMORY:
            if fs.exists(path):
                raise Lost
            fs.pipe_file(path, body)
        return
    try:
        call(fs, what, "pipe_file", path, body, mode="create")
    except FileExistsError:
        raise Lost from None


def replace(fs: Any, path: str, body: bytes, etag: str, what: str = "renewing the lock") -> str:
    """Write ``path`` only if it still has ``etag`` (``If-Match``); return the new ETag.

    Raises:
        Gone: nothing is there (removed; Azure answers a condition on a removed blob as on a changed one, so a failed
            condition asks once whether the object is there).
        Lost: another version is there.
    """
    try:
        return _replace(fs, path, body, etag, what)
    except Gone:
        raise
    except Lost:
        if not exists(fs, path):
            raise Gone from None
        raise


def _replace(fs: Any, path: str, body: bytes, etag: str, what: str) -> str:
    kind = protocol_of(fs)
    if kind == "memory":
        with MEMORY:
            if not fs.exists(path):
                raise Gone
            if _memory_tag(fs, path) != etag:
                raise Lost
            fs.pipe_file(path, body)
            return _memory_tag(fs, path)
    if kind in S3:
        try:
            out = call(fs, what, "pipe_file", path, body, IfMatch=etag)
        except FileNotFoundError:
            raise Gone from None
        except OSError as exc:
            if "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower():
                raise Lost from None
            raise
        return str(out.get("ETag", "")) if isinstance(out, dict) else read_etag(fs, path, what)
    if kind in AZURE:
        from azure.core import MatchConditions

        try:
            out = call(fs, what, "pipe_file", path, body, etag=etag, match_condition=MatchConditions.IfNotModified)
        except FileNotFoundError:
            raise Gone from None
        except OSError as exc:  # 412 (another ETag) or 404 (removed), as azure-core's errors
            if type(exc.__cause__).__name__ == "ResourceNotFoundError":
                raise Gone from None
            if type(exc.__cause__).__name__ == "ResourceModifiedError":
                raise Lost from None
            raise
        return str(out.get("etag", "")) if isinstance(out, dict) else read_etag(fs, path, what)
    # no conditional write known for this store: best effort (see the module's docstring)
    try:
        now = read_etag(fs, path, what)
    except FileNotFoundError:
        raise Gone from None
    if now != etag:
        raise Lost
    call(fs, what, "pipe_file", path, body)
    return read_etag(fs, path, what)


def _memory_tag(fs: Any, path: str) -> str:
    return str(hash(bytes(fs.cat_file(path))))  # memory://: the store is this process's, no request


def tag(fs: Any, path: str) -> str:
    """What tells the object's versions apart: its ETag (a hash of its bytes on memory://, which has none)."""
    return _memory_tag(fs, path) if protocol_of(fs) == "memory" else read_etag(fs, path)


def exists(fs: Any, path: str) -> bool:
    """Whether the object is there, asked of the store."""
    if protocol_of(fs) == "memory":
        return bool(fs.exists(path))  # sync: none: a store's answer
    fresh(fs, path)
    return bool(call(fs, "reading the lock", "exists", path))  # sync: none: a store's answer
