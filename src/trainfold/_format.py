"""The checkpoint format: which part of a run state goes into which file, and the manifest that vouches for them.

A checkpoint is a folder holding::

    MANIFEST.json          format, versions, world size, position; size and SHA-256 of every file
    state.json             the TrainState's values, optimizer/scheduler/scaler structure, Accelerate's counter
    state.safetensors      every tensor of those (optimizer moments, running sums, EMA weights...)
    model.safetensors      the model's weights
    rank-<r>.json          per process: random states (now and at the epoch's start)
    rank-<r>.safetensors   per process: their tensors, the batch read ahead, a partial accumulation's gradients

Owned here: encoding a :class:`~trainfold._runstate.RunState` (and a process's
data position) into those files and decoding them back, the manifest, and
verification. Only JSON and safetensors are read: nothing can run code. How a
checkpoint is written atomically and found again is ``checkpoint.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Union

import attrs
import torch

from . import _codec, _rng, _safetensors
from ._cursor import Resume
from ._runstate import RunState
from .history import History, Record
from .metrics import RunningSums
from .state import TrainState

FORMAT = 1
MANIFEST = "MANIFEST.json"
SHARED = ("model.safetensors", "state.safetensors", "state.json")
#: TrainState fields a checkpoint does not write: live handles, and the cursor (written per process).
_HANDLES = ("model", "optimizer", "scheduler", "accelerator", "cursor")
#: TrainState fields with an encoding of their own (kept stable across versions).
_OWN = ("history", "sums")
#: The only names a checkpoint's manifest may list: plain names inside the folder, no separators.
_NAME = re.compile(r"(?:model|state)\.safetensors|state\.json|rank-(?:0|[1-9][0-9]{0,5})\.(?:json|safetensors)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Refused before parsing: a manifest or JSON file larger than this is not one trainfold wrote.
MAX_MANIFEST_BYTES = 1 << 20
MAX_JSON_BYTES = 64 << 20


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, or does not fit the run it is loaded into."""


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank}.json", f"rank-{rank}.safetensors"


def required_files(world_size: int) -> list[str]:
    """Every file a checkpoint of ``world_size`` processes must have, besides its manifest."""
    return [*SHARED, *(name for r in range(world_size) for name in rank_files(r))]


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:  # hashlib releases the GIL for large buffers
    return hashlib.sha256(data).hexdigest()


#: A file's content before it is written: JSON bytes, or the tensors of a safetensors file.
Content = Union[bytes, Mapping[str, torch.Tensor]]


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path``, fsynced (a full disk raises OSError, ENOSPC); return its manifest entry."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": sha256_bytes(data)}


def _write(path: Path, content: Content) -> dict[str, Any]:
    return write_file(path, content) if isinstance(content, bytes) else _safetensors.write(path, content)


