"""DeepSpeed's engine states inside trainfold's checkpoints (format 3).

Owned here: taking a DeepSpeed engine's own checkpoint files as bytes (its
``save_checkpoint``, written into memory instead of onto the disk), and giving
them back to its ``load_checkpoint`` from bytes trainfold has verified and parsed.

DeepSpeed saves the model and the ZeRO optimizer partitions with ``torch.save``
and loads them with ``torch.load(weights_only=False)``, which runs any pickle.
Here its checkpoint engine is replaced for the duration of a save or a load:
the save hands its files to trainfold's writer (fsynced, hashed, committed
with the rest of the checkpoint); the load reads every engine file once,
verifies it against the manifest, and parses it with torch's restricted
unpickler (``weights_only=True``) that admits only DeepSpeed's four plain
record classes (:data:`RECORDS`); DeepSpeed then reads those parsed values, not
the disk. Everything is read, verified, parsed and checked against the live
engine before the engine is given anything.

Imported only when the Accelerator runs DeepSpeed; deepspeed itself is imported by the functions that need it.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import tempfile
from typing import Any, Callable, Mapping, cast

import torch

from trainfold._src.checkpoint.manifest import is_engine_file

#: The only classes DeepSpeed's files may construct when read: plain records of values, no behaviour run.
RECORDS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

#: DeepSpeed's tag: its files sit in the checkpoint folder itself (``<folder>/<tag>/<file>`` with an empty tag).
_TAG = ""


def _records() -> list[Any]:
    found = []
    for qualified in RECORDS:
        module, _, name = qualified.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: a file that holds it is refused when read
            continue
    return found


def _capturing() -> Any:
    """A checkpoint engine that keeps what DeepSpeed saves, by file name, as ``torch.save`` bytes in memory (``.files``)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class Capture(TorchCheckpointEngine):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(None)
            self.files: dict[str, bytes] = {}

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            del path, exist_ok  # nothing goes to the disk

        def save(self, state_dict: Any, path: str) -> None:
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            self.files[os.path.basename(path)] = buffer.getvalue()

    return Capture()


def _serving(parsed: Mapping[str, Any]) -> Any:
    """A checkpoint engine that gives DeepSpeed the values trainfold already read, verified and parsed."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class Serve(TorchCheckpointEngine):  # type: ignore[misc]
        def load(self, path: str, map_location: Any = None) -> Any:
            name = os.path.basename(path)
            if name not in parsed:
                raise FileNotFoundError(f"{path}: DeepSpeed asked for a file this checkpoint does not list")
            return parsed[name]

    return Serve(None)


def _swapped(engine: Any, replacement: Any, work: Callable[[], Any]) -> Any:
    saved = engine.checkpoint_engine
    engine.checkpoint_engine = replacement
    try:
        return work()
    finally:
        engine.checkpoint_engine = saved


def capture(engine: Any) -> dict[str, bytes]:
    """This process's DeepSpeed checkpoint files (the model's states, its ZeRO optimizer partition), as bytes.

    A collective: every process calls it. DeepSpeed's files name the process that wrote them.
    """
    writer = _capturing()
    with tempfile.TemporaryDirectory(
        prefix="trainfold-deepspeed-"
    ) as scratch:  # DeepSpeed copies its recovery scripts here
        _swapped(engine, writer, lambda: engine.save_checkpoint(scratch, tag=_TAG, client_state={}, save_latest=False))
    return cast("dict[str, bytes]", writer.files)


def local_weights(engine: Any) -> dict[str, torch.Tensor]:
    """This process's part of the weights (ZeRO-3's partitions, the whole model otherwise): what the manifest's finiteness checks."""
    return {n: getattr(p, "ds_tensor", p).detach() for n, p in engine.module.named_parameters()}


def files_to_read(manifest: Mapping[str, Any], rank: int) -> list[str]:
    """The engine files process ``rank`` loads: the model's (its own under ZeRO-3) and every optimizer partition (DeepSpeed reads them all)."""
    names = [n for n in manifest["files"] if is_engine_file(n)]
    own = re.compile(rf"(?:bf16_)?zero_pp_rank_{rank}_mp_rank_00_model_states\.pt")
    return sorted(n for n in names if n.endswith("_optim_states.pt") or "zero_pp_rank_" not in n or own.fullmatch(n))


