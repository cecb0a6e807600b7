"""A checkpoint's names and its manifest: which files it holds, their sizes and digests, read back verified.

Owned here: the names (a checkpoint's, :data:`NAME`; its files', :func:`required_files`
and :func:`allowed_name`), the manifest (made by :func:`manifest_bytes`, read and
checked by :func:`read_manifest`), and reading a checkpoint's files back once each,
verified as they are read (:func:`read_verified`, :func:`verify`). JSON and bytes
only, no torch: the command line lists and verifies checkpoints through this module
without importing it. Where the bytes are is a storage's (``storage/``); what the
files contain, ``content.py``'s (writing them, tensors parsed), ``encoding.py``'s
and the formats'.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from trainfold._src.checkpoint import digest as _digest
from trainfold.errors import CheckpointError, DamagedCheckpoint

if TYPE_CHECKING:
    from trainfold._src.checkpoint.storage.protocol import Stored

#: The manifest: written last, it is what makes a checkpoint exist.
MANIFEST = "MANIFEST.json"
PREFIX = "ckpt-"
#: The names trainfold gives checkpoints: ``ckpt-<update>``, and ``ckpt-<update>-<micro_step>`` mid-accumulation.
NAME = re.compile(r"ckpt-[0-9]{1,20}(?:-[0-9]{1,20})?")
#: What crashed saves leave behind: cleaned (under the lock) when a save commits.
DEBRIS = re.compile(r"\.(?:tmp|del|old)-ckpt-[0-9]{1,20}(?:-[0-9]{1,20})?")
#: Format 1: the model and optimizer gathered into the main process's files. Format 2 (sharded): every
#: process writes its own pieces of them (``formats/dcp.py``), and they can be read back on another number of processes.
#: Format 3 (DeepSpeed): the engine's own files for the model and ZeRO optimizer partitions (``formats/engine_files.py``).
FORMAT = 1
SHARDED = 2
DEEPSPEED = 3
FORMATS = (FORMAT, SHARDED, DEEPSPEED)
SHARED = {
    FORMAT: ("model.safetensors", "state.safetensors", "state.json"),
    SHARDED: ("tensors.json", "state.safetensors", "state.json"),
    DEEPSPEED: ("state.safetensors", "state.json"),
}
#: The only names a checkpoint's manifest may list: plain names inside the folder, no separators.
_NAME = re.compile(
    r"(?:model|state)\.safetensors|(?:state|tensors)\.json|(?:rank|shard)-(?:0|[1-9][0-9]{0,5})\.(?:json|safetensors)"
    r"|whole-(?:0|[1-9][0-9]{0,5})\.safetensors"
)
#: And in format 3, the names DeepSpeed gives its files (read by ``formats/engine_files.py``; here, so that no deepspeed import is needed).
_ENGINE_NAME = re.compile(r"(?:bf16_)?(?:zero_pp_rank_(?:0|[1-9][0-9]{0,5})_)?mp_rank_00_(?:model|optim)_states\.pt")


def allowed_name(name: Any, fmt: int) -> bool:
    """Whether a manifest of format ``fmt`` may list ``name``: one of the format's plain file names."""
    return isinstance(name, str) and (
        _NAME.fullmatch(name) is not None or (fmt == DEEPSPEED and _ENGINE_NAME.fullmatch(name) is not None)
    )


def is_engine_file(name: str) -> bool:
    """A DeepSpeed engine file of a format-3 checkpoint."""
    return _ENGINE_NAME.fullmatch(name) is not None


#: Refused before parsing: a manifest or JSON file larger than this is not one trainfold wrote.
MAX_MANIFEST_BYTES = 1 << 20
MAX_JSON_BYTES = 64 << 20


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank}.json", f"rank-{rank}.safetensors"


def process_files(rank: int, fmt: int = FORMAT) -> tuple[str, ...]:
    """The files process ``rank`` writes: its random states and data position; in a sharded checkpoint, its pieces too."""
    return (*rank_files(rank), f"shard-{rank}.safetensors") if fmt == SHARDED else rank_files(rank)


def required_files(world_size: int, fmt: int = FORMAT) -> Iterator[str]:
    """Every file a checkpoint of ``world_size`` processes must have, besides its manifest, one at a time (a manifest
    may declare any number of processes: the first of them it does not list is found after as many as it lists)."""
    yield from SHARED[fmt]
    for rank in range(world_size):
        yield from process_files(rank, fmt)


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def parse_json(folder: object, name: str, data: Any, limit: int = MAX_JSON_BYTES) -> Any:
    if len(data) > limit:
        raise CheckpointError(
            f"{folder}: file {name} has {len(data)} bytes, more than the {limit} a trainfold checkpoint writes: refused unread."
        )
    try:
        return json.loads(bytes(data))
    except RecursionError:
        raise CheckpointError(
            f"{folder}: file {name} is nested too deeply to be a trainfold checkpoint: refused."
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"{folder}: file {name} is not valid JSON ({exc}).") from None


# --- reading files: each once, verified while read ------------------------------------------
def wrong_size(stored: object, name: str, actual: int, expected: int) -> DamagedCheckpoint:
    """The error for a file of another size than its manifest records (every storage says it alike)."""
    return DamagedCheckpoint(
        f"{stored}: file {name} has {actual} bytes, the manifest says {expected}: truncated or altered."
    )


def removed_while_read(where: object, name: str) -> CheckpointError:
    """A file gone between listing and reading: a ``keep_last`` of the run writing there removed the checkpoint meanwhile
    (every storage says it alike)."""
    return CheckpointError(
        f"{where}: file {name} was removed while the checkpoint was read (a keep_last of the run "
        "that writes there removed it?); read the root again for its newest checkpoint."
    )


