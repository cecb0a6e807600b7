"""Checkpoints that cannot lie: atomic save, verified load, exact resume (mid-epoch too).

A checkpoint is a folder ``<root>/ckpt-<micro_step>`` holding::

    MANIFEST.json          format, versions, world size, position; size and SHA-256 of every file
    state.json             the TrainState's values, optimizer/scheduler/scaler structure, Accelerate's counter
    state.safetensors      every tensor of those (optimizer moments, running sums, EMA weights...)
    model.safetensors      the model's weights
    rank-<r>.json          per process: random states (now and at the epoch's start)
    rank-<r>.safetensors   per process: their tensors, the batch read ahead, a partial accumulation's gradients

It is written into ``<root>/.tmp-ckpt-<micro_step>``, every file fsynced, the
manifest written last, then renamed into place: a crash leaves no checkpoint
that looks complete. Loading verifies the manifest before touching anything and
uses only JSON and safetensors: it cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, overload

import attrs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from toolz import curry

from . import _codec, _rng
from ._backend import inner_optimizer, read_ahead_batch
from ._cursor import EpochCursor, Resume
from ._guard import NanGuardFlags, NanGuardState
from ._io import fsync_dir, fsync_file
from ._types import Batch, Step, StepTransformer
from ._validate import (
    expect_owned,
    expect_state,
    length_or_none,
    name_of,
    named,
    positive_int,
)
from .context import Context
from .epoch_fns import BestState, PatienceState
from .history import History, Record
from .state import TrainState
from .transforms import EmaState, LogState

FORMAT = 1
MANIFEST = "MANIFEST.json"
PREFIX = "ckpt-"

for _cls in (PatienceState, BestState, LogState, NanGuardState, NanGuardFlags, EmaState):
    _codec.register(_cls)


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, or does not fit the run it is loaded into."""


def _version() -> str:
    from . import __version__

    return __version__


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, allow_nan=True))
    fsync_file(path)


def _write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    try:
        save_file(dict(tensors), str(path))
    except SafetensorError as exc:  # a full disk, a file-size limit: say it as the OS would
        raise OSError(f"could not write {path}: {exc}") from exc
    fsync_file(path)


# --- save -----------------------------------------------------------------------------------


@overload
def save_checkpoint(ctx: Context, root: str | os.PathLike[str], *, keep_last: int | None = ...) -> Any: ...
@overload
def save_checkpoint(ctx: Context, root: str | os.PathLike[str], state: TrainState, *, keep_last: int | None = ...) -> TrainState: ...
@curry  # type: ignore[misc]
def save_checkpoint(ctx: Context, root: str | os.PathLike[str], state: TrainState, *, keep_last: int | None = None) -> TrainState:
    """Write a checkpoint of ``state`` under ``root`` and return the state unchanged.

    Everything needed to continue exactly is written: the model, optimizer,
    scheduler and loss-scaler states, Accelerate's accumulation counter, the
    whole TrainState (counters, history, the states of step transformers and
    epoch functions, running sums), every process's random states, and the data
    position: the epoch, the batch inside it, the random state the epoch began
    with (to replay its shuffle order) and the batch the loader has read ahead.
    Mid-accumulation, the partial gradients are kept too.

    The new checkpoint becomes visible only when complete; with ``keep_last=N``
    older ones are removed only after it is committed. On several processes,
    the main process writes the shared files and each process its own.

    Args:
        ctx: the run's Context.
        root: the folder that holds the run's checkpoints.
        state: the state to save.
        keep_last: keep only the newest N checkpoints under ``root``.

    Returns:
        ``state``, unchanged (so it composes as an epoch function).

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> state = save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
        >>> latest_checkpoint(root).name
        'ckpt-0000000004'

    .. versionadded:: 0.1.0
    """
    state = expect_owned("save_checkpoint", ctx, expect_state("save_checkpoint", state))
    if keep_last is not None:
        positive_int("keep_last", keep_last)
    acc = ctx.accelerator
    now = _rng.capture(_generators(state))  # first: nothing below may draw before this
    root = Path(root)
    name = f"{PREFIX}{state.micro_step:010d}"
    tmp = root / f".tmp-{name}"
    if ctx.is_main_process:
        _check_same_run(root, state)
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a save of this position that died half-way
        tmp.mkdir()
    ctx.wait_for_everyone()
    weights = acc.get_state_dict(state.model)  # every process takes part (sharded engines gather)
    try:
        if ctx.is_main_process:
            _write_shared(tmp, ctx, state, weights)
        _write_rank(tmp, ctx, state, now)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(
            f"saving a checkpoint under {root} failed ({exc}); nothing was committed and the previous "
            "checkpoints are intact. Free space (or lower keep_last) and save again."
        ) from exc
    ctx.wait_for_everyone()
    if ctx.is_main_process:
        _commit(tmp, root / name, ctx, state)
        if keep_last is not None:
            _prune(root, keep_last)
    ctx.wait_for_everyone()
    return state


