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

from trainfold._src.base.io import atomic_write
from trainfold._src.checkpoint import safetensors as _safetensors
from trainfold._src.checkpoint.formats import by_code
from trainfold._src.checkpoint.manifest import read_manifest
from trainfold._src.checkpoint.root import resolve

__all__ = ["checkpoint_weights", "export_checkpoint"]


def checkpoint_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's weights of a checkpoint (a folder, or a root: its newest), whole, by parameter name, on the CPU.

    Every file read is verified against the manifest as it is read. A sharded
    checkpoint's pieces (any number of processes, any mesh) are put together by
    the offsets its ``tensors.json`` records; a DeepSpeed checkpoint's ZeRO partitions
    (stages 1 to 3) as DeepSpeed's ``zero_to_fp32.py`` does, from files read by torch's
    restricted unpickler (nothing in them runs; needs deepspeed installed for its record
    classes). Needs no process group and loads no model.

    Args:
        path: a checkpoint folder, or a root (its newest checkpoint).

    Returns:
        The weights by parameter name (a DeepSpeed checkpoint's in fp32, its master weights).

    Raises:
        CheckpointError: not a checkpoint, or a damaged one (a file of another size or
            digest, ZeRO partitions that do not add up).

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> _ = save_checkpoint(ctx, root, state)
        >>> sorted(checkpoint_weights(root))
        ['bias', 'weight']
    """
    stored = resolve(path)
    manifest = read_manifest(stored)
    return by_code(manifest["format"]).weights(stored, manifest)


def export_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      transformers_config: str | os.PathLike[str] | None = None) -> Path:
    """Write the model's weights of a checkpoint (see :func:`checkpoint_weights`) to ``out``.

    Offline and without a process group: every file is verified as it is read, and the
    result is written under a fresh name next to ``out`` (created exclusively, never
    through a link) and renamed into place, so an interrupted or failed export (a full
    disk, an exception) leaves nothing behind, under that name or another.

    Args:
        path: a checkpoint folder, or a root (its newest checkpoint); any format
            (gathered, sharded over any number of processes or mesh, DeepSpeed ZeRO).
        out: the file to write (one ``model.safetensors``), or with ``transformers_config``
            the folder to write. It must not exist.
        transformers_config: a Hugging Face model folder (at least its ``config.json``, whose
            ``architectures`` names the model class): ``out`` becomes a ``save_pretrained``
            folder that ``from_pretrained`` loads, with the checkpoint's weights, the config,
            and the folder's other files (a tokenizer, a generation config) copied. Needs
            ``transformers``; nothing is downloaded.

    Returns:
        The path written.

    Raises:
        FileExistsError: ``out`` exists (nothing is overwritten).
        CheckpointError: as :func:`checkpoint_weights`; or the weights do not fit
            ``transformers_config``'s model (the names missing and unexpected, the shapes that differ).
        ImportError: ``transformers_config`` given and transformers is not installed.

    Examples:
        >>> import tempfile, os
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> _ = save_checkpoint(ctx, root, state)
        >>> export_checkpoint(root, os.path.join(root, "model.safetensors")).name
        'model.safetensors'
    """
    target = Path(out)
    if target.exists():
        raise FileExistsError(f"{target} exists: export writes a new {'folder' if transformers_config else 'file'}; remove it or name another.")
    weights = checkpoint_weights(path)
    if transformers_config is not None:
        from trainfold._src.checkpoint.pretrained import write_pretrained

        return write_pretrained(weights, Path(transformers_config), target)
    # a fresh name beside the target, created exclusively, removed on any error or exception (a full disk, SIGINT,
    # SIGTERM through the command line's handler): a name planted as a link is never written through
    def write(tmp: Path) -> None:
        _safetensors.write(tmp, weights)

    return atomic_write(target, write)