def _read_checked(stored: Stored, name: str, expected: Mapping[str, Any], keep: bool) -> Any:
    """Read ``name`` once, checking its size and digest (the algorithm its entry names) against the manifest as it is read."""
    algorithm, want = _digest.recorded(expected) or ("", "")  # read_manifest checked every entry
    data = None
    if keep:
        h = _digest.new(algorithm)
        data = stored.read(name, expected["size"], h.update)  # refused if the file has another size
        digest = h.hexdigest()
    else:
        size = stored.size(name)
        if size != expected["size"]:
            raise wrong_size(stored, name, size, expected["size"])
        h = _digest.new(algorithm)
        for chunk in stored.chunks(name):
            h.update(chunk)
        digest = h.hexdigest()
    if digest != want:
        raise DamagedCheckpoint(
            f"{stored}: file {name} does not match its digest ({algorithm}) in the manifest: altered or corrupted."
        )
    return data


def read_verified(
    stored: Stored, manifest: Mapping[str, Any], names: list[str], *, keep: bool = True
) -> dict[str, Any]:
    """The files ``names`` of a checkpoint, each read once and verified against the manifest (in parallel).

    Raises:
        CheckpointError: a file missing, not a regular file (a symbolic link is
            refused, never followed), or of another size or digest.
    """
    files = manifest["files"]
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(names)))) as pool:
        futures = {name: pool.submit(_read_checked, stored, name, files[name], keep) for name in names}
        return {name: future.result() for name, future in futures.items()}


def read_manifest_json(stored: Stored) -> dict[str, Any]:
    """The manifest as parsed JSON: at most ``MAX_MANIFEST_BYTES``, not nested too deeply, an object.

    Raises:
        CheckpointError: no manifest, or one that is a link, too large or not a JSON object.
    """
    raw = stored.manifest_bytes(MAX_MANIFEST_BYTES)
    path = f"{stored}/{MANIFEST}"
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DamagedCheckpoint(
            f"{path} is damaged ({type(exc).__name__}: {exc}); the checkpoint cannot be trusted."
        ) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is damaged: not a JSON object; the checkpoint cannot be trusted.")
    return manifest


def data_ranks(manifest: Mapping[str, Any]) -> Any:
    """The data-parallel ranks that saved a checkpoint, as its manifest records them; older checkpoints recorded none
    and had one per process (``world_size``). :func:`read_manifest` checks the value."""
    return manifest.get("data_ranks", manifest.get("world_size"))


def read_manifest(stored: Stored, *, version: str = "") -> dict[str, Any]:
    """The checkpoint's manifest, checked: its format, its world size, and that it lists every file the format needs and no other.

    Raises:
        CheckpointError: no manifest; a manifest that is damaged, too large,
            nested too deeply, of a newer format, or lists a name that is not a
            plain file of the format (``../x``, ``/etc/...``) or misses one.
    """
    manifest = read_manifest_json(stored)
    folder, path = stored, f"{stored}/{MANIFEST}"
    try:
        files, fmt = manifest["files"], manifest["format"]
    except KeyError as exc:
        raise CheckpointError(f"{path} is damaged (no {exc}); the checkpoint cannot be trusted.") from None
    if fmt not in FORMATS:
        raise CheckpointError(
            f"{folder} was written by trainfold {manifest.get('trainfold_version')} in checkpoint format {fmt}; "
            f"this trainfold ({version}) reads formats {', '.join(map(str, FORMATS))}. Use the trainfold version that wrote it."
        )
    world = manifest.get("world_size")
    if not isinstance(files, dict) or not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointError(f"{path} is damaged: 'files' must be a mapping and 'world_size' a positive int.")
    ranks = data_ranks(manifest)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1 or world % ranks:
        raise CheckpointError(
            f"{path} is damaged: 'data_ranks' must be a positive int that divides 'world_size' ({world})."
        )
    for name, entry in files.items():
        if not allowed_name(name, fmt):
            raise CheckpointError(
                f"{path} lists {name!r}, which is not a file of the checkpoint format (plain names inside the folder only): refused."
            )
        size, digest = (entry.get("size"), _digest.recorded(entry)) if isinstance(entry, dict) else (None, None)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or digest is None:
            raise CheckpointError(
                f"{path} is damaged: the entry of {name} needs a size and one digest (xxh3_128 or sha256)."
            )
    # lazily: a manifest declaring 10^9 processes is refused at its first unlisted file, after as many names as it lists;
    # one that passes lists a file of each process, so its world size is bounded by its own size
    missing = next((name for name in required_files(world, fmt) if name not in files), None)
    if missing is not None:
        raise CheckpointError(
            f"{path} does not list {missing}, a file every checkpoint of {world} process(es) has: incomplete, refused."
        )
    return manifest


# --- the manifest ---------------------------------------------------------------------------


def manifest_bytes(files: Mapping[str, Mapping[str, Any]], fmt: int, **fields: Any) -> bytes:
    """The manifest, written last: every file's size and digest (``files``), and ``fields`` (position...)."""
    return json_bytes({"format": fmt, **fields, "files": dict(sorted(files.items()))})


def verify(stored: Stored, *, rank: int | None = None, version: str = "") -> dict[str, Any]:
    """Check a checkpoint against its manifest and return the manifest (see ``verify_checkpoint``)."""
    manifest = read_manifest(stored, version=version)
    mine = process_files(rank, manifest["format"]) if rank is not None else ()
    names = [n for n in manifest["files"] if rank is None or not n.startswith(("rank-", "shard-")) or n in mine]
    read_verified(stored, manifest, names, keep=False)
    return manifest
