"""The second half of a save: writing a checkpoint's files, agreeing that every process wrote them, committing.

``save_checkpoint`` reads and encodes everything on the calling thread, so
that nothing here touches a live object, and hands a :class:`SaveJob` to
:func:`write_and_commit`: on the same thread for a blocking save, on the
Context's saver thread (``distributed/saver.py``) for ``async_save=True``, while training goes on.
A background save agrees and commits over a gloo group of its own (collectives
of one group are never issued from two threads). At most one save is in
flight: the next save, a load, and closing the Context wait for it first, and
raise its error if it failed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

import attrs
import torch

from trainfold._src.checkpoint.content import Content, write_files
from trainfold._src.checkpoint.commit import agreed, begin_checkpoint, commit, hold_lock
from trainfold._src.checkpoint.storage.protocol import Storage
from trainfold._src.distributed.control import gather_to_main

if TYPE_CHECKING:
    from trainfold._src.checkpoint.formats.common import Format
    from trainfold._src.core.context import Context
    from trainfold._src.core.state import TrainState

logger = logging.getLogger("trainfold")


@attrs.frozen(eq=False)
class SaveJob:
    """What one process writes for a checkpoint, read and copied already: nothing in it is live."""

    storage: Storage
    name: str
    #: this process's files (the main process's include the shared ones)
    files: Mapping[str, Content] = attrs.field(repr=False)
    #: a sharded checkpoint's tensors, which its format writes (a collective); None for the other formats
    shards: Mapping[str, torch.Tensor] | None = attrs.field(repr=False)
    #: the weights whose finiteness the manifest records (this process's part)
    weights: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    #: the saved state's values: the manifest's run id and position
    state: TrainState = attrs.field(repr=False)
    keep_last: int | None
    format: Format


def write_and_commit(ctx: Context, job: SaveJob, group: Any = None, begins: bool = False) -> None:
    """Write this process's files, agree that every process did, and commit on the main process (every process calls it).

    ``begins``: the job first confirms the root's lock and creates the checkpoint's staging (a background save to a
    root already locked: ``save_checkpoint`` left those requests to this thread).

    Raises:
        OSError: a write failed on this process (a full disk); nothing was committed.
        CheckpointError: a write failed on another process, the root's lock was lost, or the commit failed.
    """
    main = ctx.is_main_process
    world = ctx.accelerator.num_processes
    if begins:
        hold_lock(ctx, job.storage, job.state, group=group)
        begin_checkpoint(ctx, job.storage, job.name, job.state, group=group)
    staging = job.storage.stage(job.name, fresh=False)  # the main process made it fresh before the job began

    def cleanup() -> None:
        if main:
            staging.discard()

    entries = agreed(ctx, lambda: write_files(staging, job.files), f"writing {staging}", cleanup, group=group)
    if job.shards is not None:
        shards = job.shards
        entries.update(
            agreed(
                ctx,
                lambda: job.format.write_pieces(staging, shards, ctx.accelerator.process_index, group),
                f"writing the shards of {staging}",
                cleanup,
                group=group,
            )
        )
    if job.format.partitioned:  # each process holds its own part of the weights (shards, DeepSpeed partitions)
        finite = _finite(job.weights)
        if world > 1:  # every process reports its files' digests (nothing is read back) and whether its part is finite,
            # to the main process alone, which commits: each sends its own few entries, whatever the world size
            reports = gather_to_main(ctx.runtime.control.group() if group is None else group, (entries, finite))
            if reports is not None:
                entries = {k: v for files_of, _ in reports for k, v in files_of.items()}
                finite = all(f for _, f in reports)
    else:
        finite = _finite(job.weights) if main else True
    if main and not finite:
        _report_nonfinite(job.name)
    agreed(
        ctx,
        lambda: (
            commit(job.storage, staging, ctx, job.state, entries, job.keep_last, finite=finite, fmt=job.format.code)
            if main
            else None
        ),
        f"committing {job.name}",
        cleanup,
        group=group,
    )


#: Dtypes whose smallest and largest element ``torch.aminmax`` finds (NaN propagates into both): one pass, nothing allocated.
_AMINMAX = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _finite_one(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``t``'s device: every element finite. Through its extremes where it can (a NaN makes both NaN, an inf
    is one of them), 13 times faster on a CPU than ``isfinite(t).all()``, which writes a bool for every element first."""
    if t.dtype in _AMINMAX:
        return torch.isfinite(torch.stack(torch.aminmax(t.reshape(-1)))).all()
    return torch.isfinite(t).all()


def _finite(weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether every floating-point weight is finite (one host sync, at a save)."""
    checks = [_finite_one(t.detach()) for t in weights.values() if t.is_floating_point() and t.numel()]
    return bool(torch.stack(checks).all()) if checks else True  # sync: once per save


def _report_nonfinite(name: str) -> None:
    logger.error(
        "checkpoint %s holds non-finite weights (NaN or inf): the run has diverged. It is kept, but "
        "keep_last never removes the newest checkpoint of finite weights because of it; resume from that one "
        "(see list_checkpoints) with a lower learning rate, clipping, or make_step(..., stages=[nan_guard()]).",
        name,
    )
