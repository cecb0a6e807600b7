"""Checkpoint storages: where a checkpoint's bytes go, how a save is committed, and how one writer is made sure of.

A storage knows nothing of what the bytes are (that is a format's, and the
manifest's); a format knows nothing of where they go. The save and load protocol
(``checkpoint/save.py``, ``load.py``, ``commit.py``, ``root.py``) speaks to three small interfaces:

- :class:`Storage`, a root of checkpoints: its lock, the checkpoints it holds,
  a place to write a new one, removing one, cleaning what crashed saves left;
- :class:`Staging`, a checkpoint being written: each process writes its files
  (their manifest entries come back, hashed as written), then the main process
  commits it with the manifest, atomically;
- :class:`Stored`, a committed checkpoint: its manifest's bytes, each file's
  size and bytes (read once, verified by the caller as it reads), the names it holds.

The interfaces are in ``protocol.py``. Two storages implement them: a local
POSIX folder (``local.py``: fsync, commit by rename, a ``lockf`` lock in
``lock.py``) and any fsspec URL (``remote.py``: the manifest as the commit, a
lease lock in ``lease.py``, every request bounded in ``requests.py``).
:func:`open_root` and :func:`checkpoint_at` choose the storage of a path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from trainfold._src.checkpoint.storage.local import LocalCheckpoint, LocalRoot
from trainfold._src.checkpoint.storage.protocol import Lock, Staging, Storage, Stored

__all__ = [
    "Lock",
    "Staging",
    "Storage",
    "Stored",
    "checkpoint_at",
    "is_url",
    "open_root",
    "read_object",
    "write_object",
]

#: options trainfold gives an ``s3://`` store unless ``storage_options`` says otherwise: botocore's connect and read
#: timeouts and few retries (a whole request is bounded by ``requests.REQUEST_TIMEOUT_S``), no cached listings
#: (another process's objects are seen at once)
S3_DEFAULTS: dict[str, Any] = {
    "use_listings_cache": False,
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2, "mode": "standard"}},
}


def is_url(path: Any) -> bool:
    """Whether ``path`` names a store through fsspec (``s3://bucket/run``) rather than a local folder (``file://`` is local)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def _local(path: str | os.PathLike[str]) -> Path:
    text = os.fspath(path)
    return Path(text[len("file://") :] if isinstance(text, str) and text.startswith("file://") else text)


def _filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the store's path in it (``bucket/run``).

    Raises:
        ImportError: fsspec, or the store's own package, is not installed (the message says which extra).
        ValueError: a protocol fsspec does not know.
    """
    protocol = url.split("://", 1)[0]
    try:
        import fsspec
        from fsspec.registry import registry
    except ImportError:
        raise ImportError(
            f"{url}: checkpoints on object storage need fsspec and the store's package: pip install 'trainfold[s3]' "
            "for s3://, 'trainfold[azure]' for az:// (gcsfs for gs://)."
        ) from None
    if (
        protocol not in fsspec.available_protocols() and protocol not in registry
    ):  # known to fsspec, or registered with it
        raise ValueError(
            f"{url}: {protocol!r} is not a protocol fsspec knows (s3, gs, az, memory, ...): check the root's URL."
        )
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise ImportError(
            f"{url}: the {protocol}:// store needs a package that is not installed ({exc}); for s3:// pip install "
            "'trainfold[s3]', for az:// 'trainfold[azure]'."
        ) from None
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        options = {**S3_DEFAULTS, **options}
    fs, where = fsspec.core.url_to_fs(url, **options)
    return fs, where.rstrip("/")


def open_root(root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of a root of checkpoints: a local folder, or an fsspec URL (``s3://bucket/run``).

    Raises:
        ImportError, ValueError: see :func:`_filesystem`; ``storage_options`` given for a local folder.
    """
    if not is_url(root):
        if storage_options:
            raise ValueError(
                f"storage_options are for a root on object storage (s3://...); {os.fspath(root)!r} is a local folder."
            )
        return LocalRoot(_local(root))
    from trainfold._src.checkpoint.storage.remote import RemoteRoot

    url = str(root).rstrip("/")
    fs, where = _filesystem(url, storage_options)
    return RemoteRoot(fs, where, url)


def checkpoint_at(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Stored:
    """``path`` as one checkpoint (whether it is one is for its manifest to say: :meth:`Stored.committed`, ``read_manifest``)."""
    if not is_url(path):
        return LocalCheckpoint(_local(path))
    from trainfold._src.checkpoint.storage.remote import RemoteCheckpoint

    url = str(path).rstrip("/")
    fs, where = _filesystem(url, storage_options)
    return RemoteCheckpoint(fs, where, url)


def write_object(path: str | os.PathLike[str], data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write one file at once: an object on a store (a single write is atomic there), a local file renamed into place."""
    if not is_url(path):
        from trainfold._src.base.io import atomic_write, write_durably

        def write(tmp: Path) -> None:
            write_durably(tmp, [data])

        atomic_write(_local(path), write)
        return
    from trainfold._src.checkpoint.storage.requests import call

    fs, where = _filesystem(str(path), storage_options)
    call(fs, f"writing {path}", "pipe_file", where, data)


def read_object(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bytes:
    """One file's bytes, local or on a store.

    Raises:
        FileNotFoundError: nothing there.
    """
    if not is_url(path):
        return _local(path).read_bytes()
    from trainfold._src.checkpoint.storage.requests import call

    fs, where = _filesystem(str(path), storage_options)
    return bytes(call(fs, f"reading {path}", "cat_file", where))
