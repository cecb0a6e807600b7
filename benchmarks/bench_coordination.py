"""A sharded save's coordination at scale, in one process: the coordinator's merge of thousands of ranks' plans.

    python benchmarks/bench_coordination.py [--ranks 256 1024 4096] [--tensors 50]

Each synthetic rank holds a shard (a block of rows) of every one of ``--tensors`` tensors of 4096 x 1024 floats, as
under FSDP; its local plan is what DCP's planner makes of that. The coordinator's part of a sharded save is timed on
those plans: the global plan (deduplication, validation, the metadata) as DCP's ``DefaultSavePlanner`` makes it and as
trainfold's ``MergingPlanner`` (the one its saves use) does, then trainfold's ``tensors.json`` (``metadata_json``: every
chunk of every tensor, and where it is stored). Each is timed without tracing, then once more under ``tracemalloc`` for
its peak of allocations (which tracing slows down).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from trainfold._src.checkpoint.formats.dcp_metadata import metadata_json
from trainfold._src.checkpoint.formats.dcp_plan import MergingPlanner, merge_plans

ROWS, COLUMNS = 4096, 1024


def local_plan(rank: int, ranks: int, tensors: int) -> SavePlan:
    """Rank ``rank``'s plan: its block of rows of each tensor."""
    rows = ROWS // ranks
    items = []
    for t in range(tensors):
        offsets, sizes = torch.Size([rank * rows, 0]), torch.Size([rows, COLUMNS])
        items.append(
            WriteItem(
                index=MetadataIndex(f"layers.{t}.weight", offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties(dtype=torch.float32),
                    size=torch.Size([ROWS, COLUMNS]),
                ),
            )
        )
    return SavePlan(items, planner_data={f"layers.{t}.weight": (f"layers.{t}.weight",) for t in range(tensors)})


def merge(plans: list[SavePlan], planner: Any) -> tuple[float, float, int]:
    """The coordinator's work on ``plans`` with ``planner``: its global plan's seconds, then tensors.json's, and its size."""
    start = time.perf_counter()
    planner.set_up_planner({}, is_coordinator=True)
    global_plans, metadata = planner.create_global_plan(plans)
    planned = time.perf_counter()
    stored = {item.index: (f"shard-{r}.safetensors", "key") for r, p in enumerate(global_plans) for item in p.items}
    size = sum(len(part) for part in metadata_json(metadata, stored))
    return planned - start, time.perf_counter() - planned, size


def peak_mib(work: Any) -> float:
    """The peak of ``work()``'s allocations, under ``tracemalloc``."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="*", default=[256, 1024, 4096])
    parser.add_argument("--tensors", type=int, default=50)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        plans = [local_plan(r, ranks, args.tensors) for r in range(ranks)]
        dcp_s, _, _ = merge(plans, DefaultSavePlanner())
        merged_s, written_s, size = merge(plans, MergingPlanner())
        global_plans, metadata = merge_plans(plans)
        stored = {item.index: (f"shard-{r}.safetensors", "key") for r, p in enumerate(global_plans) for item in p.items}
        rows.append(
            {
                "ranks": ranks,
                "dcp_plan_s": dcp_s,
                "dcp_plan_mib": peak_mib(lambda: DefaultSavePlanner().create_global_plan(plans)),
                "merge_s": merged_s,
                "merge_mib": peak_mib(lambda: merge_plans(plans)),
                "tensors_json_s": written_s,
                "tensors_json_mib": peak_mib(lambda: metadata_json(metadata, stored)),
                "json_mb": size / 1e6,
            }
        )
    print(f"{args.tensors} tensors, each sharded over every rank\n")
    print(
        "| ranks | chunks | DCP's global plan: s, MiB | trainfold's merge: s, MiB | tensors.json: s, MiB | its size (MB) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['ranks']} | {row['ranks'] * args.tensors:,} | {row['dcp_plan_s']:.2f}, {row['dcp_plan_mib']:.0f} "
            f"| {row['merge_s']:.2f}, {row['merge_mib']:.0f} | {row['tensors_json_s']:.2f}, {row['tensors_json_mib']:.0f} "
            f"| {row['json_mb']:.1f} |"
        )


if __name__ == "__main__":
    main()
