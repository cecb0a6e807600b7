"""The coordinator's part of a sharded save: every process's plan merged into the global one, in time linear in the pieces.

DCP's default planner gathers each process's plan (the pieces of each tensor it
holds) on the coordinator, removes the pieces several processes hold (an HSDP
replica's shard), builds the metadata and checks it. At thousands of processes
that is hundreds of thousands of pieces, and its deduplication and its copies
of every item (``dataclasses.replace``, to rewrite index hints nothing here
reads) cost seconds per save. :class:`MergingPlanner` does the same merge in
one pass over the pieces, with plain tuples as keys, and checks each tensor's
pieces with the load's own tiling check: a layout a load would refuse is
refused at the save, before any piece is written.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from trainfold._src.checkpoint.formats.dcp_metadata import check_tiling, paused_gc


class MergingPlanner(DefaultSavePlanner):
    """DCP's default save planner, its global plan made by :func:`merge_plans`."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        self.global_plan, self.metadata = merge_plans(all_plans)
        return self.global_plan, self.metadata


def merge_plans(plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """The global plan and metadata of every process's ``plans``: each piece written once, the pieces of each tensor checked.

    A piece several processes hold (the same tensor and offset) is written by the one of them that has the fewest
    bytes to write so far, as DCP's deduplication does; a plan that holds no such piece is returned as it is.

    Raises:
        ValueError: the pieces of a tensor do not tile it (a gap, an overlap, a piece outside it), or two processes
            declare it with different shapes or dtypes.
    """
    with paused_gc():
        owner: dict[tuple[str, Any], int] = {}  # each piece's first holder
        shared: dict[tuple[str, Any], list[int]] = {}  # the pieces several processes hold, with every holder
        for rank, plan in enumerate(plans):
            for item in plan.items:
                index = item.index
                key = (index.fqn, index.offset)
                held = owner.setdefault(key, rank)
                if held != rank:
                    shared.setdefault(key, [held]).append(rank)
        kept = _deduplicated(plans, shared) if shared else plans
        return kept, _metadata(kept)


def _deduplicated(plans: list[SavePlan], shared: dict[tuple[str, Any], list[int]]) -> list[SavePlan]:
    """Each shared piece dealt to the holder with the fewest bytes so far (its own pieces counted first)."""
    load = [0] * len(plans)
    sizes: dict[tuple[str, Any], int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = (item.index.fqn, item.index.offset)
            size = item.tensor_storage_size() or 1
            if key in shared:
                sizes[key] = size
            else:
                load[rank] += size
    writer: dict[tuple[str, Any], int] = {}
    for key, ranks in shared.items():
        chosen = writer[key] = min(ranks, key=load.__getitem__)
        load[chosen] += sizes[key]
    touched = {rank for ranks in shared.values() for rank in ranks}
    return [
        (
            SavePlan(
                [item for item in plan.items if writer.get((item.index.fqn, item.index.offset), rank) == rank],
                storage_data=plan.storage_data,
                planner_data=plan.planner_data,
                usable=plan.usable,
            )
            if rank in touched
            else plan
        )
        for rank, plan in enumerate(plans)
    ]


def _metadata(plans: list[SavePlan]) -> Metadata:
    tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for plan in plans:
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                tensors[fqn] = BytesStorageMetadata()  # refused where it is written: a sharded checkpoint holds tensors
                continue
            data = item.tensor_data
            if data.chunk is None:
                raise ValueError(f"a piece of {fqn!r} is planned with no offsets and sizes")
            md = tensors.get(fqn)
            if md is None:
                md = tensors[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            elif (
                not isinstance(md, TensorStorageMetadata)
                or md.size != data.size
                or md.properties.dtype != data.properties.dtype
            ):
                raise ValueError(f"the processes declare {fqn!r} differently: {_declared(md)} and {_declared(data)}")
            md.chunks.append(data.chunk)
    for fqn, md in tensors.items():
        if isinstance(md, TensorStorageMetadata):
            check_tiling(fqn, list(md.size), md.chunks)
    return Metadata(state_dict_metadata=tensors)


def _declared(md: Any) -> str:
    if not hasattr(md, "size"):
        return "a value that is not a tensor"
    return f"{md.properties.dtype} of shape {tuple(md.size)}"
