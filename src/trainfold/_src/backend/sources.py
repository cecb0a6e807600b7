"""What identifies the data a stream reads, recorded with a checkpoint's position and checked at a resume.

A position counts samples of one stream: on other data a resume would train samples twice or never. Where
trainfold can know the source (a ``datasets`` stream's files, a user's ``source_id()``), it is checked.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainfold._src.backend.streams import whole_stream
from trainfold.errors import CheckpointError


def source_identity(loader: Any, processes: int) -> dict[str, Any] | None:
    """What identifies the data ``loader`` streams, where trainfold can know it (None where it cannot): a user's stream's
    ``source_id()`` (a JSON value: a dict of its own, or any value, kept under ``"source_id"``), or a ``datasets``
    stream's data files (by name, with their sizes where they are local) or in-memory tables (rows and fingerprints).
    Always of the whole stream, never of one process's share of it, so that another number of processes compares alike.

    Raises:
        TypeError: ``source_id()`` returned a value JSON cannot hold.
    """
    whole = whole_stream(loader, processes)
    if whole is None:  # only this process's share is at hand (a loader Accelerate split by process itself): unknown
        return None
    if callable(getattr(whole, "source_id", None)):
        value = whole.source_id()
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise TypeError(
                f"{type(whole).__name__}.source_id() returned {value!r:.100}, which a checkpoint cannot hold: "
                "return JSON values (str, numbers, lists, dicts of str keys)."
            ) from None
        return dict(value) if isinstance(value, dict) else {"source_id": value}
    return _datasets_identity(whole)


def _datasets_identity(stream: Any) -> dict[str, Any] | None:
    """A ``datasets`` stream's files or tables, from its examples iterables (every source of an interleave or concatenation)."""
    pending, files, tables = [getattr(stream, "_ex_iterable", None)], {}, []
    while pending:
        it = pending.pop()
        if it is None:
            continue
        kwargs = getattr(it, "kwargs", None) or {}
        for path in kwargs.get("base_files") or ():
            name = str(path)
            files[os.path.basename(name)] = os.path.getsize(name) if os.path.isfile(name) else None
        for table in kwargs.get("shards") or ():
            if hasattr(table, "num_rows"):
                tables.append([table.num_rows, getattr(table, "_fingerprint", None)])
        pending.extend(getattr(it, "ex_iterables", None) or ())
        pending.append(getattr(it, "ex_iterable", None))
    identity: dict[str, Any] = {}
    if files:
        identity["files"] = files
    if tables:
        identity["tables"] = tables
    return identity or None


def check_source(saved: Any, now: dict[str, Any] | None) -> None:
    """The live stream's source (:func:`source_identity`) must be the one a checkpoint recorded, where both are known.

    Raises:
        CheckpointError: another source, naming the first difference (a file added, removed or of another size).
    """
    if saved is None or now is None or saved == now:
        return
    raise CheckpointError(
        f"run_epoch: the stream's source changed since the checkpoint: {_difference(saved, now)}. The epoch's position "
        "counts samples of the stream that saved it: on other data, samples would be trained twice or never. Resume with "
        "the data that saved it, or from a checkpoint between epochs."
    )


def _difference(saved: dict[str, Any], now: dict[str, Any]) -> str:
    before, after = saved.get("files"), now.get("files")
    if isinstance(before, dict) and isinstance(after, dict) and before != after:
        for name in sorted(before.keys() | after.keys()):
            if name not in after:
                return f"{name} was read, and is removed"
            if name not in before:
                return f"{name} is added"
            if before[name] != after[name]:
                return f"{name} changed size ({before[name]} bytes, now {after[name]})"
    key = next(k for k in sorted(saved.keys() | now.keys(), key=str) if saved.get(k) != now.get(k))
    return f"{key} was {saved.get(key)!r:.200}, now {now.get(key)!r:.200}"
