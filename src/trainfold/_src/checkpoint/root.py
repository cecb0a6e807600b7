"""A run's checkpoint root, over any storage: the checkpoints it holds, their order, and one of them by path.

Owned here: :func:`list_checkpoints` and :func:`latest_checkpoint` (order by the
position each manifest records, only names trainfold writes), :func:`resolve` (a
folder or a root, to one checkpoint) and :func:`verify_checkpoint`. Manifests and
file digests only, no torch: the command line lists and verifies through this
module. Writing to a root (its names, the lock, the commit, ``keep_last``) is
``commit.py``'s; how a commit is made atomic and a lock exclusive is the storage's
(``storage/``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Union

from trainfold._version import __version__
from trainfold._src.checkpoint.manifest import PREFIX, read_manifest_json, verify
from trainfold._src.checkpoint.storage import checkpoint_at, open_root
from trainfold._src.checkpoint.storage.protocol import Storage, Stored
from trainfold.errors import CheckpointError

logger = logging.getLogger("trainfold")

#: where a checkpoint is, as the public API gives it: a ``Path`` in a local root, a URL (``s3://...``) on a store
CheckpointPath = Union[Path, str]


def ordered(storage: Storage) -> list[Stored]:
    """The committed checkpoints of ``storage``, oldest first by the position their manifests record; damaged ones left out."""
    return [stored for stored, _ in ordered_with_manifests(storage)]


def ordered_with_manifests(storage: Storage) -> list[tuple[Stored, dict[str, Any]]]:
    """:func:`ordered`, each with its manifest as read (parsed JSON, its position checked)."""
    found = []
    for stored in storage.checkpoints():
        try:
            manifest = read_manifest_json(stored)  # any format: a newer one is ordered, and refused when loaded
            position = (manifest["micro_step"], manifest["step"])
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in position):
                raise CheckpointError(f"{stored}/MANIFEST.json is damaged: its position is not a pair of ints.")
        except (CheckpointError, KeyError) as exc:
            logger.warning("skipping %s: %s", stored, exc)
            continue
        found.append((position, stored.name, stored, manifest))
    return [(stored, manifest) for *_, stored, manifest in sorted(found, key=lambda f: f[:2])]


def list_checkpoints(
    root: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> list[CheckpointPath]:
    """The committed checkpoints under ``root``, oldest first: ``Path`` objects in a local root, URLs (``str``) on a store.

    Only folders named as trainfold names checkpoints (``ckpt-<update>``...)
    with a readable manifest count, ordered by the position recorded in that
    manifest (not by name: a copy named ``ckpt-best`` is not "newest"). A
    checkpoint whose manifest is damaged is left out, with a warning on the
    ``trainfold`` logger. ``root`` may be an fsspec URL (``s3://bucket/run``),
    with ``storage_options`` for its filesystem.

    Args:
        root: a local folder or an fsspec URL.
        storage_options: options for the store's fsspec filesystem (a URL only).

    Returns:
        The checkpoints, oldest first (an empty list for a root that does not exist).

    Raises:
        ValueError: ``storage_options`` for a local root.
        CheckpointError: a URL whose protocol fsspec does not know, or whose package is not installed.

    Examples:
        >>> list_checkpoints("/nonexistent")
        []
    """
    return [c.path for c in ordered(open_root(root, storage_options))]


def latest_checkpoint(
    root: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> CheckpointPath | None:
    """The newest committed checkpoint under ``root`` (by the position it records), or None (see :func:`list_checkpoints`).

    Args:
        root: a local folder or an fsspec URL.
        storage_options: options for the store's fsspec filesystem (a URL only).

    Returns:
        The newest checkpoint's path (a URL on a store), or None where there is none.

    Raises:
        ValueError: ``storage_options`` for a local root.
        CheckpointError: as :func:`list_checkpoints`.

    Examples:
        >>> latest_checkpoint("/nonexistent") is None
        True
    """
    found = list_checkpoints(root, storage_options=storage_options)
    return found[-1] if found else None


def resolve(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Stored:
    """The checkpoint at ``path``, or the newest one under it.

    Raises:
        CheckpointError: neither (saying so when only unfinished saves are there).
    """
    return newest_first(path, storage_options)[0]


def newest_first(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> list[Stored]:
    """The checkpoint at ``path`` alone, or the complete ones under it, the newest first (by the position each records).

    Raises:
        CheckpointError: neither (saying so when only unfinished saves are there).
    """
    stored = checkpoint_at(path, storage_options)
    if stored.committed():
        return [stored]
    return [stored for stored, _ in _newest_under(open_root(path, storage_options))]


def newest_first_with_manifests(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> list[tuple[Stored, dict[str, Any]]]:
    """:func:`newest_first`, each with its manifest as read (once: a root's listing reads every one).

    Raises:
        CheckpointError: neither a checkpoint nor a root of them.
    """
    stored = checkpoint_at(path, storage_options)
    if stored.committed():
        return [(stored, read_manifest_json(stored))]
    return _newest_under(open_root(path, storage_options))


def _newest_under(storage: Storage) -> list[tuple[Stored, dict[str, Any]]]:
    found = ordered_with_manifests(storage)
    if not found:
        if any(name.startswith(f".tmp-{PREFIX}") for name in storage.unfinished()):
            raise CheckpointError(f"{storage} holds only unfinished checkpoints (.tmp-*): no save completed.")
        raise CheckpointError(f"{storage} is neither a trainfold checkpoint nor a folder of checkpoints.")
    return found[::-1]


def expect_path(where: str, path: Any) -> str | os.PathLike[str]:
    """``path`` if it is a path; else the TypeError that names what ``where`` was given (None: no checkpoint found)."""
    if not isinstance(path, (str, os.PathLike)):
        found = (
            "None: latest_checkpoint(root) found no complete checkpoint there"
            if path is None
            else f"a {type(path).__name__}"
        )
        raise TypeError(
            f"{where} needs the path of a checkpoint folder or root (got {found}). Check the root, or save a checkpoint first."
        )
    return path


def verify_checkpoint(
    path: str | os.PathLike[str], *, rank: int | None = None, storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest and return the manifest.

    The manifest must list every file the format needs, and only plain names
    inside the folder; every file it lists (or, with ``rank``, the shared files
    and that process's) must be a regular file (a symbolic link is refused,
    never followed) with the recorded size and digest (XXH3-128; SHA-256 in older checkpoints).

    Args:
        path: a checkpoint folder (or its URL).
        rank: check only the shared files and this process's; None: every file.
        storage_options: options for the store's fsspec filesystem (a URL only).

    Returns:
        The manifest, a dict (``format``, ``step``, ``world_size``, ``files``...).

    Raises:
        CheckpointError: not a checkpoint, an unreadable, oversized or incomplete
            manifest, a newer format, or a missing, truncated, altered or linked file (named).
        TypeError: ``path`` is not a path (``None``: what ``latest_checkpoint`` returns for a
            root without a complete checkpoint).

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> _ = save_checkpoint(ctx, root, state)
        >>> manifest = verify_checkpoint(latest_checkpoint(root))
        >>> manifest["step"], manifest["world_size"], sorted(manifest["files"])[:2]
        (0, 1, ['model.safetensors', 'rank-0.json'])
    """
    return verify(
        checkpoint_at(expect_path("verify_checkpoint", path), storage_options), rank=rank, version=__version__
    )
