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
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import _codec, _rng
from ._cursor import Resume
from ._io import fsync_file
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


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, or does not fit the run it is loaded into."""


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank}.json", f"rank-{rank}.safetensors"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, allow_nan=True))
    fsync_file(path)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    try:
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(path))
    except SafetensorError as exc:  # a full disk, a file-size limit: say it as the OS would
        raise OSError(f"could not write {path}: {exc}") from exc
    fsync_file(path)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}).") from None


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}).") from None


# --- the shared files: the run state -------------------------------------------------------


def write_shared(tmp: Path, run: RunState, *, accumulation: int, mixed_precision: str) -> None:
    """Write ``run`` (but its gradients and random states, which are per process) into the shared files."""
    write_tensors(tmp / "model.safetensors", run.weights)
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
    write_tensors(tmp / "state.safetensors", enc.tensors)
    write_json(tmp / "state.json", doc)


def _value_fields(cls: type) -> list[attrs.Attribute]:  # type: ignore[type-arg]
    return [f for f in attrs.fields(cls) if f.init and f.name not in _HANDLES + _OWN]


def read_shared(folder: Path, doc: Mapping[str, Any], template: TrainState, rank: Mapping[str, Any]) -> RunState:
    """Decode the shared files (and this process's gradients and random states) into a RunState.

    Every value is decoded here, before anything live is changed.

    Raises:
        CheckpointError: a value that cannot be decoded or does not have its type.
    """
    device = template.accelerator.device if template.accelerator is not None else None
    model = template.model
    shared = read_tensors(folder / "state.safetensors")
    saved = doc["state"]
    try:
        values = {f.name: _codec.decode(saved[f.name], shared, module_template=_codec.deep_template(model), device=device)
                  for f in _value_fields(type(template)) if f.name in saved}
        _check_counters(values)
        extras = values.get("extras", {})
        sums = RunningSums(
            _codec.decode(saved["loss_sum"], shared, device=device),
            MappingProxyType(_codec.decode(saved["aux_sums"], shared, device=device)),
            tuple((loss, MappingProxyType(aux)) for loss, aux in _codec.decode(saved.get("unsummed", {"__tuple__": []}), shared, device=device)),
            # written by trainfold 0.2; before, a state under nan_guard masked
            bool(saved.get("mask_nonfinite", "nan_guard" in extras)),
        )
        history = History(tuple(Record(*r) for r in saved["history"]))
        optimizer = _codec.decode(doc["optimizer"], shared)
        scheduler = None if doc["scheduler"] is None else _codec.decode(doc["scheduler"], shared)
        scaler = None if doc["scaler"] is None else _codec.decode(doc["scaler"], shared)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}: state.json holds a value this trainfold cannot read ({type(exc).__name__}: {exc}).") from None
    if "extras" in values:
        values["extras"] = MappingProxyType(values["extras"])
    state = attrs.evolve(template, model=None, optimizer=None, scheduler=None, accelerator=None, cursor=None,
                         history=history, sums=sums, **values)
    return RunState(
        values=state,
        weights=read_tensors(folder / "model.safetensors"),
        grads=rank["grads"],
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        accelerate_step=doc["accelerate"]["step"],
        rng=rank["now"],
    )


def _check_counters(values: Mapping[str, Any]) -> None:
    for name in ("step", "micro_step", "epoch", "batch_in_epoch"):
        v = values.get(name, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"counter {name!r} is {v!r}, not a non-negative int")
    if not isinstance(values.get("should_stop", False), bool):
        raise ValueError(f"should_stop is {values['should_stop']!r}, not a bool")


# --- the per-process files: random states, the data position, partial gradients --------------


def write_rank(tmp: Path, rank: int, run: RunState, resume: Resume | None) -> None:
    """Write this process's random states, gradients and (mid-epoch) data position."""
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
    write_tensors(tmp / tensors_name, tensors)
    write_json(tmp / json_name, meta)


def read_rank(folder: Path, rank: int, device: Any) -> dict[str, Any]:
    """This process's part: ``{"now": RngStates, "grads": {...}, "resume": Resume}``."""
    json_name, tensors_name = rank_files(rank)
    meta = read_json(folder / json_name)
    tensors = read_tensors(folder / tensors_name)
    try:
        grads = {k[len("grad."):]: v for k, v in tensors.items() if k.startswith("grad.")} if meta.get("grads") else {}

        def states(prefix: str) -> _rng.RngStates:
            sub = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
            return _rng.from_record(sub, meta[prefix])

        read_ahead: tuple[bool, Any] = (False, None)
        if "read_ahead" in meta:
            has, encoded = meta["read_ahead"]
            read_ahead = (bool(has), _codec.decode(encoded, tensors) if has else None)
        now = states("now")
        resume = Resume(
            epoch_start=states("epoch_start") if "epoch_start" in meta else None,
            now=now,
            read_ahead=read_ahead,
            epoch_length=meta.get("epoch_length"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {json_name} holds a value this trainfold cannot read ({type(exc).__name__}: {exc}).") from None
    return {"now": now, "grads": grads, "resume": resume}


# --- the manifest ---------------------------------------------------------------------------


def write_manifest(tmp: Path, **fields: Any) -> None:
    """Write the manifest last: every file's size and SHA-256, and ``fields`` (format, position...)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    write_json(tmp / MANIFEST, {"format": FORMAT, **fields, "files": files})


def verify(folder: Path, *, rank: int | None = None, version: str = "") -> dict[str, Any]:
    """Check a checkpoint folder against its manifest and return the manifest (see ``verify_checkpoint``)."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{folder} is not a trainfold checkpoint: it has no {MANIFEST} (an interrupted save leaves only "
            "a .tmp-* folder). Pass a checkpoint folder or the root that holds them."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        fmt = manifest["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is damaged ({exc}); the checkpoint cannot be trusted.") from None
    if fmt != FORMAT:
        raise CheckpointError(
            f"{folder} was written by trainfold {manifest.get('trainfold_version')} in checkpoint format {fmt}; "
            f"this trainfold ({version}) reads format {FORMAT}. Use the trainfold version that wrote it."
        )
    for name, expected in files.items():
        if rank is not None and name.startswith("rank-") and not name.startswith(f"rank-{rank}."):
            continue
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{folder}: file {name} is missing; the checkpoint is damaged.")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"{folder}: file {name} has {size} bytes, the manifest says {expected['size']}: truncated or altered.")
        if sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{folder}: file {name} does not match its SHA-256 in the manifest: altered or corrupted.")
    return manifest
