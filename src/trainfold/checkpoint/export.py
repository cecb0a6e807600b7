"""The model of a checkpoint as one ``model.safetensors``: offline, without a process group, verified first.

Owned here: :func:`checkpoint_weights` (the whole weights of a gathered or sharded
checkpoint, each file verified as it is read: each format's ``weights``) and
:func:`export_checkpoint`, which writes them; the ``trainfold export`` and ``trainfold diff`` commands use them.
Accelerate's ``merge-weights`` is the counterpart for its own FSDP checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainfold.checkpoint import safetensors as _safetensors
from trainfold.checkpoint.formats import by_code
from trainfold.checkpoint.manifest import read_manifest
from trainfold.checkpoint.root import resolve

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
    stored = resolve(path)
    manifest = read_manifest(stored)
    return by_code(manifest["format"]).weights(stored, manifest)


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
