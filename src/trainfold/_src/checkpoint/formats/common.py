"""What the three checkpoint formats share: the interface, what a save captures, and how a loaded state is finished."""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any, Mapping, Protocol

import attrs
import torch

from trainfold._src.backend.engine import is_dtensor, local, unwrap
from trainfold._src.backend.mesh import data_layout
from trainfold._src.base import rng as _rng
from trainfold._src.base.checks import user_stacklevel
from trainfold._src.base.io import ALIGNMENT, release_pages
from trainfold._src.base.types import read_only
from trainfold._src.checkpoint.manifest import data_ranks
from trainfold._src.checkpoint.storage.protocol import Staging, Stored
from trainfold._src.core.context import Context
from trainfold._src.core.cursor import Resume
from trainfold._src.core.modes import optimizer_modes
from trainfold._src.core.runstate import FrozenTensor, RunState
from trainfold._src.core.state import TrainState
from trainfold.errors import CheckpointError


@attrs.frozen(eq=False)
class Captured:
    """What a format read from the live state for one save (copied to host memory for a background save)."""

    #: the run state the shared and per-process files encode
    run: RunState = attrs.field(repr=False)
    #: the parameters whose finiteness the manifest records (this process's part): what training changes, not the
    #: buffers, which may hold infinities by design (a causal mask)
    weights: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    #: files the format writes as they are (DeepSpeed's engine files), by name
    files: Mapping[str, bytes] = attrs.field(default=MappingProxyType({}), converter=read_only, repr=False)
    #: a sharded checkpoint's tensors, which the format's ``write_pieces`` writes; None otherwise
    shards: Mapping[str, torch.Tensor] | None = attrs.field(default=None, repr=False)