def parse(files: Mapping[str, Any]) -> dict[str, Any]:
    """Each engine file's values, read by torch's restricted unpickler admitting only :data:`RECORDS`.

    Raises:
        ValueError: a file that is not a torch file, or that names any other class or function
            (the message is a predicate about the checkpoint, naming the file).
    """
    parsed = {}
    with torch.serialization.safe_globals(_records()):
        for name, data in files.items():
            try:
                parsed[name] = torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
            except Exception as exc:  # UnpicklingError, RuntimeError or others, for a hostile or damaged file
                text = str(exc).strip()
                first = text.splitlines()[0][:300] if text else type(exc).__name__
                raise ValueError(
                    f"has a file {name} that is not a DeepSpeed checkpoint file trainfold can read safely ({first}); "
                    "nothing in it ran beyond torch's restricted unpickler: refused."
                ) from None
    return parsed


def check(parsed: Mapping[str, Any], engine: Any, world: int) -> None:
    """Refuse engine files that do not fit the live engine, before it is given any.

    Raises:
        ValueError: another ZeRO stage, another number of processes, another model (a predicate, naming what differs).
    """
    model_files = [v for n, v in parsed.items() if n.endswith("_model_states.pt")]
    optim_files = [v for n, v in parsed.items() if n.endswith("_optim_states.pt")]
    if not model_files:
        raise ValueError("holds no DeepSpeed model states for this process: incomplete, refused.")
    for states in model_files:
        if not isinstance(states, Mapping) or not isinstance(states.get("module"), Mapping):
            raise ValueError("has a DeepSpeed model states file with no 'module' mapping: damaged, refused.")
        saved_world = states.get("dp_world_size")
        if saved_world != world:
            raise ValueError(
                f"was written by DeepSpeed on {saved_world} processes and this run has {world}: ZeRO's optimizer "
                f"partitions cannot be dealt out anew here. Resume it on {saved_world} processes (DeepSpeed's own "
                "ds_to_universal converts its checkpoints for another number)."
            )
    stage = int(engine.zero_optimization_stage())
    for states in optim_files:
        saved = states.get("optimizer_state_dict") if isinstance(states, Mapping) else None
        saved_stage = saved.get("zero_stage") if isinstance(saved, Mapping) else None
        saved_stage = None if saved_stage is None else int(saved_stage)  # DeepSpeed's ZeroStageEnum is an int
        if saved_stage != stage:
            raise ValueError(
                f"holds ZeRO stage {saved_stage} optimizer states and this run uses stage {stage}: resume with the same DeepSpeed config."
            )
    if len(optim_files) != (world if stage else 0):
        raise ValueError(
            f"holds {len(optim_files)} ZeRO optimizer partitions for {world} processes: incomplete, refused."
        )
    _check_shapes(model_files[0], engine)


def _check_shapes(states: Mapping[str, Any], engine: Any) -> None:
    """The saved parameter shapes (DeepSpeed records them under every ZeRO stage) are the live model's."""
    saved: dict[str, tuple[int, ...]] = {}
    for group in states.get("param_shapes") or []:
        saved.update({name: tuple(shape) for name, shape in group.items()})
    live = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters() if p.requires_grad}
    if saved and saved != live:
        differing = sorted(set(saved) ^ set(live)) or sorted(n for n in live if saved[n] != live[n])
        name = differing[0]
        raise ValueError(
            f"is from another model: parameter {name!r} has shape {saved.get(name)} in the checkpoint "
            f"and {live.get(name)} in this model."
        )


def load(engine: Any, folder: str, parsed: Mapping[str, Any]) -> None:
    """Give the engine its saved states (a collective: every process calls it). Call :func:`check` first."""
    _swapped(
        engine,
        _serving(parsed),
        lambda: engine.load_checkpoint(
            folder, tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=True
        ),
    )


_RANK = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_(model|optim)_states\.pt")


def _by_rank(parsed: Mapping[str, Any], kind: str) -> list[Any]:
    """The parsed ``kind`` ("model" or "optim") files of every ZeRO rank, in rank order."""
    found = {
        int(m.group(1)): value for name, value in parsed.items() if (m := _RANK.fullmatch(name)) and m.group(2) == kind
    }
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"has ZeRO {kind} files for ranks {sorted(found)}: one is missing, refused.")
    return [found[r] for r in range(len(found))]


def _numel(shape: Any) -> int:
    return int(torch.Size(shape).numel())