def _check_same_run(root: Path, state: TrainState) -> None:
    """Refuse to mix two runs' checkpoints in one folder (the newest would silently win on resume)."""
    latest = latest_checkpoint(root)
    if latest is None or not state.run_id:
        return
    try:
        other = json.loads((latest / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError):
        return  # a damaged manifest is reported when loading
    if other and other != state.run_id:
        raise CheckpointError(
            f"{root} holds checkpoints of another run (run {other}, newest {latest.name}); this run is {state.run_id}. "
            "Use one folder per run, or resume that run with load_checkpoint(ctx, root, state) before saving."
        )


def _generators(state: TrainState) -> list[torch.Generator]:
    from ._backend import loader_generators

    cursor = state.cursor
    return loader_generators(cursor.loader) if isinstance(cursor, EpochCursor) else []


def _write_shared(tmp: Path, ctx: Context, state: TrainState, weights: Mapping[str, torch.Tensor]) -> None:
    acc = ctx.accelerator
    _write_tensors(tmp / "model.safetensors", {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()})
    enc = _codec.Encoder()
    doc = {
        "state": {
            "step": state.step,
            "micro_step": state.micro_step,
            "epoch": state.epoch,
            "batch_in_epoch": state.batch_in_epoch,
            "should_stop": state.should_stop,
            "run_id": state.run_id,
            "history": [[r.epoch, r.step, r.name, r.value] for r in state.history],
            # as they are, not summed: a resumed run adds the same numbers in the same order
            "loss_sum": enc.encode(state._loss_sum, "running.loss"),
            "aux_sums": enc.encode(dict(state._aux_sums), "running.aux"),
            "unsummed": enc.encode(tuple((loss, dict(aux)) for loss, aux in state.unsummed), "running.unsummed"),
            "extras": enc.encode(dict(state.extras), "extras"),
        },
        "optimizer": enc.encode(inner_optimizer(state.optimizer).state_dict(), "optimizer"),
        "scheduler": None if state.scheduler is None else enc.encode(state.scheduler.state_dict(), "scheduler"),
        "scaler": None if acc.scaler is None else enc.encode(acc.scaler.state_dict(), "scaler"),
        "accelerate": {"step": int(acc.step), "gradient_accumulation_steps": ctx.gradient_accumulation_steps, "mixed_precision": ctx.mixed_precision},
    }
    _write_tensors(tmp / "state.safetensors", enc.tensors)
    _write_json(tmp / "state.json", doc)


def _write_rank(tmp: Path, ctx: Context, state: TrainState, now: _rng.RngStates) -> None:
    acc = ctx.accelerator
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    now_t, meta["now"] = _rng.to_record(now)
    tensors.update({f"now.{k}": v for k, v in now_t.items()})
    cursor = state.cursor
    if isinstance(cursor, EpochCursor) and cursor.epoch_start is not None and state.batch_in_epoch > 0:
        start_t, meta["epoch_start"] = _rng.to_record(cursor.epoch_start)
        tensors.update({f"epoch_start.{k}": v for k, v in start_t.items()})
        meta["epoch_length"] = length_or_none(cursor.loader)
        has, batch = read_ahead_batch(cursor.iterator, cursor.loader)
        enc = _codec.Encoder()
        meta["read_ahead"] = [has, enc.encode(batch, "read_ahead") if has else None]
        tensors.update(enc.tensors)
    if acc.step % ctx.gradient_accumulation_steps:
        # Mid-accumulation: the gradients summed so far are part of the state.
        model = acc.unwrap_model(state.model)
        meta["grads"] = True
        tensors.update({f"grad.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    rank = acc.process_index
    _write_tensors(tmp / f"rank-{rank}.safetensors", {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()})
    _write_json(tmp / f"rank-{rank}.json", meta)


def _commit(tmp: Path, final: Path, ctx: Context, state: TrainState) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {
        "format": FORMAT,
        "trainfold_version": _version(),
        "torch_version": torch.__version__,
        "world_size": ctx.accelerator.num_processes,
        "run_id": state.run_id,
        "step": state.step,
        "epoch": state.epoch,
        "micro_step": state.micro_step,
        "files": files,
    }
    _write_json(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    if final.exists():  # the same position saved again: swap, then drop the old one
        old = final.with_name(f".old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def _prune(root: Path, keep_last: int) -> None:
    for old in list_checkpoints(root)[:-keep_last]:
        doomed = old.with_name(f".del-{old.name}")
        os.replace(old, doomed)  # never a half-deleted folder that still looks committed
        shutil.rmtree(doomed, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first (folders with a manifest)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / MANIFEST).is_file())


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root``, or None.

    Example:
        >>> latest_checkpoint("/nonexistent") is None
        True

    Example:
        >>> list_checkpoints("/nonexistent")
        []

    .. versionadded:: 0.1.0
    """
    found = list_checkpoints(root)
    return found[-1] if found else None


# --- load -----------------------------------------------------------------------------------


def verify_checkpoint(path: str | os.PathLike[str], *, rank: int | None = None) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest and return the manifest.

    Every file the manifest lists (or, with ``rank``, the shared files and that
    process's) must exist with the recorded size and SHA-256.

    Raises:
        CheckpointError: not a checkpoint, an unreadable manifest, a newer
            format, or a missing, truncated or altered file (named).
    """
    folder = Path(path)
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
            f"this trainfold ({_version()}) reads format {FORMAT}. Use the trainfold version that wrote it."
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
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{folder}: file {name} does not match its SHA-256 in the manifest: altered or corrupted.")
    return manifest


def _resolve(path: str | os.PathLike[str]) -> Path:
    folder = Path(path)
    if (folder / MANIFEST).is_file():
        return folder
    latest = latest_checkpoint(folder)
    if latest is None:
        if folder.is_dir() and any(p.name.startswith(f".tmp-{PREFIX}") for p in folder.iterdir()):
            raise CheckpointError(f"{folder} holds only unfinished checkpoints (.tmp-*): no save completed.")
        raise CheckpointError(f"{folder} is neither a trainfold checkpoint nor a folder of checkpoints.")
    return latest


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}).") from None


@overload
def load_checkpoint(ctx: Context, path: str | os.PathLike[str]) -> Any: ...
@overload
def load_checkpoint(ctx: Context, path: str | os.PathLike[str], state: TrainState) -> TrainState: ...
@curry  # type: ignore[misc]
def load_checkpoint(ctx: Context, path: str | os.PathLike[str], state: TrainState) -> TrainState:
    """Load a checkpoint into ``state``'s model, optimizer and scheduler and return the saved state.

    ``path`` is a checkpoint folder, or a root of them (then the newest complete
    one). Before anything is changed, the files are verified against the
    manifest and the checkpoint is checked against the run: the same world size,
    the same parameters (names and shapes) and the same optimizer layout. Then
    the weights, optimizer, scheduler, scaler and Accelerate's accumulation
    counter are restored in place, the random states are restored, and a state
    is returned whose next ``run_epoch`` continues the interrupted epoch from
    the next batch, in the same order. Call ``run_epoch`` next: anything that
    draws random numbers in between changes what follows.

    Raises:
        CheckpointError: a damaged checkpoint (naming the file), another model
            (naming the first parameter that differs), another optimizer layout,
            another world size, another accumulation setting.

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> trained = save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
        >>> resumed = load_checkpoint(ctx, root, state)
        >>> resumed.step, resumed.epoch
        (4, 1)

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> _ = save_checkpoint(ctx, root, state)
        >>> sorted(verify_checkpoint(latest_checkpoint(root))["files"])[:2]
        ['model.safetensors', 'rank-0.json']

    .. versionadded:: 0.1.0
    """
    state = expect_owned("load_checkpoint", ctx, expect_state("load_checkpoint", state))
    acc = ctx.accelerator
    folder = _resolve(path)
    manifest = verify_checkpoint(folder, rank=acc.process_index)
    if manifest["world_size"] != acc.num_processes:
        raise CheckpointError(
            f"{folder} was written by {manifest['world_size']} processes but this run has {acc.num_processes}: "
            "resume with the same number of processes (the random states and the data position are per process)."
        )
    try:
        doc = json.loads((folder / "state.json").read_text())
        rank_meta = json.loads((folder / f"rank-{acc.process_index}.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"{folder}: state.json or a rank file is not valid JSON ({exc}).") from None
    saved_acc = doc["accelerate"]
    if saved_acc["gradient_accumulation_steps"] != ctx.gradient_accumulation_steps:
        raise CheckpointError(
            f"{folder} was saved with gradient_accumulation_steps={saved_acc['gradient_accumulation_steps']}, this run "
            f"uses {ctx.gradient_accumulation_steps}: the accumulation phase and the updates would not line up. "
            "Resume with the same Accelerator settings."
        )
    weights = _read_tensors(folder / "model.safetensors")
    shared = _read_tensors(folder / "state.safetensors")
    per_rank = _read_tensors(folder / f"rank-{acc.process_index}.safetensors")
    model = acc.unwrap_model(state.model)
    _check_model(folder, model, weights)
    optimizer_state = _codec.decode(doc["optimizer"], shared)
    _check_optimizer(folder, inner_optimizer(state.optimizer), optimizer_state)
    if (doc["scheduler"] is None) != (state.scheduler is None):
        raise CheckpointError(f"{folder}: the checkpoint {'has no' if doc['scheduler'] is None else 'has a'} scheduler but the state {'has one' if state.scheduler is not None else 'has none'}.")

    # Everything checked: now change things.
    model.load_state_dict(weights, strict=True)
    inner_optimizer(state.optimizer).load_state_dict(optimizer_state)
    if state.scheduler is not None:
        state.scheduler.load_state_dict(_codec.decode(doc["scheduler"], shared))
    if acc.scaler is not None and doc["scaler"] is not None:
        acc.scaler.load_state_dict(_codec.decode(doc["scaler"], shared))
    acc.step = saved_acc["step"]
    _restore_grads(model, per_rank, rank_meta)
    resume = _resume_record(per_rank, rank_meta, acc.device)
    _rng.restore(attrs.evolve(resume.now, generators=()), ())  # the loader's generators: in run_epoch
    return _restored_state(ctx, state, doc["state"], shared, model, resume)


def _check_model(folder: Path, model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    current = model.state_dict()
    for name, tensor in current.items():
        if name not in weights:
            raise CheckpointError(f"{folder} is from another model: it has no parameter {name!r} (shape {tuple(tensor.shape)}).")
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{folder} is from another model: parameter {name!r} has shape {tuple(weights[name].shape)} in the "
                f"checkpoint and {tuple(tensor.shape)} in this model."
            )
    extra = sorted(set(weights) - set(current))
    if extra:
        raise CheckpointError(f"{folder} is from another model: it has parameters this model lacks, first {extra[0]!r}.")


def _check_optimizer(folder: Path, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise CheckpointError(
            f"{folder}: the optimizer layout differs: the checkpoint has parameter groups of sizes "
            f"{[len(s['params']) for s in saved_groups]}, this optimizer {[len(g['params']) for g in groups]}."
        )
    params = [p for g in groups for p in g["params"]]
    ids = [i for s in saved_groups for i in s["params"]]
    by_id = dict(zip(ids, params))
    for pid, entry in saved["state"].items():
        param = by_id.get(pid)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and param is not None and tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{folder}: the optimizer state {key!r} of parameter {ids.index(pid)} has shape "
                    f"{tuple(value.shape)} but the parameter has {tuple(param.shape)}: another optimizer layout."
                )


def _restore_grads(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    for name, p in model.named_parameters():
        key = f"grad.{name}"
        p.grad = tensors[key].to(p.device, p.dtype) if meta.get("grads") and key in tensors else None


def _resume_record(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], device: Any) -> Resume:
    def states(prefix: str) -> _rng.RngStates:
        sub = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        return _rng.from_record(sub, meta[prefix])

    start = states("epoch_start") if "epoch_start" in meta else None
    read_ahead: tuple[bool, Batch] = (False, None)
    if "read_ahead" in meta:
        has, encoded = meta["read_ahead"]
        read_ahead = (bool(has), _codec.decode(encoded, tensors) if has else None)
    return Resume(epoch_start=start, now=states("now"), read_ahead=read_ahead, epoch_length=meta.get("epoch_length"))


def _restored_state(ctx: Context, state: TrainState, saved: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, resume: Resume) -> TrainState:
    device = ctx.accelerator.device
    extras = _codec.decode(saved["extras"], tensors, module_template=_codec.deep_template(model), device=device)
    return attrs.evolve(
        state,
        step=saved["step"],
        micro_step=saved["micro_step"],
        epoch=saved["epoch"],
        batch_in_epoch=saved["batch_in_epoch"],
        should_stop=saved["should_stop"],
        run_id=saved.get("run_id", state.run_id),
        history=History(tuple(Record(*r) for r in saved["history"])),
        loss_sum=_codec.decode(saved["loss_sum"], tensors, device=device),
        aux_sums=MappingProxyType(_codec.decode(saved["aux_sums"], tensors, device=device)),
        unsummed=tuple(
            (loss, MappingProxyType(aux)) for loss, aux in _codec.decode(saved.get("unsummed", {"__tuple__": []}), tensors, device=device)
        ),
        extras=MappingProxyType(extras),
        cursor=resume,
    )


# --- periodic saving ------------------------------------------------------------------------


def checkpoint_every(ctx: Context, root: str | os.PathLike[str], n: int, *, keep_last: int | None = None) -> StepTransformer:
    """A step transformer that saves a checkpoint after every ``n``-th optimizer update, and when the run stops.

    A final checkpoint is written after the step at which the run stops for any
    reason (``max_steps``, ``nan_guard``, or Ctrl-C, which ``run_epoch`` turns
    into a stop at the next step boundary), so an interrupted run loses nothing.
    For checkpoints per epoch, compose ``save_checkpoint(ctx, root, keep_last=...)``
    after ``run_epoch`` instead (or ``every(k, save_checkpoint(...))``).

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> state = run_epoch(ctx, checkpoint_every(ctx, root, 2, keep_last=1)(make_step(ctx, loss_fn)), loader, state)
        >>> [p.name for p in list_checkpoints(root)]
        ['ckpt-0000000004']

    .. versionadded:: 0.1.0
    """
    positive_int("checkpoint_every", n)
    interrupt = ctx.interrupt

    def transform(step: Step) -> Step:
        def saving(state: TrainState, batch: Batch) -> TrainState:
            new = step(state, batch)
            due = new.step != state.step and new.step % n == 0
            stopping = (new.should_stop and not state.should_stop) or (interrupt.requested and interrupt.agreed(ctx.accelerator, new.step))
            if due or stopping:
                return save_checkpoint(ctx, root, new, keep_last=keep_last)
            return new

        return named(saving, f"checkpoint_every({n})({name_of(step)})")

    return transform
