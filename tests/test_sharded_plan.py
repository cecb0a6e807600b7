"""The coordinator's merge of a sharded save's plans: DCP's global plan and metadata, made in one pass."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from trainfold._src.checkpoint.formats.dcp_plan import merge_plans


def _piece(fqn, offsets, sizes, size, dtype=torch.float32):
    offsets, sizes = torch.Size(offsets), torch.Size(sizes)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def _rows(ranks, rows=8, columns=3, replicas=1, tensors=("a", "b")):
    """Each of ``ranks`` processes' plan: a block of rows of each tensor; ``replicas`` processes hold each block (HSDP)."""
    blocks = ranks // replicas
    step = rows // blocks
    return [
        SavePlan([_piece(t, [(r % blocks) * step, 0], [step, columns], [rows, columns]) for t in tensors])
        for r in range(ranks)
    ]


def _dcp(plans):
    planner = DefaultSavePlanner(flatten_state_dict=False)  # these plans carry no flattening's mappings
    planner.set_up_planner({}, is_coordinator=True)
    return planner.create_global_plan(plans)


def _chunks(metadata):
    return {
        fqn: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        for fqn, md in metadata.state_dict_metadata.items()
    }


def _written(global_plans):
    return sorted(
        (item.index.fqn, tuple(item.index.offset), rank) for rank, p in enumerate(global_plans) for item in p.items
    )


@pytest.mark.parametrize("ranks, replicas", [(1, 1), (4, 1), (4, 2), (8, 4)])
def test_the_merge_makes_dcps_metadata_and_writes_each_piece_once(ranks, replicas):
    plans = _rows(ranks, replicas=replicas)
    merged, metadata = merge_plans(plans)
    theirs, their_metadata = _dcp(plans)
    assert _chunks(metadata) == _chunks(their_metadata)
    assert {fqn: (md.size, md.properties.dtype) for fqn, md in metadata.state_dict_metadata.items()} == {
        fqn: (md.size, md.properties.dtype) for fqn, md in their_metadata.state_dict_metadata.items()
    }
    written = _written(merged)
    assert len(written) == len({(f, o) for f, o, _ in written}) == 2 * (ranks // replicas)  # each piece once
    assert [len(p.items) for p in merged] == [len(p.items) for p in theirs]  # dealt out as evenly as DCP does
    if replicas == 1:
        assert all(m is p for m, p in zip(merged, plans))  # nothing shared: the plans go back as they came


def test_a_shared_piece_goes_to_the_holder_with_the_least_to_write():
    big, small = _piece("big", [0], [100], [100]), _piece("w", [0], [4], [4])
    plans = [SavePlan([big, small]), SavePlan([small])]  # process 0 holds the big tensor alone
    merged, _ = merge_plans(plans)
    assert [[i.index.fqn for i in p.items] for p in merged] == [["big"], ["w"]]


@pytest.mark.parametrize(
    "plans, match",
    [
        (
            [SavePlan([_piece("w", [0, 0], [4, 3], [8, 3])]), SavePlan([_piece("w", [2, 0], [6, 3], [8, 3])])],
            "'w' do not tile it: along dimension 0, a piece starts at 2, not at 4",
        ),
        ([SavePlan([_piece("w", [0, 0], [4, 3], [8, 3])])], "cover 4 of the 8 places along its dimension 0"),
        (
            [SavePlan([_piece("w", [0, 0], [4, 3], [8, 3])]), SavePlan([_piece("w", [4, 0], [4, 3], [9, 3])])],
            r"declare 'w' differently: torch.float32 of shape \(8, 3\) and torch.float32 of shape \(9, 3\)",
        ),
        (
            [
                SavePlan([_piece("w", [0, 0], [4, 3], [8, 3])]),
                SavePlan([_piece("w", [4, 0], [4, 3], [8, 3], torch.float16)]),
            ],
            "declare 'w' differently: torch.float32 of shape",
        ),
    ],
    ids=["overlap", "gap", "shape", "dtype"],
)
def test_a_plan_a_load_would_refuse_is_refused_at_the_save(plans, match):
    with pytest.raises(ValueError, match=match):
        merge_plans(plans)


def test_the_collector_runs_again_after_a_merge_even_a_refused_one():
    assert gc.isenabled()
    merge_plans(_rows(4))
    with pytest.raises(ValueError):
        merge_plans([SavePlan([_piece("w", [0], [4], [8])])])
    assert gc.isenabled()
    gc.disable()
    try:
        merge_plans(_rows(4))
        assert not gc.isenabled()  # a caller's paused collector stays paused
    finally:
        gc.enable()
