"""Which processes read the same batches: the data-parallel layout of Accelerate's device mesh.

Under a ``ParallelismConfig`` with tensor (or context) parallelism, the processes
of one tensor-parallel group compute one model on one batch: Accelerate's loader
deals the batches by data-parallel rank, ``process_index // (tp × cp)``, over
``dp_replicate × dp_shard`` ranks (``accelerate.data_loader.prepare_data_loader``).
What trainfold counts per share of the data counts per data-parallel rank: the
padding of the last round (which samples of a batch are real), the samples
gathered for metrics (one copy per group), and the position a checkpoint
records. Sums over processes need nothing: a group's processes add the same
values and the same counts, so every mean, and ``normalize="tokens"``'s scale
(the processes over the summed token count), is the same ratio. Without such a
dimension, the layout is one rank per process.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

#: the mesh dimensions whose processes read the same batches, as Accelerate's loader treats them (DeepSpeed: tp only)
SAME_BATCH_DIMENSIONS = ("tp", "cp")


@attrs.frozen
class DataLayout:
    """This process's data-parallel ``rank`` of ``size``, and ``group``: the consecutive processes that share it."""

    rank: int
    size: int
    group: int


def data_layout(accelerator: Accelerator) -> DataLayout:
    """The data-parallel layout of ``accelerator``'s processes (a few look-ups: where a stage or an evaluation is built, never per batch).

    Examples:
        >>> from accelerate import Accelerator
        >>> data_layout(Accelerator(cpu=True))
        DataLayout(rank=0, size=1, group=1)
    """
    mesh = getattr(accelerator, "torch_device_mesh", None)  # Accelerate 1.10 and later, with a ParallelismConfig
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    shared = ("tp",) if accelerator.distributed_type == DistributedType.DEEPSPEED else SAME_BATCH_DIMENSIONS
    group = math.prod(mesh[d].size() for d in shared if d in names) if mesh is not None else 1
    index, processes = accelerator.process_index, accelerator.num_processes
    return DataLayout(rank=index // group, size=processes // group, group=group)


def is_tensor_parallel(accelerator: Accelerator) -> bool:
    """True when the Accelerator's ParallelismConfig splits the model over a ``tp`` dimension (its parameters are DTensors)."""
    config = getattr(accelerator, "parallelism_config", None)
    return bool(getattr(config, "tp_enabled", False))  # sync: none: a config flag


def gather_for_metrics(accelerator: Accelerator, layout: DataLayout, data: Any) -> Any:
    """``accelerator.gather_for_metrics(data)`` with each sample once under tensor parallelism too.

    Accelerate's own gathers every process's values and then keeps the first
    ``remainder`` of the last round: under tensor parallelism it would keep each
    group's copies and drop real samples. Here a group's copies are dropped
    first, then the padding of the last round, as Accelerate does.

    Raises:
        TypeError: under tensor parallelism, ``data`` holds something other than tensors.
    """
    if layout.group == 1:
        return accelerator.gather_for_metrics(data)
    from accelerate.utils import recursively_apply

    if not _all_tensors(data):
        raise TypeError(
            f"under tensor parallelism trainfold gathers per-sample tensors only (a tensor, or a tuple, list or dict of "
            f"them); the function returned {type(data).__name__} holding other values. Return tensors (encode labels "
            "or strings as ids)."
        )
    world = accelerator.num_processes
    kept = recursively_apply(lambda t: torch.cat(t.chunk(world)[:: layout.group]), accelerator.gather(data))
    state = accelerator.gradient_state
    remainder = state.remainder if state.end_of_dataloader else None
    return kept if remainder is None or remainder <= 0 else recursively_apply(lambda t: t[:remainder], kept)


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(d) for d in data)
    if isinstance(data, dict):
        return all(_all_tensors(d) for d in data.values())
    return False
