"""The model of a checkpoint as one ``model.safetensors``: offline, without a process group, verified first.

Owned here: :func:`checkpoint_weights` (the whole weights of a gathered or sharded
checkpoint, each file verified as it is read, the sharded pieces put together by
the offsets its ``tensors.json`` records) and :func:`export_checkpoint`, which
writes them; the ``trainfold export`` and ``trainfold diff`` commands use them.
Accelerate's ``merge-weights`` is the counterpart for its own FSDP checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from trainfold.checkpoint import safetensors as _safetensors
from trainfold.checkpoint.manifest import (
    DEEPSPEED,
    FORMAT,
    SHARDED,
    parse_tensors,
    read_manifest,
    read_verified,
)
from trainfold.checkpoint.root import resolve
from trainfold.errors import CheckpointError

__all__ = ["checkpoint_weights", "export_checkpoint"]


def checkpoint_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's weights of a checkpoint (a folder, or a root: its newest), whole, by parameter name, on the CPU.

    Every file read is verified against the manifest as it is read. A sharded
    checkpoint's pieces (any number of processes, any mesh) are put together by
    the offsets its ``tensors.json`` records. Needs no process group and loads no model.

    Raises:
        CheckpointError: not a checkpoint, a damaged one, or a DeepSpeed checkpoint (its
            ZeRO partitions are not merged here: DeepSpeed's ``zero_to_fp32.py`` does it).

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> _ = save_checkpoint(ctx, root, state)
        >>> sorted(checkpoint_weights(root))
        ['bias', 'weight']

    .. versionadded:: 0.3.0
    """
    folder = resolve(path)
    manifest = read_manifest(folder)
    fmt = manifest["format"]
    if fmt == FORMAT:
        data = read_verified(folder, manifest, ["model.safetensors"])["model.safetensors"]
        return {k: v.clone() for k, v in parse_tensors(folder, "model.safetensors", data).items()}
    if fmt == SHARDED:
        return _assembled(folder, manifest)
    if fmt == DEEPSPEED:
        raise CheckpointError(
            f"{folder} is a DeepSpeed checkpoint: its ZeRO partitions are not merged by trainfold; run DeepSpeed's "
            "zero_to_fp32.py on the engine files, or load it under DeepSpeed and save the model from there."
        )
    raise CheckpointError(f"{folder} has format {fmt}, which this trainfold cannot export.")


def _assembled(folder: Path, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    from trainfold.checkpoint.formats import (
        dcp as _sharded,  # torch.distributed.checkpoint's metadata classes: no process group is made
    )

    files = read_verified(folder, manifest, [_sharded.METADATA])
    metadata = _sharded.parse_metadata(folder, files[_sharded.METADATA], manifest["world_size"])
    read: dict[str, Mapping[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for index, (file, key) in metadata.storage_data.items():
        if not index.fqn.startswith(_sharded.MODEL):
            continue
        md = metadata.state_dict_metadata[index.fqn]
        whole = out.get(index.fqn)
        if whole is None:
            whole = out[index.fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)  # type: ignore[union-attr]
        if file not in read:
            read[file] = parse_tensors(folder, file, read_verified(folder, manifest, [file])[file])
        piece = read[file].get(key)
        offsets = tuple(index.offset or ())
        if piece is None:
            raise CheckpointError(f"{folder}: {file} does not hold the piece {key!r} its {_sharded.METADATA} names.")
        target = whole[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))] if offsets else whole
        if tuple(target.shape) != tuple(piece.shape):
            raise CheckpointError(f"{folder}: the piece {key!r} of {index.fqn!r} does not fit where {_sharded.METADATA} puts it.")
        target.copy_(piece)
    return {k[len(_sharded.MODEL):]: v for k, v in out.items()}


def export_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model's weights of a checkpoint (see :func:`checkpoint_weights`) to ``out``, one safetensors file.

    Raises:
        FileExistsError: ``out`` exists (nothing is overwritten).
        CheckpointError: as :func:`checkpoint_weights`.

    .. versionadded:: 0.3.0
    """
    target = Path(out)
    if target.exists():
        raise FileExistsError(f"{target} exists: export writes a new file; remove it or name another.")
    weights = checkpoint_weights(path)
    tmp = target.with_name(f".{target.name}.tmp")
    _safetensors.write(tmp, weights)
    os.replace(tmp, target)
    return target