def write_files(folder: Path, files: Mapping[str, Content]) -> dict[str, dict[str, Any]]:
    """Write every file (fsynced, two at a time) and return their manifest entries, hashed as written."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_write, folder / name, content) for name, content in files.items()}
        return {name: future.result() for name, future in futures.items()}


def parse_tensors(folder: Path, name: str, data: Any) -> dict[str, torch.Tensor]:
    try:
        return _safetensors.parse(data)
    except _safetensors.FormatError as exc:
        raise CheckpointError(f"{folder}: file {name} is not a readable safetensors file ({exc}).") from None


def parse_json(folder: Path, name: str, data: Any, limit: int = MAX_JSON_BYTES) -> Any:
    if len(data) > limit:
        raise CheckpointError(f"{folder}: file {name} has {len(data)} bytes, more than the {limit} a trainfold checkpoint writes: refused unread.")
    try:
        return json.loads(bytes(data))
    except RecursionError:
        raise CheckpointError(f"{folder}: file {name} is nested too deeply to be a trainfold checkpoint: refused.") from None
    except ValueError as exc:
        raise CheckpointError(f"{folder}: file {name} is not valid JSON ({exc}).") from None


# --- reading files: inside the folder, regular, verified while read ---------------------------


def _regular(folder: Path, name: str) -> os.stat_result:
    """``lstat`` of a file the manifest lists: it must be a regular file in the folder, not a link."""
    try:
        st = os.lstat(folder / name)
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: file {name} is missing; the checkpoint is damaged.") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{folder}: file {name} is a symbolic link; a checkpoint holds regular files only: refused, not followed.")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{folder}: file {name} is not a regular file: refused.")
    return st


def _read_checked(folder: Path, name: str, expected: Mapping[str, Any], keep: bool) -> Any:
    """Read ``name`` once, checking its size and SHA-256 against the manifest as it is read."""
    st = _regular(folder, name)
    if st.st_size != expected["size"]:
        raise CheckpointError(f"{folder}: file {name} has {st.st_size} bytes, the manifest says {expected['size']}: truncated or altered.")
    data = None
    if keep:
        try:
            data = _safetensors.read_into(folder / name, expected["size"])
        except _safetensors.FormatError:
            raise CheckpointError(f"{folder}: file {name} changed size while it was read: altered.") from None
        digest = sha256_bytes(data)
    else:
        h = hashlib.sha256()
        with os.fdopen(os.open(folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        digest = h.hexdigest()
    if digest != expected["sha256"]:
        raise CheckpointError(f"{folder}: file {name} does not match its SHA-256 in the manifest: altered or corrupted.")
    return data


def read_verified(folder: Path, manifest: Mapping[str, Any], names: list[str], *, keep: bool = True) -> dict[str, Any]:
    """The files ``names`` of a checkpoint, each read once and verified against the manifest (in parallel).

    Raises:
        CheckpointError: a file missing, not a regular file (a symbolic link is
            refused, never followed), or of another size or digest.
    """
    files = manifest["files"]
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(names)))) as pool:
        futures = {name: pool.submit(_read_checked, folder, name, files[name], keep) for name in names}
        return {name: future.result() for name, future in futures.items()}  # type: ignore[misc]


def read_manifest_json(folder: Path) -> dict[str, Any]:
    """The manifest as parsed JSON: a regular file in a real folder, at most ``MAX_MANIFEST_BYTES``, not nested too deeply.

    Raises:
        CheckpointError: no manifest, or one that is a link, too large or not a JSON object.
    """
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
        raise CheckpointError(f"{folder}: {MANIFEST} is not a regular file (a link or a special file): refused, not followed.")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is damaged: {st.st_size} bytes, more than a manifest can be; refused unread.")
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: {exc}); the checkpoint cannot be trusted.") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is damaged: not a JSON object; the checkpoint cannot be trusted.")
    return manifest


def read_manifest(folder: Path, *, version: str = "") -> dict[str, Any]:
    """The checkpoint's manifest, checked: its format, its world size, and that it lists every file the format needs and no other.

    Raises:
        CheckpointError: no manifest; a manifest that is damaged, too large,
            nested too deeply, of a newer format, or lists a name that is not a
            plain file of the format (``../x``, ``/etc/...``) or misses one.
    """
    manifest = read_manifest_json(folder)
    path = folder / MANIFEST
    try:
        files, fmt = manifest["files"], manifest["format"]
    except KeyError as exc:
        raise CheckpointError(f"{path} is damaged (no {exc}); the checkpoint cannot be trusted.") from None
    if fmt != FORMAT:
        raise CheckpointError(
            f"{folder} was written by trainfold {manifest.get('trainfold_version')} in checkpoint format {fmt}; "
            f"this trainfold ({version}) reads format {FORMAT}. Use the trainfold version that wrote it."
        )
    world = manifest.get("world_size")
    if not isinstance(files, dict) or not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointError(f"{path} is damaged: 'files' must be a mapping and 'world_size' a positive int.")
    for name, entry in files.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise CheckpointError(f"{path} lists {name!r}, which is not a file of the checkpoint format (plain names inside the folder only): refused.")
        size, digest = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise CheckpointError(f"{path} is damaged: the entry of {name} needs a size and a SHA-256.")
    missing = [name for name in required_files(world) if name not in files]
    if missing:
        raise CheckpointError(f"{path} does not list {missing[0]}, a file every checkpoint of {world} process(es) has: incomplete, refused.")
    return manifest


# --- the shared files: the run state -------------------------------------------------------


def encode_shared(run: RunState, *, accumulation: int, mixed_precision: str) -> dict[str, Content]:
    """``run`` (but its gradients and random states, which are per process) as the shared files' bytes.

    Raises:
        TypeError: a value that cannot be written (an unregistered record in ``extras``...),
            before anything is written.
    """
    enc = _codec.Encoder()
    values = run.values
    sums = values.sums
    doc = {
        "state": {
            **{f.name: enc.encode(getattr(values, f.name), f"values.{f.name}") for f in _value_fields(type(values))},
            "history": [[r.epoch, r.step, r.name, r.value] for r in values.history],
            # as they are, not folded: a resumed run adds the same numbers in the same order
            "loss_sum": enc.encode(sums.folded_loss, "running.loss"),
            "aux_sums": enc.encode(dict(sums.folded_aux), "running.aux"),
            "unsummed": enc.encode(tuple((loss, dict(aux)) for loss, aux in sums.pending), "running.unsummed"),
            "mask_nonfinite": sums.mask_nonfinite,
        },
        "optimizer": enc.encode(run.optimizer, "optimizer"),
        "scheduler": None if run.scheduler is None else enc.encode(run.scheduler, "scheduler"),
        "scaler": None if run.scaler is None else enc.encode(run.scaler, "scaler"),
        "accelerate": {"step": run.accelerate_step, "gradient_accumulation_steps": accumulation, "mixed_precision": mixed_precision},
    }
    return {"model.safetensors": dict(run.weights), "state.safetensors": enc.tensors, "state.json": json_bytes(doc)}


def _value_fields(cls: type) -> list[attrs.Attribute]:  # type: ignore[type-arg]
    return [f for f in attrs.fields(cls) if f.init and f.name not in _HANDLES + _OWN]


def decode(folder: Path, files: Mapping[str, Any], template: TrainState, rank: int) -> tuple[RunState, Resume, int]:
    """The run state, this process's data position and the accumulation steps saved, decoded from the verified files' bytes.

    Every value is decoded and checked here, before anything live is changed.

    Raises:
        CheckpointError: a file or value that cannot be decoded or does not have its type.
    """
    device = template.accelerator.device if template.accelerator is not None else None
    doc = parse_json(folder, "state.json", files["state.json"])
    json_name, tensors_name = rank_files(rank)
    meta = parse_json(folder, json_name, files[json_name])
    shared = parse_tensors(folder, "state.safetensors", files["state.safetensors"])
    per_rank = parse_tensors(folder, tensors_name, files[tensors_name])
    weights = parse_tensors(folder, "model.safetensors", files["model.safetensors"])
    try:
        saved = doc["state"]
        values = {f.name: _codec.decode(saved[f.name], shared, module_template=_codec.deep_template(template.model), device=device)
                  for f in _value_fields(type(template)) if f.name in saved}
        _check_counters(values)
        extras = values.get("extras", {})
        if not isinstance(extras, dict):
            raise TypeError(f"extras is a {type(extras).__name__}, not a mapping")
        sums = RunningSums(
            _codec.decode(saved["loss_sum"], shared, device=device),
            MappingProxyType(_codec.decode(saved["aux_sums"], shared, device=device)),
            tuple((loss, MappingProxyType(aux)) for loss, aux in _codec.decode(saved.get("unsummed", {"__tuple__": []}), shared, device=device)),
            # written by trainfold 0.2; before, a state under nan_guard masked
            bool(saved.get("mask_nonfinite", "nan_guard" in extras)),
        )
        history = History(tuple(_record(r) for r in saved["history"]))
        optimizer = _codec.decode(doc["optimizer"], shared)
        scheduler = None if doc["scheduler"] is None else _codec.decode(doc["scheduler"], shared)
        scaler = None if doc["scaler"] is None else _codec.decode(doc["scaler"], shared)
        accelerate_step = _count("accelerate.step", doc["accelerate"]["step"])
        accumulation = _count("gradient_accumulation_steps", doc["accelerate"]["gradient_accumulation_steps"])
        grads, resume = _decode_rank(meta, per_rank)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, RecursionError) as exc:
        raise CheckpointError(f"{folder}: a value this trainfold cannot read ({type(exc).__name__}: {exc}): refused, nothing changed.") from None
    if "extras" in values:
        values["extras"] = MappingProxyType(values["extras"])
    state = attrs.evolve(template, model=None, optimizer=None, scheduler=None, accelerator=None, cursor=None,
                         history=history, sums=sums, **values)
    run = RunState(values=state, weights=weights, grads=grads, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                   accelerate_step=accelerate_step, rng=resume.now)
    return run, resume, accumulation


def _count(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"counter {name!r} is {v!r}, not a non-negative int")
    return v


def _check_counters(values: Mapping[str, Any]) -> None:
    for name in ("step", "micro_step", "epoch", "batch_in_epoch"):
        _count(name, values.get(name, 0))
    if not isinstance(values.get("should_stop", False), bool):
        raise ValueError(f"should_stop is {values['should_stop']!r}, not a bool")


def _record(r: Any) -> Record:
    epoch, step, name, value = r
    if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"history record {r!r} is not [epoch, step, name, value]")
    return Record(_count("history epoch", epoch), _count("history step", step), name, float(value))


# --- the per-process files: random states, the data position, partial gradients --------------


def encode_rank(rank: int, run: RunState, resume: Resume | None) -> dict[str, Content]:
    """This process's random states, gradients and (mid-epoch) data position, as its files' bytes."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    now_t, meta["now"] = _rng.to_record(run.rng)
    tensors.update({f"now.{k}": v for k, v in now_t.items()})
    if resume is not None:
        start_t, meta["epoch_start"] = _rng.to_record(resume.epoch_start)  # type: ignore[arg-type]
        tensors.update({f"epoch_start.{k}": v for k, v in start_t.items()})
        meta["epoch_length"] = resume.epoch_length
        has, batch = resume.read_ahead
        enc = _codec.Encoder()
        meta["read_ahead"] = [has, enc.encode(batch, "read_ahead") if has else None]
        tensors.update(enc.tensors)
    meta["grads"] = bool(run.grads)
    tensors.update({f"grad.{n}": g for n, g in run.grads.items()})
    json_name, tensors_name = rank_files(rank)
    return {tensors_name: tensors, json_name: json_bytes(meta)}