def merged_weights(parsed: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The whole model from DeepSpeed's parsed engine files, offline: the fp32 master weights of every ZeRO partition.

    What DeepSpeed's ``zero_to_fp32.py`` computes, from values already read by the restricted
    unpickler (:func:`parse`): under ZeRO-1/2 each process's flat fp32 partition of a parameter group,
    concatenated in rank order, is cut by the recorded ``param_shapes`` (and alignment paddings);
    under ZeRO-3 each parameter is split over the processes (``ceil(numel / world)`` elements each,
    the last padded) and put back together rank by rank. Buffers come from the model states, frozen
    parameters from their recorded fragments, and a shared parameter under each of its names.

    Raises:
        ValueError: the files do not add up (a rank missing, partitions of another size): a predicate
            about the checkpoint.
    """
    model_files = [v for n, v in parsed.items() if n.endswith("_model_states.pt")]
    ranked = _by_rank(parsed, "model") or model_files[:1]
    if not ranked:
        raise ValueError("holds no DeepSpeed model states: incomplete, refused.")
    first = ranked[0]
    module = first.get("module") or {}
    _tensors_only(module, (first.get("buffer_names") or ()))
    weights: dict[str, torch.Tensor] = {
        k: v.float() if v.is_floating_point() else v  # sync: none: casts of loaded CPU tensors
        for k, v in module.items()
        if k in set(first.get("buffer_names") or ())
    }
    optim = [states["optimizer_state_dict"] for states in _by_rank(parsed, "optim")]
    if not optim:  # no ZeRO partitions (stage 0): the module's states are the whole model
        weights.update({k: v for k, v in module.items() if isinstance(v, torch.Tensor)})
        return weights
    stages: list[Any] = [o.get("zero_stage") if isinstance(o, Mapping) else None for o in optim]
    if any(not isinstance(s, int) or isinstance(s, bool) for s in stages) or len(set(stages)) != 1:
        raise ValueError(
            f"has ZeRO optimizer files whose stages are {stages} (one int, the same on every rank): refused."
        )
    world, stage = len(optim), int(stages[0])
    if stage <= 2:
        _merge_zero2(weights, first, optim, world)
    else:
        _merge_zero3(weights, ranked, optim, world)
    for name, source in (first.get("shared_params") or {}).items():
        if source in weights:
            weights[name] = weights[source]
    return weights


def _tensors_only(values: Mapping[str, Any], names: Any) -> None:
    """Refuse a value among ``names`` of ``values`` (a parsed engine file's) that is not a tensor: a weight it would be."""
    odd = next((k for k in names if k in values and not isinstance(values[k], torch.Tensor)), None)
    if odd is not None:
        raise ValueError(
            f"holds {odd!r} as a {type(values[odd]).__name__}, not a tensor, in its DeepSpeed model states: refused."
        )


def _merge_zero2(weights: dict[str, torch.Tensor], states: Mapping[str, Any], optim: list[Any], world: int) -> None:
    fragments = states.get("frozen_param_fragments") or {}
    _tensors_only(fragments, list(fragments))
    weights.update(fragments)
    paddings = optim[0].get("param_alignment_paddings")
    for group, shapes in enumerate(states["param_shapes"]):
        flat = torch.cat([o["single_partition_of_fp32_groups"][group] for o in optim])
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            size = _numel(shape)
            if offset + size > flat.numel():
                raise ValueError(
                    f"has ZeRO partitions of {flat.numel()} elements for parameter group {group}, too few for {name!r}: refused."
                )
            weights[name] = flat.narrow(0, offset, size).view(torch.Size(shape)).clone()
            offset += size + (paddings[group][i] if paddings is not None else 0)
        align = 2 * world  # DeepSpeed pads each group's flat buffer to a multiple of 2 × world
        if -(-offset // align) != -(-flat.numel() // align):
            raise ValueError(
                f"has ZeRO partitions of {flat.numel()} elements for parameter group {group}, and its shapes take {offset}: refused."
            )


def _merge_zero3(weights: dict[str, torch.Tensor], ranked: list[Any], optim: list[Any], world: int) -> None:
    if len(ranked) != world:
        raise ValueError(
            f"has ZeRO-3 model states of {len(ranked)} processes and optimizer partitions of {world}: refused."
        )
    for name, shape in (ranked[0].get("frozen_param_shapes") or {}).items():
        pieces = torch.cat([states["frozen_param_fragments"][name] for states in ranked])
        weights[name] = pieces.narrow(0, 0, _numel(shape)).view(torch.Size(shape)).clone()
    flats = [torch.cat(list(o["fp32_flat_groups"])) for o in optim]
    offset = 0
    for shapes in ranked[0]["param_shapes"]:
        for name, shape in shapes.items():
            size = _numel(shape)
            part = -(-size // world)
            if offset + part > flats[0].numel():
                raise ValueError(
                    f"has ZeRO-3 partitions of {flats[0].numel()} elements, too few for {name!r}: refused."
                )
            whole = torch.cat([flat.narrow(0, offset, part) for flat in flats])
            weights[name] = whole.narrow(0, 0, size).view(torch.Size(shape)).clone()
            offset += part
    if offset != flats[0].numel():
        raise ValueError(f"has ZeRO-3 partitions of {flats[0].numel()} elements and its shapes take {offset}: refused.")
