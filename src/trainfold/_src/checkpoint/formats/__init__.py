"""Checkpoint formats: what each process captures for a save, and how a checkpoint of that format is read, checked and put back.

One interface, three implementations, chosen once per save (:func:`for_save`)
and once per load (:func:`for_load`), so that ``save_checkpoint`` and
``load_checkpoint`` hold no engine branches:

- :class:`Gathered` (format 1): the model gathered into the main process's
  ``model.safetensors``, the optimizer into the shared ``state.*`` files; it
  resumes on any number of replicas (DDP, one process);
- :class:`Sharded` (format 2): every process writes its own pieces of the model and
  optimizer (``dcp.py``, torch.distributed.checkpoint on trainfold's files); it
  resumes on any number of processes;
- :class:`DeepSpeedFormat` (format 3): the engine's own files (each process its ZeRO
  partition), read back through torch's restricted unpickler (``engine_files.py``).

A format says *what the bytes are*; where they go, how a save is committed and
found again is a storage's (``checkpoint/storage``), which no format knows.
Every ``load`` reads and checks everything before it changes anything, and every
process calls it (the sharded and DeepSpeed loads are collectives).
"""

from __future__ import annotations

from typing import Any, Mapping

from trainfold._src.backend.engine import is_deepspeed
from trainfold._src.checkpoint.formats.common import Format
from trainfold._src.checkpoint.formats.deepspeed import DeepSpeedFormat
from trainfold._src.checkpoint.formats.gathered import Gathered
from trainfold._src.checkpoint.formats.sharded import Sharded
from trainfold._src.checkpoint.manifest import DEEPSPEED, FORMAT, SHARDED
from trainfold._src.checkpoint.storage.protocol import Stored
from trainfold._src.core.context import Context
from trainfold.errors import CheckpointError

__all__ = ["DeepSpeedFormat", "Format", "Gathered", "Sharded", "by_code", "for_load", "for_save"]


def for_save(ctx: Context, sharded: bool) -> Format:
    """The format of a save: DeepSpeed's under DeepSpeed, else sharded or gathered as decided."""
    if is_deepspeed(ctx.accelerator):
        return DeepSpeedFormat()
    return Sharded() if sharded else Gathered()


def for_load(ctx: Context, folder: Stored, manifest: Mapping[str, Any]) -> Format:
    """The format of a checkpoint, refused where this run cannot take it (DeepSpeed on one side only).

    Raises:
        CheckpointError: DeepSpeed on one side only.
    """
    code = manifest["format"]
    if (code == DEEPSPEED) != is_deepspeed(ctx.accelerator):
        raise CheckpointError(
            f"{folder} was written by a run under DeepSpeed and this run does not use it: its model and optimizer are "
            "DeepSpeed's engine files. Resume it under the same DeepSpeed config."
            if code == DEEPSPEED
            else f"{folder} was written by a run without DeepSpeed and this run uses it: resume it without DeepSpeed (then "
            "save there under DeepSpeed to continue with it)."
        )
    return by_code(code)


def by_code(code: int) -> Format:
    """The format a manifest names (``read_manifest`` refused any other)."""
    formats: dict[int, Format] = {FORMAT: Gathered(), SHARDED: Sharded(), DEEPSPEED: DeepSpeedFormat()}
    return formats[code]