def _decode_rank(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Resume]:
    grads = {k[len("grad."):]: v for k, v in tensors.items() if k.startswith("grad.")} if meta.get("grads") else {}

    def states(prefix: str) -> _rng.RngStates:
        sub = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        return _rng.from_record(sub, meta[prefix])

    read_ahead: tuple[bool, Any] = (False, None)
    if "read_ahead" in meta:
        has, encoded = meta["read_ahead"]
        read_ahead = (bool(has), _codec.decode(encoded, tensors) if has else None)
    length = meta.get("epoch_length")
    if length is not None:
        _count("epoch_length", length)
    resume = Resume(
        epoch_start=states("epoch_start") if "epoch_start" in meta else None,
        now=states("now"),
        read_ahead=read_ahead,
        epoch_length=length,
    )
    return grads, resume


# --- the manifest ---------------------------------------------------------------------------


def write_manifest(tmp: Path, files: Mapping[str, Mapping[str, Any]], **fields: Any) -> None:
    """Write the manifest last: every file's size and SHA-256 (``files``), and ``fields`` (format, position...)."""
    write_file(tmp / MANIFEST, json_bytes({"format": FORMAT, **fields, "files": dict(sorted(files.items()))}))


def digest_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Manifest entries of files another process wrote (read back and hashed)."""
    entries = {}
    for name in names:
        st = _regular(folder, name)
        h = hashlib.sha256()
        with open(folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        entries[name] = {"size": st.st_size, "sha256": h.hexdigest()}
    return entries


def verify(folder: Path, *, rank: int | None = None, version: str = "") -> dict[str, Any]:
    """Check a checkpoint folder against its manifest and return the manifest (see ``verify_checkpoint``)."""
    manifest = read_manifest(folder, version=version)
    names = [n for n in manifest["files"] if rank is None or not n.startswith("rank-") or n.startswith(f"rank-{rank}.")]
    read_verified(folder, manifest, names, keep=False)
    return manifest
