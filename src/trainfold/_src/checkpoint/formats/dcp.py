"""Sharded checkpoints: the model's and optimizer's tensors through ``torch.distributed.checkpoint``, on trainfold's storage.

DCP plans who writes which piece of which tensor (each process the shards it
holds of an FSDP model; one copy of a tensor every DDP process holds) and, on
load, which pieces each process reads to fill its own layout, whatever layout
wrote them: that is what lets a checkpoint of N processes resume on M.
trainfold supplies the storage: each process writes its pieces into one
safetensors file, ``shard-<rank>.safetensors`` (of a sharded model, what every
process holds whole into a small ``whole-<rank>.safetensors`` beside it, so that
a load reads its own shards and not every process's), and the main process writes
DCP's metadata (every tensor's global shape and dtype, and where each piece
lies) as JSON, ``tensors.json``, instead of DCP's pickle. A load reads only
JSON and safetensors, each verified against the manifest before it is parsed:
nothing in a checkpoint can run code.

Owned here: splitting a model and optimizer into DCP's flat tensors and the
values JSON holds (:func:`split_state`), writing the pieces
(:func:`write_shards`), reading and checking the metadata
(:func:`~trainfold._src.checkpoint.formats.dcp_metadata.parse_metadata`, :func:`check_layout`), and reading the pieces into
the live layout (:func:`load_shards`). What else a checkpoint holds is
``encoding.py``'s.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Mapping

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from trainfold._src.backend.engine import is_dtensor, local
from trainfold._src.backend.optim import cpu_number
from trainfold._src.base.io import ALIGNMENT
from trainfold._src.checkpoint import safetensors as _safetensors
from trainfold._src.checkpoint.formats.dcp_metadata import METADATA, check_piece, metadata_json
from trainfold._src.checkpoint.formats.dcp_plan import MergingPlanner
from trainfold._src.checkpoint.storage.protocol import Staging
from trainfold.errors import CheckpointError

MODEL, OPTIM = "model.", "optim."
#: the flattened optimizer state dict's keys of a parameter group's settings (``param_groups.<name>.lr``)
GROUPS = "param_groups."


_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def shard_file(rank: int) -> str:
    return f"shard-{rank}.safetensors"


def whole_file(rank: int) -> str:
    """Where process ``rank`` writes, beside its shards of a sharded model, its share of the tensors every process
    holds whole (an optimizer's steps, the buffers): a small file, which every process reads at a load, where read
    with the shards they would make each process read every process's shard file."""
    return f"whole-{rank}.safetensors"


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns that it "assumes the intent" to work on one process even when told so (``no_dist=True``): it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def split_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and optimizer's tensors, flat (``model.<name>``, ``optim.state.<name>.<key>``), and the optimizer's other values.

    The tensors are the live ones (an FSDP model's are its DTensor shards), not
    copies. The other values (learning rates, betas...) are keyed as torch's
    flattened optimizer state dict keys them (``param_groups.<name>.lr``) and go
    into ``state.json``.

    Raises:
        TypeError: the model's state dict holds a value that is not a tensor.
    """
    tensors = {MODEL + name: value for name, value in _model_tensors(model).items()}
    rest: dict[str, Any] = {}
    for key, item in get_optimizer_state_dict(model, optimizer, options=_OPTIONS).items():
        if key.startswith(GROUPS):
            item = cpu_number(
                item
            )  # a compiled update's learning rate is a 0-d tensor; the checkpoint keeps the number
        if isinstance(item, torch.Tensor):
            tensors[OPTIM + key] = item
        else:
            rest[key] = item
    return tensors, rest


def own_share(
    tensors: Mapping[str, torch.Tensor], rank: int, world: int, buffers: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """The tensors process ``rank`` writes: every DTensor (its own shard; DCP writes each replicated piece once), and of
    the plain tensors, which every process holds whole (DDP's replicas, FSDP's unsharded buffers), those dealt to it.

    The deal gives each plain tensor, in name order, to the process with the fewest bytes so far: every process
    computes the same deal, so each tensor is written once, and the writing is spread as DCP's own deduplication
    would spread it after planning. Dealt before, a background save copies only this process's share to host memory.
    The model's ``buffers`` are the first process's: they can differ between processes (batch-norm statistics, each
    process's own batches), and the first process's are the ones DDP hands to all at the next forward.
    """
    if world <= 1:
        return dict(tensors)
    dealt = [0] * world
    share: dict[str, torch.Tensor] = {}
    firsts = set(buffers)
    for name in sorted(tensors):
        tensor = tensors[name]
        if is_dtensor(tensor):
            share[name] = tensor
            continue
        owner = 0 if name in firsts else min(range(world), key=dealt.__getitem__)
        dealt[owner] += tensor.numel() * tensor.element_size()
        if owner == rank:
            share[name] = tensor
    return share


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as DCP names it (an FSDP model's values are its DTensor shards).

    Raises:
        TypeError: a value that is not a tensor (a module's ``extra_state``).
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in get_model_state_dict(model).items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"a sharded checkpoint holds tensors only, but the model's state dict has {name!r}, a {type(value).__name__}."
            )
        out[name] = value
    return out


class _Writer(StorageWriter):
    """Writes this process's pieces into ``shard-<rank>.safetensors`` (of a sharded model, its shards there and the
    tensors held whole in ``whole-<rank>.safetensors``); the coordinator writes ``tensors.json``."""

    def __init__(self, staging: Staging, rank: int, sharded: Collection[str] = ()) -> None:
        super().__init__()
        self.staging, self.rank, self.sharded = staging, rank, frozenset(sharded)
        self.entries: dict[str, dict[str, Any]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        files: dict[str, dict[str, torch.Tensor]] = {shard_file(self.rank): {}}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(f"a sharded checkpoint holds tensors only; {item.index.fqn!r} is not one.")
            t = planner.resolve_data(item)
            assert isinstance(t, torch.Tensor)
            t = t.detach()
            key = _key(item.index)
            whole = self.sharded and item.index.fqn not in self.sharded
            name = whole_file(self.rank) if whole else shard_file(self.rank)
            files.setdefault(name, {})[key] = t
            results.append(
                WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(), storage_data=(name, key))
            )
        for name, tensors in files.items():
            self.entries[name] = self.staging.write(name, _safetensors.encode(tensors))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        stored = {r.index: r.storage_data for per_rank in results for r in per_rank}
        self.entries[METADATA] = self.staging.write(METADATA, metadata_json(metadata, stored))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    return f"{index.fqn}@{offset}"


def write_shards(
    staging: Staging, tensors: Mapping[str, torch.Tensor], rank: int, group: Any = None
) -> dict[str, dict[str, Any]]:
    """Write this process's pieces of ``tensors`` (a collective over ``group``: every process calls it) and return their manifest entries.

    The coordinator's entries include ``tensors.json``.
    """
    writer = _Writer(staging, rank, [name for name, t in tensors.items() if is_dtensor(t)])
    try:
        with _one_process_quiet():
            dcp_save(
                dict(tensors),
                storage_writer=writer,
                planner=MergingPlanner(),
                process_group=group,
                no_dist=not _distributed(),
            )
    except CheckpointException as exc:
        raise _unwrapped(exc) from None
    return writer.entries


def _unwrapped(exc: CheckpointException) -> Exception:
    """DCP's exception (a BaseException that gathers every process's failure) as the first process's own error.

    A full disk stays an ``OSError``, a damaged piece a ``CheckpointError`` (of its own kind: a
    ``DamagedCheckpoint`` stays one, which a load of a root falls back from), so callers handle them
    as they handle the same failure in trainfold's own writes.
    """
    rank, (first, _) = min(exc.failures.items(), key=lambda kv: kv[0])
    text = f"on process {rank}: {type(first).__name__}: {first}"
    if isinstance(first, OSError):
        return OSError(first.errno, text)
    if isinstance(first, CheckpointError):
        return type(first)(str(first))
    if isinstance(first, TypeError):
        return TypeError(text)
    return RuntimeError(text)


class _Reader(StorageReader):
    """Reads pieces from the verified shard files (each file read once, when a piece of it is first needed).

    A piece that is the whole of a destination tensor, in its dtype and on its device, is not copied: it is
    *adopted* (``adopted``), and the destination's memory, allocated but never written, is never touched.
    On the topology that saved, that is every piece: the verified buffers become the loaded tensors.
    """

    def __init__(
        self,
        metadata: Metadata,
        read_file: Callable[[str], Mapping[str, torch.Tensor]],
        dest: Mapping[str, torch.Tensor],
    ) -> None:
        super().__init__()
        self.metadata, self.read_file, self.dest = metadata, read_file, dest
        self.files: dict[str, Mapping[str, torch.Tensor]] = {}
        #: destination name -> the piece of a verified file that is the whole of it
        self.adopted: dict[str, torch.Tensor] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointError(
                    f"{item.dest_index.fqn!r} is not stored as a tensor: refused (a sharded checkpoint holds tensors only)."
                )
            file, key = self.metadata.storage_data[item.storage_index]
            if file not in self.files:
                self.files[file] = self.read_file(file)
            piece = check_piece(self.metadata, item.storage_index, file, self.files[file].get(key))
            source = narrow_tensor_by_index(piece, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if _is_whole_of(source, target, local(self.dest[item.dest_index.fqn])):
                self.adopted[item.dest_index.fqn] = source
            else:
                target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _is_whole_of(source: torch.Tensor, target: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``source`` can stand for the destination ``whole`` itself: ``target``, the part of it a read item
    fills, is all of it, and ``source`` has its shape, dtype, device and (contiguous) layout, at an address torch's
    allocator could have given it (64-byte aligned: a piece at another offset, in a file written before pieces were
    aligned, is copied)."""
    return (
        target.dim() > 0  # a 0-d value (an optimizer's step) is copied: a view would hold its whole file's buffer
        and target.shape == whole.shape
        and source.shape == target.shape
        and source.dtype == target.dtype
        and source.device == target.device
        and source.is_contiguous()
        and target.is_contiguous()
        and source.data_ptr() % ALIGNMENT == 0  # where torch would allocate it: CPU kernels sum by alignment
    )


def check_layout(
    metadata: Metadata,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rest: Mapping[str, Any],
    frozen: frozenset[str] = frozenset(),
) -> None:
    """Raise unless the saved tensors fit this model and optimizer (names, global shapes), before anything changes.

    ``frozen``: the parameters an adapter checkpoint records by fingerprint and holds no piece of.

    Raises:
        ValueError: a parameter missing on either side, of another shape, an
            optimizer over other parameters or with other settings (a predicate
            about the checkpoint, as ``StateMismatch``'s).
    """
    saved = metadata.state_dict_metadata
    live = _model_tensors(model)
    for name, value in live.items():
        if name in frozen:
            continue
        md = saved.get(MODEL + name)
        if md is None:
            raise ValueError(f"is from another model: it has no parameter {name!r} (shape {tuple(value.shape)}).")
        if tuple(md.size) != tuple(value.shape):  # type: ignore[union-attr]
            raise ValueError(
                f"is from another model: parameter {name!r} has shape {tuple(md.size)} in the checkpoint and {tuple(value.shape)} in this model."  # type: ignore[union-attr]
            )
    extra = sorted(k[len(MODEL) :] for k in saved if k.startswith(MODEL) and k[len(MODEL) :] not in live)
    if extra:
        raise ValueError(f"is from another model: it has parameters this model lacks, first {extra[0]!r}.")
    names = _optimizer_names(model, optimizer)
    saved_names = {_param_of(k[len(GROUPS) :], live) for k in rest if k.startswith(GROUPS)}
    if saved_names != set(names.values()):
        only = sorted(map(str, saved_names ^ set(names.values())))
        raise ValueError(
            f"does not fit this optimizer: the checkpoint's optimizer is over other parameters (first differing: {only[0]!r})."
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            for hp, value in group.items():
                if hp in ("params", "param_names"):
                    continue
                key = f"param_groups.{names[id(p)]}.{hp}"
                if key not in rest:
                    raise ValueError(
                        f"does not fit this optimizer: its optimizer has no setting {hp!r}: another optimizer."
                    )
    for key, md in saved.items():
        if not key.startswith(OPTIM + "state."):
            continue
        owner = _param_of(key[len(OPTIM + "state.") :], live)
        if owner is None:
            raise ValueError(
                f"does not fit this optimizer: its optimizer state {key[len(OPTIM) :]!r} belongs to no parameter of this model."
            )
        shape, allowed = tuple(md.size), _state_shapes(tuple(live[owner].shape))  # type: ignore[union-attr]
        if shape not in allowed:
            raise ValueError(
                f"does not fit this optimizer: its optimizer state {key[len(OPTIM) :]!r} has shape {shape}, which no optimizer keeps "
                f"for the parameter {owner!r} of shape {tuple(live[owner].shape)} (a number, the parameter's shape, or a factored moment)."
            )


def _state_shapes(param: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The shapes an optimizer keeps for a parameter: a number (Adam's step), the parameter's (moments, momentum), or
    a factored second moment (Adafactor's row and column statistics, with or without a kept dimension)."""
    shapes = {(), (1,), param}
    if len(param) >= 2:
        shapes |= {param[:-1], param[:-2] + param[-1:], param[:-1] + (1,), param[:-2] + (1,) + param[-1:]}
    elif len(param) == 1:
        shapes |= {(1,)}
    return shapes


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {id(p): by_id.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]}


def _param_of(rest: str, names: Mapping[str, Any]) -> str | None:
    """The parameter name ``rest`` starts with (``0.weight.exp_avg`` -> ``0.weight``): the longest that matches."""
    best = None
    for name in names:
        if rest.startswith(name + ".") and (best is None or len(name) > len(best)):
            best = name
    return best


def load_shards(
    metadata: Metadata,
    read_file: Callable[[str], Mapping[str, torch.Tensor]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    frozen: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Read the saved tensors into new tensors laid out as this run's (a collective) and return them, flat.

    Nothing live is changed: the model's tensors are read into empty copies of
    its own (DTensors stay DTensors, sharded as this run shards them), the
    optimizer's into tensors shaped like their parameters.

    Raises:
        CheckpointError: a piece missing from its file, or of another shape or dtype.
    """
    live = _model_tensors(model)
    dest: dict[str, torch.Tensor] = {MODEL + k: torch.empty_like(v) for k, v in live.items() if k not in frozen}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(OPTIM):
            continue
        name = _param_of(key[len(OPTIM + "state.") :], live)
        assert isinstance(md, TensorStorageMetadata) and name is not None  # check_layout ran
        param = live[name]
        if tuple(md.size) == tuple(param.shape) and len(md.size) > 0:
            dest[key] = torch.empty_like(param, dtype=md.properties.dtype)
        else:
            dest[key] = torch.empty(md.size, dtype=md.properties.dtype, device=local(param).device)
    reader = _Reader(metadata, read_file, dest)
    try:
        with _one_process_quiet():
            dcp_load(dest, storage_reader=reader, no_dist=not _distributed())
    except CheckpointException as exc:
        raise _unwrapped(exc) from None
    for name, piece in reader.adopted.items():  # the empty destinations, never written, are freed untouched
        dest[name] = _in_layout_of(dest[name], piece)
    return dest


def _in_layout_of(like: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (this process's whole part of a tensor) as the tensor ``like`` is: a DTensor of the same mesh and
    placements for a DTensor, else itself."""
    if not is_dtensor(like):
        return piece
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        piece,
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def apply(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: Mapping[str, torch.Tensor],
    rest: Mapping[str, Any],
    strict: bool = True,
) -> None:
    """Put the loaded tensors and the optimizer's other values into the live model and optimizer (``strict=False``: an
    adapter checkpoint's, which lack the frozen parameters; check_layout checked every other name)."""
    weights = {k[len(MODEL) :]: v for k, v in tensors.items() if k.startswith(MODEL)}
    optim = {**rest, **{k[len(OPTIM) :]: v for k, v in tensors.items() if k.startswith(OPTIM)}}
    options = _OPTIONS if strict else StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim, options=options)  # type: ignore[arg-type]


def deal_out(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    strict: bool = True,
) -> None:
    """Put whole tensors (a gathered checkpoint's, which every process holds) into this run's shards (FSDP's DTensors).

    The optimizer's state is keyed by parameter index as torch's ``state_dict`` keys it;
    here by parameter name, as DCP's full state dicts are. Call after every check: this
    changes the live model and optimizer.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in optimizer_state["param_groups"] for i in g["params"]]
    fqn = {str(i): names[id(p)] for i, p in zip(saved_ids, params)}
    state = {fqn[str(k)]: v for k, v in optimizer_state["state"].items()}
    groups = [{**g, "params": [fqn[str(i)] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, dict(weights), options=options)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=options)
