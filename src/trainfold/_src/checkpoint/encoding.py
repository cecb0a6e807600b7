"""The checkpoint format: which part of a run state goes into which file, and the manifest that vouches for them.

A checkpoint is a folder holding:

    MANIFEST.json          format, versions, world size, position; size and digest (XXH3-128) of every file
    state.json             the TrainState's values, optimizer/scheduler/scaler structure, Accelerate's counter;
                           in an adapter checkpoint, the frozen parameters' fingerprints (``frozen.py``)
    state.safetensors      every tensor of those (optimizer moments, running sums, EMA weights...)
    model.safetensors      the model's weights (in an adapter checkpoint, all but the frozen parameters)
    rank-<r>.json          per process: random states (now and at the epoch's start), where a stream stood
    rank-<r>.safetensors   per process: their tensors, the batch read ahead, a partial accumulation's gradients

A sharded checkpoint (format 2) has no ``model.safetensors`` and keeps no
optimizer tensor in ``state.*``: the model's and optimizer's tensors are in
``tensors.json`` and every process's ``shard-<r>.safetensors`` (``formats/dcp.py``).

Owned here: encoding a :class:`~trainfold._src.core.runstate.RunState` (and a process's
data position) into those files and decoding them back. Only JSON and
safetensors are read: nothing can run code. The names, the manifest and the
verified reads are ``manifest.py``'s; how a checkpoint is written atomically and
found again, ``save.py``'s, ``commit.py``'s, ``root.py``'s and its storage's.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import attrs
import torch

from trainfold._src.backend.engine import unwrap
from trainfold._src.backend.position import EpochPosition
from trainfold._src.backend.streams import PART, WHOLE, StreamState
from trainfold._src.base import rng as _rng
from trainfold._src.base.checks import counter
from trainfold._src.base.history import history_from_rows, history_rows
from trainfold._src.base.running_sums import RunningSums
from trainfold._src.checkpoint import codec as _codec
from trainfold._src.checkpoint import digest as _digest
from trainfold._src.checkpoint.content import Content, parse_tensors
from trainfold._src.checkpoint.manifest import json_bytes, parse_json, rank_files
from trainfold._src.core.cursor import Resume
from trainfold._src.core.runstate import NO_HANDLES, FrozenTensor, RunState
from trainfold._src.core.state import TrainState
from trainfold._src.core.stop import Stop
from trainfold.errors import CheckpointError

#: TrainState fields a checkpoint does not write: live handles, and the cursor (written per process).
_HANDLES = ("model", "optimizer", "scheduler", "accelerator", "cursor")
#: TrainState fields with an encoding of their own (kept stable across versions).
_OWN = ("history", "sums")


# --- the shared files: the run state -------------------------------------------------------


def encode_shared(
    run: RunState,
    *,
    accumulation: int,
    mixed_precision: str,
    layout: Mapping[str, Any] | None = None,
    parameters: Mapping[str, int] | None = None,
    peft: Mapping[str, Any] | None = None,
    frozen_ids: Mapping[int, str] | None = None,
) -> dict[str, Content]:
    """``run`` (but its gradients and random states, which are per process) as the shared files' bytes. ``parameters``:
    how many values train and how many are frozen (what ``trainfold inspect`` shows); ``peft``: a PEFT model's adapter
    name and config (what ``trainfold export`` writes as ``adapter_config.json``). A load reads neither. ``frozen_ids``:
    the model's frozen parameters by ``id`` (an EMA's average holds them by reference, and is written without them).

    Raises:
        TypeError: a value that cannot be written (an unregistered record in ``extras``...),
            before anything is written.
    """
    enc = _codec.Encoder(
        frozen_ids if run.frozen else None
    )  # a checkpoint holding every parameter holds the copies' too
    values = run.values
    sums = values.sums
    doc = {
        "state": {
            **{f.name: enc.encode(getattr(values, f.name), f"values.{f.name}") for f in _value_fields(type(values))},
            "history": history_rows(values.history),
            # the main process's, as older checkpoints held them (each process's own are in its rank files)
            **_encode_sums(enc, sums),
        },
        "optimizer": enc.encode(run.optimizer, "optimizer"),
        "scheduler": None if run.scheduler is None else enc.encode(run.scheduler, "scheduler"),
        "scaler": None if run.scaler is None else enc.encode(run.scaler, "scaler"),
        "accelerate": {
            "step": run.accelerate_step,
            "gradient_accumulation_steps": accumulation,
            "mixed_precision": mixed_precision,
        },
        "layout": dict(layout or {}),
        "parameters": dict(parameters or {}),
    }
    if peft is not None:
        doc["peft"] = dict(peft)
    if run.frozen:  # an adapter checkpoint: the frozen parameters by fingerprint, not in the weights
        doc["frozen"] = [
            {"name": f.name, "shape": list(f.shape), "dtype": f.dtype, _digest.DEFAULT: f.digest} for f in run.frozen
        ]
    files: dict[str, Content] = {"state.safetensors": enc.tensors, "state.json": json_bytes(doc)}
    if not run.sharded:  # a sharded checkpoint's weights: each process's shard-<rank>.safetensors
        files["model.safetensors"] = dict(run.weights)
    return files


def _value_fields(cls: type) -> list[attrs.Attribute]:  # type: ignore[type-arg]
    return [f for f in attrs.fields(cls) if f.init and f.name not in _HANDLES + _OWN]


def decode(folder: object, files: Mapping[str, Any], template: TrainState, rank: int) -> tuple[RunState, Resume, int]:
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
    sharded = "model.safetensors" not in files
    weights = {} if sharded else parse_tensors(folder, "model.safetensors", files["model.safetensors"])
    try:
        saved = doc["state"]
        template_model = unwrap(template.accelerator, template.model)  # what a model copy (an EMA's) is a copy of
        values = {
            f.name: _codec.decode(
                saved[f.name], shared, module_template=_codec.deep_template(template_model), device=device
            )
            for f in _value_fields(type(template))
            if f.name in saved
        }
        _check_counters(values)
        if "stop" not in saved:  # written before the stop was one value: only a finished run's stop is carried on
            values["stop"] = _older_stop(saved)
        extras = values.get("extras", {})
        if not isinstance(extras, dict):
            raise TypeError(f"extras is a {type(extras).__name__}, not a mapping")
        # this process's own sums (the shared ones are the main process's: an older checkpoint has only those);
        # mask_nonfinite is written by newer checkpoints; in older ones, a state under nan_guard masked
        own = meta.get("running")
        sums = _decode_sums(saved, shared, device, "nan_guard" in extras)  # decoded either way: every value is checked
        if own is not None:
            sums = _decode_sums(own, per_rank, device, "nan_guard" in extras)
        if sums.started_at > values.get("batch_in_epoch", 0):
            raise ValueError(
                f"the running sums start after batch {sums.started_at}, past the epoch's batch {values.get('batch_in_epoch', 0)}"
            )
        history = history_from_rows(saved["history"])
        optimizer = _codec.decode(doc["optimizer"], shared)
        scheduler = None if doc["scheduler"] is None else _codec.decode(doc["scheduler"], shared)
        scaler = None if doc["scaler"] is None else _codec.decode(doc["scaler"], shared)
        accelerate_step = counter("accelerate.step", doc["accelerate"]["step"])
        accumulation = counter("gradient_accumulation_steps", doc["accelerate"]["gradient_accumulation_steps"])
        frozen = decode_frozen(doc.get("frozen", []))
        grads, resume = _decode_rank(meta, per_rank)
        resume = attrs.evolve(resume, saved_layout=_layout(doc.get("layout"), accumulation))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, RecursionError) as exc:
        raise CheckpointError(
            f"{folder}: a value this trainfold cannot read ({type(exc).__name__}: {exc}): refused, nothing changed."
        ) from None
    if "extras" in values:
        values["extras"] = MappingProxyType(values["extras"])
    state = attrs.evolve(template, **NO_HANDLES, history=history, sums=sums, **values)
    run = RunState(
        values=state,
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        accelerate_step=accelerate_step,
        rng=resume.now,
        sharded=sharded,
        frozen=frozen,
    )
    return run, resume, accumulation


def decode_positions(folder: object, files: Mapping[str, Any], world: int) -> tuple[EpochPosition | None, ...]:
    """Every saving process's data position, in rank order, from the verified ``rank-<r>`` files' bytes.

    Raises:
        CheckpointError: a file or value that cannot be decoded.
    """
    positions = []
    for rank in range(world):
        json_name, tensors_name = rank_files(rank)
        meta = parse_json(folder, json_name, files[json_name])
        tensors = parse_tensors(folder, tensors_name, files[tensors_name])
        try:
            positions.append(_decode_rank(meta, tensors)[1].position)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, RecursionError) as exc:
            raise CheckpointError(
                f"{folder}: {json_name} holds a value this trainfold cannot read ({type(exc).__name__}: {exc}): refused, nothing changed."
            ) from None
    return tuple(positions)


def decode_frozen(saved: Any) -> tuple[FrozenTensor, ...]:
    """An adapter checkpoint's fingerprint, every field checked (a damaged or forged entry fails here, before anything changes).

    Raises:
        TypeError, ValueError: an entry that is not a fingerprint (caught by :func:`decode`).
    """
    if not isinstance(saved, list):
        raise TypeError(f"frozen is a {type(saved).__name__}, not a list")
    out = []
    for entry in saved:
        if not isinstance(entry, dict) or set(entry) != {"name", "shape", "dtype", _digest.DEFAULT}:
            raise ValueError(f"a frozen entry is not name, shape, dtype and {_digest.DEFAULT}: {entry!r:.200}")
        name, shape, dtype, digest = entry["name"], entry["shape"], entry["dtype"], entry[_digest.DEFAULT]
        if not (
            isinstance(name, str)
            and isinstance(dtype, str)
            and isinstance(shape, list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            and _digest.recorded({_digest.DEFAULT: digest}) is not None
        ):
            raise ValueError(f"the frozen entry of {name!r:.100} does not have a name, a shape, a dtype and a digest")
        out.append(FrozenTensor(name, tuple(shape), dtype, digest))
    if len({f.name for f in out}) != len(out):
        raise ValueError("the frozen entries name a parameter twice")
    return tuple(out)


def _layout(layout: Any, accumulation: int) -> tuple[int, int | None, int] | None:
    """(processes, samples per batch over all of them, accumulation steps) of the saving run; None if not recorded."""
    if not isinstance(layout, dict) or "processes" not in layout:
        return None  # written before trainfold recorded it
    per_batch = layout.get("batch_samples")
    return (
        counter("processes", layout["processes"]),
        None if per_batch is None else counter("batch_samples", per_batch),
        accumulation,
    )


def _check_counters(values: Mapping[str, Any]) -> None:
    for name in ("step", "micro_step", "epoch", "batch_in_epoch"):
        counter(name, values.get(name, 0))
    if not isinstance(values.get("end_of_epoch", False), bool):
        raise ValueError(f"end_of_epoch is {values['end_of_epoch']!r}, not a bool")
    if not isinstance(values.get("stop"), (Stop, type(None))):
        raise ValueError(f"stop is {values['stop']!r}, not a Stop or null")


def _older_stop(saved: Mapping[str, Any]) -> Stop | None:
    """The stop of a checkpoint written with ``should_stop``, ``finished``, ``stop_reason`` and ``final_stop``
    fields (a finished run's; the oldest had no ``finished`` and kept any stop), each checked."""
    flags = {k: saved.get(k, False) for k in ("should_stop", "finished", "final_stop")}
    reason = saved.get("stop_reason", "")
    if not all(isinstance(v, bool) for v in flags.values()) or not isinstance(reason, str):
        raise ValueError(f"the stop fields {flags} and stop_reason {reason!r} are not bools and a str")
    finished = flags["finished"] if "finished" in saved else flags["should_stop"]
    return Stop(reason, final=flags["final_stop"], finished=True) if finished else None


# --- the per-process files: random states, the data position, partial gradients --------------


def _encode_sums(enc: _codec.Encoder, sums: RunningSums) -> dict[str, Any]:
    # as they are, not folded: a resumed run adds the same numbers in the same order
    return {
        "loss_sum": enc.encode(sums.folded_loss, "running.loss"),
        "aux_sums": enc.encode(dict(sums.folded_aux), "running.aux"),
        "unsummed": enc.encode(tuple((loss, dict(aux)) for loss, aux in sums.pending), "running.unsummed"),
        "mask_nonfinite": sums.mask_nonfinite,
        "started_at": sums.started_at,
    }


def _decode_sums(
    saved: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: Any, mask_default: bool
) -> RunningSums:
    return RunningSums(
        _codec.decode(saved["loss_sum"], tensors, device=device),
        MappingProxyType(_codec.decode(saved["aux_sums"], tensors, device=device)),
        tuple(
            (loss, MappingProxyType(aux))
            for loss, aux in _codec.decode(saved.get("unsummed", {"__tuple__": []}), tensors, device=device)
        ),
        bool(saved.get("mask_nonfinite", mask_default)),  # sync: none: JSON
        started_at=counter(
            "running.started_at", saved.get("started_at", 0)
        ),  # (0 in a checkpoint written before it was)
    )


def encode_rank(rank: int, run: RunState, position: EpochPosition | None) -> dict[str, Content]:
    """This process's random states, gradients, running sums and (mid-epoch) data position, as its files' bytes.

    The running sums are each process's own (the epoch's train metrics reduce them
    over every process at its end), so each process writes and reads back its own.
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    enc = _codec.Encoder()
    meta["running"] = _encode_sums(enc, run.values.sums)
    now_t, meta["now"] = _rng.to_record(run.rng)
    tensors.update({f"now.{k}": v for k, v in now_t.items()})
    if position is not None:
        start_t, meta["epoch_start"] = _rng.to_record(position.epoch_start)
        tensors.update({f"epoch_start.{k}": v for k, v in start_t.items()})
        meta["epoch_length"] = position.epoch_length
        meta["samples_done"] = position.samples_done
        meta["by_samples"] = position.by_samples
        meta["dispatched"] = position.dispatched
        if position.dealt is not None:
            meta["dealt"] = position.dealt
        if position.source is not None:
            meta["source"] = position.source  # JSON values (source_identity checked them)
        has, batch = position.read_ahead
        meta["read_ahead"] = [has, enc.encode(batch, "read_ahead") if has else None]
        if position.stream is not None:
            s = position.stream
            meta["stream"] = {
                "holder": s.holder,
                "kind": s.kind,
                "workers": s.workers,
                "state": enc.encode(s.state, "stream"),
            }
    tensors.update(enc.tensors)
    meta["grads"] = bool(run.grads)  # sync: none: a host flag
    tensors.update({f"grad.{n}": g for n, g in run.grads.items()})
    json_name, tensors_name = rank_files(rank)
    return {tensors_name: tensors, json_name: json_bytes(meta)}


def _decode_stream(saved: Any, tensors: Mapping[str, torch.Tensor]) -> StreamState | None:
    """Where a stream stood (``rank-<r>.json``'s ``stream``), each field checked."""
    if saved is None:
        return None
    if not isinstance(saved, dict) or set(saved) != {"holder", "kind", "workers", "state"}:
        raise ValueError(f"stream is {saved!r}, not {{holder, kind, workers, state}}")
    if saved["holder"] not in ("loader", "dataset", "redealt") or not isinstance(saved["kind"], str):
        raise ValueError(
            f"stream holder {saved['holder']!r} and kind {saved['kind']!r} are not 'loader', 'dataset' or 'redealt' and a class name"
        )
    return StreamState(
        saved["holder"],
        saved["kind"],
        counter("stream workers", saved["workers"]),
        _codec.decode(saved["state"], tensors),
    )


def _decode_rank(
    meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], Resume]:
    grads = {k[len("grad.") :]: v for k, v in tensors.items() if k.startswith("grad.")} if meta.get("grads") else {}

    def states(prefix: str) -> _rng.RngStates:
        sub = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        return _rng.from_record(sub, meta[prefix])

    read_ahead: tuple[bool, Any] = (False, None)
    if "read_ahead" in meta:
        has, encoded = meta["read_ahead"]
        read_ahead = (bool(has), _codec.decode(encoded, tensors) if has else None)  # sync: none: JSON
    length = meta.get("epoch_length")
    if length is not None:
        counter("epoch_length", length)
    done = meta.get("samples_done")
    if done is not None:
        counter("samples_done", done)
    for flag in ("by_samples", "dispatched"):
        if not isinstance(meta.get(flag, False), bool):
            raise ValueError(f"{flag} is {meta[flag]!r}, not a bool")
    if meta.get("dealt") not in (None, WHOLE, PART):
        raise ValueError(f"dealt is {meta['dealt']!r}, not {WHOLE!r} or {PART!r}")
    if not isinstance(meta.get("source", {}), dict):
        raise ValueError(f"the stream's source is {str(meta['source'])[:100]!r}, not a mapping")
    position = (
        EpochPosition(
            states("epoch_start"),
            read_ahead,
            length,
            done,
            by_samples=meta.get("by_samples", False),
            stream=_decode_stream(meta.get("stream"), tensors),
            dispatched=meta.get("dispatched", False),
            dealt=meta.get("dealt"),
            source=meta.get("source"),
        )
        if "epoch_start" in meta
        else None
    )
    resume = Resume(now=states("now"), position=position)
    return grads, resume