class Format(Protocol):
    """A checkpoint format: its number in the manifest, what a save captures and writes, how a load reads and puts back."""

    #: the format's number in the manifest
    code: int
    #: whether each process holds its own part of the weights (shards, ZeRO partitions), not a copy of the whole
    partitioned: bool

    def capture(
        self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool, frozen: tuple[FrozenTensor, ...] = ()
    ) -> Captured:
        """Read what this process saves (every process calls it; ``copied`` for a background save). ``frozen``: the
        parameters an adapter checkpoint records by fingerprint instead of holding (``checkpoint/frozen.py``)."""
        ...

    def write_pieces(
        self, staging: Staging, shards: Mapping[str, torch.Tensor], rank: int, group: Any
    ) -> dict[str, dict[str, Any]]:
        """Write the pieces :meth:`capture` put in ``Captured.shards`` (a collective); return their manifest entries."""
        ...

    def load(self, ctx: Context, stored: Stored, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """Read, verify and check ``stored``, then put it into ``state``'s live objects; return the saved state."""
        ...

    def weights(self, stored: Stored, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The model's whole weights, by parameter name, on the CPU, read offline (no process group, no model)."""
        ...


def without(
    tensors: Mapping[str, torch.Tensor], frozen: tuple[FrozenTensor, ...], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``tensors`` but the frozen parameters an adapter checkpoint records by fingerprint (keyed ``prefix`` + name)."""
    dropped = {prefix + f.name for f in frozen}
    return {k: v for k, v in tensors.items() if k not in dropped}


def parameters_of(
    tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``tensors`` but ``model``'s buffers (keyed ``prefix`` + name): the trained values a save judges finite."""
    buffers = {prefix + name for name, _ in model.named_buffers()}
    return {k: v for k, v in tensors.items() if k not in buffers}


def live_fingerprint(ctx: Context, state: TrainState) -> tuple[FrozenTensor, ...]:
    """The fingerprints of the live model's frozen parameters (none: nothing frozen). Every process calls it before a load
    reads anything, in the same order (a sharded tensor is gathered); each tensor is hashed once per Context."""
    from trainfold._src.checkpoint.frozen import model_fingerprint

    return model_fingerprint(ctx, unwrap(ctx.accelerator, state.model))


def check_adapters(folder: object, run: RunState, state: TrainState, live: tuple[FrozenTensor, ...]) -> None:
    """An adapter checkpoint (``run.frozen``) loads only onto a model that freezes the same parameters, of the same base.

    Raises:
        CheckpointError: a parameter frozen on one side only, of another shape or dtype, or of other values.
    """
    if not run.frozen:
        return
    from trainfold._src.checkpoint.frozen import check_base, check_frozen_alike

    check_frozen_alike(folder, run.frozen, unwrap(state.accelerator, state.model))
    check_base(folder, run.frozen, live)


def to_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` in host memory (a DTensor's local shard copied, its layout kept): what a background save writes.

    A DTensor already on the CPU is copied once, its shard into a new DTensor of the same layout; torch's
    ``_create_cpu_state_dict``, which the rest goes through, deep-copies such a DTensor (its data twice) before
    copying the data into it again: three copies, most of the time a background save keeps the caller.
    """
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    tensors = dict(tensors)
    on_cpu = {k: t for k, t in tensors.items() if is_dtensor(t) and t.device.type == "cpu" and t.dim()}
    rest = {k: t for k, t in tensors.items() if k not in on_cpu}
    copies = _copy_state_dict(rest, _create_cpu_state_dict(rest)) if rest else {}
    for key, dtensor in on_cpu.items():
        local = dtensor._local_tensor.detach()  # type: ignore[attr-defined]
        host = torch.empty_like(local)
        host.copy_(local)
        make: Any = type(dtensor)  # DTensor(local, spec, *, requires_grad): the layout's spec kept, the shard ours
        copies[key] = make(host, dtensor._spec, requires_grad=False)  # type: ignore[attr-defined]
    return {k: copies[k] for k in tensors}


def adopt_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> int:
    """Make ``model``'s own tensors the loaded ``weights`` (views of the verified file buffers) where one can stand for
    the other, instead of copying them in; return how many were adopted. Call it once everything is checked, before
    the model's ``load_state_dict`` (whose copy of a tensor onto itself is then a no-op, while its hooks still run).

    A parameter or buffer keeps its identity (the optimizer, DDP and the user's references see it loaded); its
    memory becomes the buffer's, so the load costs no copy, and a model allocated without values
    (``to_empty``) never touches the memory it was given. A tensor is adopted only where nothing can tell the
    difference: a plain tensor on both sides (no DTensor, no subclass) on the same device, of the same dtype and
    shape, both contiguous, not 0-d, at a 64-byte boundary as torch would allocate it, in a module that loads its
    state in torch's own way (no ``load_state_dict`` pre-hook in the model, no ``_load_from_state_dict`` of its
    own). No two of them share a byte (``safetensors.index`` refuses a file whose tensors overlap), and a tensor tied to
    another (one object under two names) is adopted once. Everything else is copied in by ``load_state_dict``.
    """
    modules = list(model.named_modules(remove_duplicate=False))
    if any(module._load_state_dict_pre_hooks for _, module in modules):
        return 0  # a hook may change what a name loads
    adopted: set[int] = set()
    for prefix, module in modules:
        if type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict:
            continue
        persistent = [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, live in [*module._parameters.items(), *persistent]:
            piece = weights.get(f"{prefix}.{name}" if prefix else name)
            if live is None or piece is None or id(live) in adopted or not _can_stand_for(piece, live):
                continue
            live.data = piece
            adopted.add(id(live))
    return len(adopted)


def _can_stand_for(piece: torch.Tensor, live: torch.Tensor) -> bool:
    return (
        type(piece) is torch.Tensor
        and type(live) in (torch.Tensor, torch.nn.Parameter)
        and not piece.requires_grad
        and piece.dim() > 0
        and piece.shape == live.shape
        and piece.dtype == live.dtype
        and piece.device == live.device
        and piece.is_contiguous()
        and live.is_contiguous()
        and piece.data_ptr() % ALIGNMENT == 0
    )


def release_copied(
    tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Once the loaded ``tensors`` are in the live model and optimizer: hand back to the system the pages of those
    that were copied in, and keep those that became the live tensors (weights :func:`adopt_weights` adopted, an
    optimizer's state, which torch's ``load_state_dict`` keeps as it is given).

    An adopted tensor is a view of its verified file's buffer, which any piece of the same file kept alive holds
    whole: without this, the bytes of every copied piece would stay resident beside the live ones. A page that a live
    tensor of the model or the optimizer (its state, its groups' settings) reads is never released.
    """
    live = [local(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    for per_param in optimizer.state.values():
        live += [local(v) for v in per_param.values() if isinstance(v, torch.Tensor)]
    for group in optimizer.param_groups:
        live += [local(v) for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor)]
    in_use = [(t.data_ptr(), t.numel() * t.element_size()) for t in live if t.device.type == "cpu" and t.numel()]
    for tensor in tensors.values():
        piece = local(tensor)
        if piece.device.type == "cpu" and piece.is_contiguous():
            release_pages(piece.data_ptr(), piece.numel() * piece.element_size(), keep=in_use)


def loaded(state: TrainState, resume: Resume) -> TrainState:
    """The state a load returns: back in the run's train mode, at the saved position, its stop carried on only if the run finished."""
    # A schedule-free optimizer was saved in eval mode (save_checkpoint switches it): back to the mode the run was in.
    modes = optimizer_modes(state.optimizer)
    if modes is not None and state.model.training:
        modes.train()
    # A stop that ended only the saving invocation (a budget, a signal) is not carried on; a finished run stays stopped.
    return attrs.evolve(
        state, cursor=resume, stop=state.stop if state.stop is not None and state.stop.finished else None
    )


def check_accumulation(ctx: Context, folder: Any, saved_steps: int) -> None:
    if saved_steps != ctx.gradient_accumulation_steps:
        raise CheckpointError(
            f"{folder} was saved with gradient_accumulation_steps={saved_steps}, this run "
            f"uses {ctx.gradient_accumulation_steps}: the accumulation phase and the updates would not line up. "
            "Resume with the same Accelerator settings."
        )


def saved_elsewhere(manifest: Mapping[str, Any], acc: Any) -> bool:
    """Whether a checkpoint was saved by another layout of the data than this run's: another number of processes, or
    as many grouped otherwise (tensor parallelism's processes share a data-parallel rank). Then the processes' own files
    do not map one to one onto this run's, and the epoch continues by its position in samples."""
    elastic = manifest["world_size"] != acc.num_processes or data_ranks(manifest) != data_layout(acc).size
    return bool(elastic)  # sync: none: ints


def layout_words(processes: int, ranks: int) -> str:
    """``"4 processes"`` (``"1 process"``), or ``"4 processes (2 data-parallel ranks)"`` where tensor parallelism groups them."""
    return f"{processes} process{'es' if processes != 1 else ''}" + (
        "" if ranks == processes else f" ({ranks} data-parallel ranks)"
    )


def elastic_resume(
    folder: Any, run: RunState, resume: Resume, saved_steps: int, manifest: Mapping[str, Any], acc: Any
) -> tuple[RunState, Resume]:
    """A checkpoint of another layout (:func:`saved_elsewhere`), continued on this run's: checked, at a new accumulation
    group, by its position in samples.

    The epoch's running train sums were each process's own and cannot be dealt out
    anew: they restart empty from the batch the run stands at (``RunningSums.started_at``),
    with a warning: the epoch's train values are then the means of the batches since.
    """
    saved = layout_words(manifest["world_size"], data_ranks(manifest))
    now = layout_words(acc.num_processes, data_layout(acc).size)
    _check_elastic(folder, run, resume, saved_steps, saved, now, grouped=data_ranks(manifest) != manifest["world_size"])
    run = attrs.evolve(run, accelerate_step=0)  # at an update: a new accumulation group begins
    if run.values.batch_in_epoch > 0:
        warnings.warn(
            f"load_checkpoint: {folder} was saved by {saved} in the middle of epoch {run.values.epoch + 1}; this run "
            f"has {now}. The model, optimizer and data position continue exactly, but the epoch's running "
            "train sums were each process's own and cannot be dealt out anew, so they restart empty: this epoch's "
            "train_loss (and train aux values) will be the means of the batches trained from here, and log_every's "
            "next report of those since here; the next epochs' are exact.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        sums = run.values.sums.reset(acc.device, started_at=run.values.batch_in_epoch)
        run = attrs.evolve(run, values=attrs.evolve(run.values, sums=sums))
    return run, attrs.evolve(resume, elastic=True)


def with_peers(folder: Stored, manifest: Mapping[str, Any], resume: Resume, elastic: bool) -> Resume:
    """``resume`` with every saving process's position, where the rest of an epoch over a stream is dealt anew: on
    another number of processes, or continuing an epoch already dealt anew (each process reads the whole rest, and
    the batches every process had read ahead come first)."""
    from trainfold._src.checkpoint.encoding import decode_positions
    from trainfold._src.checkpoint.manifest import rank_files, read_verified

    position = resume.position
    if position is None or position.stream is None or not (elastic or position.stream.holder == "redealt"):
        return resume
    world = int(manifest["world_size"])
    files = read_verified(folder, manifest, [name for rank in range(world) for name in rank_files(rank)])
    return attrs.evolve(resume, peers=decode_positions(folder, files, world))


def _check_elastic(
    folder: Any, run: Any, resume: Resume, saved_steps: int, saved: str, now: str, grouped: bool
) -> None:
    """A checkpoint of the ``saved`` layout continues on the ``now`` one only at an optimizer update, and inside an epoch
    only with its position in samples, or over a stream whose every process's state says where its part stood (read in
    the process: not by a ``StatefulDataLoader``'s workers) and how it was dealt, or that process 0 dispatched."""
    if run.accelerate_step % saved_steps or run.grads:
        raise CheckpointError(
            f"{folder} was saved by {saved} in the middle of an accumulation group (their partial gradients "
            f"cannot be dealt out to {now}): resume it on {saved}, or from a checkpoint at an optimizer update "
            "(checkpoint_every saves at updates)."
        )
    position = resume.position
    if run.values.batch_in_epoch == 0 or (position is not None and position.samples_done is not None):
        return
    if position is not None and position.dispatched and (position.stream is not None or not position.read_ahead[0]):
        return  # process 0's stream state is the whole stream's: it goes on from there, dealt to this run's processes
    stream = position.stream if position is not None else None
    if (
        stream is not None
        and stream.holder != "loader"
        and position is not None
        and position.dealt is not None
        and not grouped
    ):
        return  # every saving process's state and batch read ahead are in the checkpoint: the rest is dealt anew (streams.Redealt)
    if position is not None and position.dispatched:
        why = (
            "process 0 read it and dispatched it, but it cannot say where it stood (no state_dict()), and the part read "
            f"again would be counted in batches of {saved}: give the dataset state_dict() and load_state_dict() for a "
            "stream that resumes on any number of processes"
        )
    elif stream is not None and stream.holder == "loader":
        why = (
            f"each process's loader ({stream.kind}, {stream.workers} worker(s)) saved a state of its own, which "
            "covers that process's part as its workers read it: such states cannot be dealt out anew. A stream read by "
            "a plain DataLoader with num_workers=0, or one that process 0 reads and dispatches "
            "(DataLoaderConfiguration(dispatch_batches=True)), resumes on any number of processes"
        )
    elif stream is not None and position is not None and position.dealt is None:
        why = (
            "each process read a part of the stream, and the checkpoint does not say how the stream was split (the "
            "loader was prepared without ctx.prepare_loaders, which keeps the dataset you gave, or the checkpoint is an "
            "older trainfold's): prepare the loader with ctx.prepare_loaders for a stream that resumes on any number "
            "of processes"
        )
    elif stream is not None:
        why = (
            "tensor parallelism grouped the saving processes, and trainfold deals a stream anew only where each process "
            "is a data-parallel rank of its own"
        )
    else:
        why = (
            "its position in samples is unknown: the stream had no state that says where it stood (no state_dict(), "
            "or a state that leaves something out, such as a datasets shuffle buffer), so it is read again, which "
            "only the same number of processes can do"
        )
    raise CheckpointError(
        f"{folder} was saved by {saved} in the middle of an epoch over a stream, and this run has {now}: {why}. "
        f"Resume it on {saved}, or from a checkpoint between epochs."
    )
