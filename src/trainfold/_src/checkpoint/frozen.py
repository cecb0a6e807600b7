"""Frozen parameters: what an adapter checkpoint records instead of them, and the check that ties a resume to its base.

A model with frozen parameters (``requires_grad=False``: a pretrained base under
LoRA adapters, a frozen backbone or embedding) changes only in the rest. An
adapter checkpoint holds the rest (the trainable parameters and every buffer,
with the optimizer and the run's state) and records each frozen parameter by its
fingerprint (:class:`~trainfold._src.core.runstate.FrozenTensor`): name, shape,
dtype and the XXH3-128 digest of its bytes. The digest is of the whole tensor,
gathered from its shards one at a time, so it does not depend on how a run
shards it. A load checks the live model's tensors against it before anything changes.

Hashing a base costs a pass over its bytes at every save and load (about 10 GB/s on a
CPU core), so that no way of writing it goes unseen: an in-place change bumps a
tensor's version counter, but a write through ``p.data`` (PEFT's ``unmerge``) or a
numpy view bumps none. A sharded tensor's whole digest needs its shards gathered:
each process hashes its own shard, and the whole tensor is gathered and hashed again
only when a shard's bytes changed on some process (``ctx.runtime`` remembers the
digests, with the shards' bytes they were taken of).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from trainfold._src.backend.engine import is_dtensor, local
from trainfold._src.checkpoint import digest as _digest
from trainfold._src.checkpoint import safetensors as _safetensors
from trainfold._src.core.context import Context
from trainfold._src.distributed.control import max_over_processes
from trainfold._src.core.runstate import FrozenTensor
from trainfold.errors import CheckpointError


def frozen_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names of ``model``'s frozen parameters (every name of a tied one), in state-dict order."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [name for name in model.state_dict(keep_vars=True) if name in params and not params[name].requires_grad]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(ctx: Context, model: torch.nn.Module, names: Iterable[str]) -> tuple[FrozenTensor, ...]:
    """The fingerprints of ``model``'s tensors ``names`` (every process calls it, in the same order: a sharded
    tensor is gathered, one at a time).

    Raises:
        ValueError: a tensor on the meta device (a base whose weights were never loaded): it has no bytes to hash.
    """
    tensors = model.state_dict(keep_vars=True)
    names = list(names)
    for name in names:
        _check_loaded(name, tensors[name])
    # this process's bytes of each tensor, hashed (of a sharded one, its shard): what tells that its values changed
    stamps = {name: _stamp(tensors[name]) for name in names}
    # a whole tensor's digest is its stamp's; a sharded one's is of the gathered whole, remembered until a shard changes
    sharded = [name for name in names if is_dtensor(tensors[name])]
    known = {name: ctx.runtime.remembered_digest(name, tensors[name], stamps[name]) for name in sharded}
    changed = any(digest is None for digest in known.values())
    if sharded and ctx.accelerator.num_processes > 1:  # a gather is a collective: every process gathers, or none
        changed = bool(max_over_processes(ctx.runtime.control, int(changed)))  # sync: none: host ints, once per save
    out = []
    for name in names:
        tensor = tensors[name]
        digest = known.get(name) or stamps[name][0]
        if name in known and changed:
            digest = _digest.of(_safetensors.raw(tensor.detach().full_tensor()))
            ctx.runtime.remember_digest(name, tensor, stamps[name], digest)
        out.append(FrozenTensor(name, tuple(tensor.shape), dtype_name(tensor.dtype), digest))
    return tuple(out)


def model_fingerprint(ctx: Context, model: torch.nn.Module) -> tuple[FrozenTensor, ...]:
    """The fingerprints of all of ``model``'s frozen parameters (none: nothing is frozen); as :func:`fingerprint`."""
    names = frozen_names(model)
    return fingerprint(ctx, model, names) if names else ()


def _check_loaded(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise ValueError(
            f"the frozen parameter {name!r} is on the meta device: its weights were never loaded, so a checkpoint cannot "
            "record which base it is. Load the base's weights into the model before training."
        )


def _stamp(tensor: torch.Tensor) -> tuple[str, torch.dtype, torch.device, tuple[int, ...]]:
    """The digest of this process's bytes of ``tensor`` (its shard, for a sharded one), with its dtype, device and shape."""
    part = local(tensor)
    return (_digest.of(_safetensors.raw(part)), part.dtype, part.device, tuple(part.shape))


def check_frozen_alike(folder: object, saved: Sequence[FrozenTensor], model: torch.nn.Module) -> None:
    """The live model must freeze what the run that saved froze: the same names, shapes and dtypes (no bytes read).

    Raises:
        CheckpointError: a parameter frozen on one side only (naming it and which side), or of another shape or dtype.
    """
    live = frozen_names(model)
    on_record = {f.name for f in saved}
    if set(live) != on_record:
        name = sorted(on_record ^ set(live))[0]
        where = (
            "frozen in the checkpoint's model and not a parameter of this one"
            if name in on_record and name not in dict(model.named_parameters())
            else "frozen when it was saved and trainable in this model"
            if name in on_record
            else "frozen in this model and not in the checkpoint's"
        )
        raise CheckpointError(
            f"{folder} is an adapter checkpoint of a model with {len(on_record)} frozen parameter(s), and this model has "
            f"{len(live)}: {name!r} is {where}. Resume with the model as it was saved: the same base and adapters (a PEFT "
            "model's LoraConfig: target_modules, modules_to_save), frozen as it was (a run that unfreezes parameters resumes "
            "from a checkpoint after the unfreezing with them unfrozen, from one before it with them frozen)."
        )
    tensors = model.state_dict(keep_vars=True)
    for f in saved:
        t = tensors[f.name]
        if (tuple(t.shape), dtype_name(t.dtype)) != (f.shape, f.dtype):
            raise CheckpointError(
                f"{folder} was trained on a base whose frozen parameter {f.name!r} is {f.dtype} of shape {f.shape}; in this "
                f"model it is {dtype_name(t.dtype)} of shape {tuple(t.shape)}: another base. Load the base the run started "
                "from, in the dtype it had."
            )


def check_base(folder: object, saved: Sequence[FrozenTensor], live: Sequence[FrozenTensor]) -> None:
    """The live base's fingerprints (``live``, of the same names: :func:`check_frozen_alike` ran) must be the saved ones.

    Raises:
        CheckpointError: naming the first frozen parameter whose bytes differ.
    """
    now_by_name = {f.name: f.digest for f in live}
    for was in saved:
        if was.digest != now_by_name.get(was.name):
            raise CheckpointError(
                f"{folder} was trained on another base: the frozen parameter {was.name!r} ({was.dtype}, shape {was.shape}) "
                "has other values in this model (another model, another revision, or a base changed in place). Load the "
                "base the run started from; nothing was changed."
            )
