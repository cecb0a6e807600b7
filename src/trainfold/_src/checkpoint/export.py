"""The model of a checkpoint as one ``model.safetensors``: offline, without a process group, verified first.

Owned here: :func:`checkpoint_weights` (the whole weights of a gathered or sharded
checkpoint, each file verified as it is read: each format's ``weights``; an adapter
checkpoint's with its base, ``adapters.py``) and :func:`export_checkpoint`, which writes
them (or an adapter checkpoint's adapters alone); the ``trainfold export`` and
``trainfold diff`` commands use them. Accelerate's ``merge-weights`` is the counterpart
for its own FSDP checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from typing import Any

from trainfold._src.base.io import atomic_write, staged_beside, write_durably
from trainfold._src.checkpoint import adapters as _adapters
from trainfold._src.checkpoint import safetensors as _safetensors
from trainfold._src.checkpoint.encoding import decode_frozen
from trainfold._src.checkpoint.formats import by_code
from trainfold._src.checkpoint.manifest import parse_json, read_manifest, read_verified
from trainfold._src.checkpoint.root import resolve
from trainfold._src.checkpoint.storage.protocol import Stored
from trainfold._src.core.runstate import FrozenTensor
from trainfold.errors import CheckpointError

__all__ = ["checkpoint_weights", "export_checkpoint"]


def checkpoint_weights(
    path: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None
) -> dict[str, torch.Tensor]:
    """The model's weights of a checkpoint (a folder, or a root: its newest), whole, by parameter name, on the CPU.

    Every file read is verified against the manifest as it is read. A sharded
    checkpoint's pieces (any number of processes, any mesh) are put together by
    the offsets its ``tensors.json`` records; a DeepSpeed checkpoint's ZeRO partitions
    (stages 1 to 3) as DeepSpeed's ``zero_to_fp32.py`` does, from files read by torch's
    restricted unpickler (nothing in them runs; needs deepspeed installed for its record
    classes). Needs no process group and loads no model.

    An adapter checkpoint (a model with frozen parameters, see the guide "Fine-tuning
    with adapters") holds what trained, not its base: without ``base`` these are the
    tensors it holds (the trainable parameters and the buffers); with ``base`` the whole
    model, its frozen parameters read from the base and each checked against the
    checkpoint's fingerprint, and for a PEFT model its LoRA adapters merged into their
    layers (``W + lora_alpha / r * B @ A``), under the names the base model has.

    Args:
        path: a checkpoint folder, or a root (its newest checkpoint).
        base: an adapter checkpoint's base: a safetensors file or a ``save_pretrained``
            folder (its ``*.safetensors``).

    Returns:
        The weights by parameter name (a DeepSpeed checkpoint's in fp32, its master weights).

    Raises:
        CheckpointError: not a checkpoint, or a damaged one (a file of another size or
            digest, ZeRO partitions that do not add up); ``base`` given for a checkpoint that
            holds every parameter; a base that is not the one the run trained on (naming the
            tensor); an adapter the merge does not do (DoRA, per-module ranks: merge with peft).

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
    held = by_code(manifest["format"]).weights(stored, manifest)
    if base is None:
        return held
    frozen, peft = _adapter_entries(stored, manifest)
    if not frozen:
        raise CheckpointError(
            f"{stored} holds every parameter of its model: a base is for an adapter checkpoint, one that "
            "records its frozen parameters by fingerprint. Leave base out."
        )
    return _adapters.whole_weights(stored, held, frozen, peft, Path(base))


def _adapter_entries(stored: Stored, manifest: Any) -> tuple[tuple[FrozenTensor, ...], Any]:
    """An adapter checkpoint's fingerprint and PEFT record (none, None for a checkpoint that holds every parameter)."""
    if "state.json" not in manifest.get("files", {}):  # a DeepSpeed checkpoint's engine files hold every parameter
        return (), None
    doc = parse_json(stored, "state.json", read_verified(stored, manifest, ["state.json"])["state.json"])
    try:
        frozen = decode_frozen(doc.get("frozen", []) if isinstance(doc, dict) else None)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{stored}: its frozen entries are damaged ({exc}): refused.") from None
    return frozen, doc.get("peft")


def export_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    transformers_config: str | os.PathLike[str] | None = None,
    base: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the model's weights of a checkpoint (see :func:`checkpoint_weights`) to ``out``.

    Offline and without a process group: every file is verified as it is read, and the
    result is written under a fresh name next to ``out`` (created exclusively, never
    through a link) and renamed into place, so an interrupted or failed export (a full
    disk, an exception) leaves nothing behind, under that name or another.

    An adapter checkpoint without ``base`` exports its adapters alone: for a PEFT model,
    ``out`` is a folder that ``PeftModel.from_pretrained(base_model, out)`` loads
    (``adapter_model.safetensors`` and ``adapter_config.json``, as PEFT writes them);
    for another model, ``out`` is one safetensors file of the tensors it holds. With
    ``base``, the whole model (merged, for a PEFT model's LoRA adapters), as any checkpoint's.

    Args:
        path: a checkpoint folder, or a root (its newest checkpoint); any format
            (gathered, sharded over any number of processes or mesh, DeepSpeed ZeRO).
        out: the file to write (one ``model.safetensors``), or with ``transformers_config``
            (or a PEFT model's adapters) the folder to write. It must not exist.
        transformers_config: a Hugging Face model folder (at least its ``config.json``, whose
            ``architectures`` names the model class): ``out`` becomes a ``save_pretrained``
            folder that ``from_pretrained`` loads, with the checkpoint's weights, the config,
            and the folder's other files (a tokenizer, a generation config) copied. Needs
            ``transformers``; nothing is downloaded.
        base: an adapter checkpoint's base (a safetensors file or a ``save_pretrained``
            folder), checked against the checkpoint's fingerprint: ``out`` gets the whole model.

    Returns:
        The path written.

    Raises:
        FileExistsError: ``out`` exists (nothing is overwritten).
        CheckpointError: as :func:`checkpoint_weights`; or the weights do not fit
            ``transformers_config``'s model (the names missing and unexpected, the shapes that
            differ; an adapter checkpoint without ``base`` always).
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
        raise FileExistsError(
            f"{target} exists: export writes a new {'folder' if transformers_config else 'file'}; remove it or name another."
        )
    if base is None:
        stored = resolve(path)
        manifest = read_manifest(stored)
        frozen, peft = _adapter_entries(stored, manifest)
        if frozen and transformers_config is not None:
            raise CheckpointError(
                f"{stored} is an adapter checkpoint: it holds what trained, not its base. Give the base "
                "(--base, a safetensors file or save_pretrained folder) for a whole model."
            )
        if frozen and peft is not None:
            return _write_peft(stored, manifest, target, peft)
    weights = checkpoint_weights(path, base=base)
    if transformers_config is not None:
        from trainfold._src.checkpoint.pretrained import write_pretrained

        return write_pretrained(weights, Path(transformers_config), target)

    # a fresh name beside the target, created exclusively, removed on any error or exception (a full disk, SIGINT,
    # SIGTERM through the command line's handler): a name planted as a link is never written through
    def write(tmp: Path) -> None:
        _safetensors.write(tmp, weights)

    return atomic_write(target, write)


def _write_peft(stored: Stored, manifest: Any, target: Path, peft: Any) -> Path:
    """A PEFT model's adapters as the folder ``PeftModel.from_pretrained`` loads, renamed into place when whole."""
    if target.suffix == ".safetensors":
        raise CheckpointError(
            f"{stored} holds a PEFT model's adapters, which export as a folder (adapter_model.safetensors and "
            f"adapter_config.json, what PeftModel.from_pretrained loads): name a folder, not {target.name}."
        )
    held = by_code(manifest["format"]).weights(stored, manifest)
    tensors, config = _adapters.peft_files(stored, held, peft)
    target.parent.mkdir(parents=True, exist_ok=True)
    with staged_beside(target, folder=True) as staging:
        _safetensors.write(staging / "adapter_model.safetensors", tensors)
        write_durably(staging / "adapter_config.json", [config])
        os.replace(staging, target)
    return target
