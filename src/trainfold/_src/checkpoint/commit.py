"""Writing to a run's checkpoint root: the names checkpoints get, the lock, the commit and ``keep_last``.

Owned here: :func:`checkpoint_name`, :func:`agreed` (every process goes on or
raises together), :func:`hold_lock` (one writer per root), :func:`check_same_run`
and :func:`commit` (the manifest last, the debris of crashed saves, ``keep_last``,
never the newest finite checkpoint). Reading a root is ``root.py``'s.
"""

from __future__ import annotations

import errno
from typing import Any, Callable

import torch

from trainfold._version import __version__
from trainfold._src.backend.mesh import data_layout
from trainfold._src.backend.optim import accumulation_counter
from trainfold._src.checkpoint.manifest import FORMAT, PREFIX, manifest_bytes, read_manifest_json, required_files
from trainfold._src.checkpoint.root import ordered
from trainfold._src.checkpoint.storage.protocol import Staging, Storage, Stored
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold.errors import CheckpointError


def checkpoint_name(ctx: Context, state: TrainState) -> str:
    """``ckpt-<update>``: named by optimizer update, the unit ``checkpoint_every(n)`` counts in.

    A save in the middle of an accumulation group adds the micro-batch count
    (``ckpt-<update>-<micro_step>``), so it never replaces the save at the update.
    """
    mid_group = accumulation_counter(ctx.accelerator) % ctx.gradient_accumulation_steps
    return f"{PREFIX}{state.step:010d}" + (f"-{state.micro_step}" if mid_group else "")


def agreed(
    ctx: Context, work: Callable[[], Any], what: str, cleanup: Callable[[], Any] = lambda: None, *, group: Any = None
) -> Any:
    """Run ``work`` on every process and agree on whether it failed anywhere (one all-reduce on several).

    Every process then raises or goes on together: none waits forever in the next collective.
    The all-reduce is on the control channel (a CPU group: no device sync), or on ``group``
    (a background save's own).
    """
    error: BaseException | None = None
    result = None
    try:
        result = work()
    except (OSError, TypeError, ValueError, RuntimeError) as exc:
        error = exc
    acc = ctx.accelerator
    failed = error is not None
    if acc.num_processes > 1:
        import torch.distributed as dist

        flag = torch.tensor([float(failed)])  # sync: none: a host bool
        dist.all_reduce(flag, group=ctx.runtime.control.group() if group is None else group)
        failed = bool(flag.item() > 0)  # sync: none, a CPU tensor
    if not failed:
        return result
    cleanup()
    if isinstance(error, OSError):
        advice = (
            "Free space (or lower keep_last) and save again."
            if error.errno in (errno.ENOSPC, errno.EDQUOT)
            else "Check that the folder (or bucket) exists and this process may write there, and save again."
        )
        text = f"{what} failed ({error}); nothing was committed and the previous checkpoints are intact. {advice}"
        raise (OSError(error.errno, text) if error.errno is not None else OSError(text)) from error
    if error is not None:
        raise error
    raise CheckpointError(f"{what} failed on another process; nothing was committed (see that process's error).")


def hold_lock(ctx: Context, storage: Storage, state: TrainState, group: Any = None) -> None:
    """Take the root's lock on the first save to it (the main process holds it; every process agrees, over ``group``
    on a background save's thread)."""
    key = storage.key
    if ctx.runtime.holds_lock(key):
        held = ctx.runtime.lock_for(key)
        # a call or two on the main process: still ours (a removed lock is taken again)
        agreed(ctx, lambda: None if held is None else held.confirm(), f"locking {storage}", group=group)
        return
    lock = agreed(
        ctx, lambda: storage.lock(state.run_id) if ctx.is_main_process else None, f"locking {storage}", group=group
    )
    ctx.runtime.keep_lock(key, lock)


def begin_checkpoint(ctx: Context, storage: Storage, name: str, state: TrainState, group: Any = None) -> None:
    """Refuse a root that holds another run's checkpoints, and create the checkpoint's staging (the main process; every
    process agrees, over ``group`` on a background save's thread)."""

    def begin() -> None:
        if ctx.is_main_process:
            check_same_run(storage, state)
            storage.stage(name, fresh=True)

    agreed(ctx, begin, f"creating {name} in {storage}", group=group)


def check_same_run(storage: Storage, state: TrainState) -> None:
    """Refuse to mix two runs' checkpoints in one root (the newest would silently win on resume)."""
    found = ordered(storage)
    if not found or not state.run_id:
        return
    latest = found[-1]
    other = read_manifest_json(latest).get("run_id")  # any format: the run id is what matters here
    if other and other != state.run_id:
        raise CheckpointError(
            f"{storage} holds checkpoints of another run (run {other}, newest {latest.name}); this run is {state.run_id}. "
            "Use one folder per run, or resume that run with load_checkpoint(ctx, root, state) before saving."
        )


def commit(
    storage: Storage,
    staging: Staging,
    ctx: Context,
    state: TrainState,
    entries: dict[str, Any],
    keep_last: int | None,
    *,
    finite: bool = True,
    fmt: int = FORMAT,
    fields: dict[str, Any] | None = None,
) -> None:
    """Write the manifest (every file's entry; the other processes' files not reported are read back) and commit."""
    world = ctx.accelerator.num_processes
    others = [n for n in required_files(world, fmt) if n not in entries]
    entries = {**entries, **{n: staging.digest(n) for n in others}}
    manifest = manifest_bytes(
        entries,
        fmt,
        trainfold_version=__version__,
        torch_version=torch.__version__,
        world_size=world,
        data_ranks=data_layout(ctx.accelerator).size,
        run_id=state.run_id,
        step=state.step,
        epoch=state.epoch,
        micro_step=state.micro_step,
        finite=finite,
        **(fields or {}),
    )
    staging.commit(manifest)
    storage.clean()
    if keep_last is not None:
        held = ctx.runtime.lock_for(storage.key)
        if held is not None:
            held.confirm()  # still the root's one writer: a job that stalled past its lease removes nothing
        _prune(storage, keep_last)


def _prune(storage: Storage, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` checkpoints, and never the newest one of finite weights.

    A run that went non-finite (a NaN on one process, no ``nan_guard``) goes on
    writing checkpoints of NaN weights: ``keep_last`` alone would push out the
    last one worth resuming from.
    """
    found = ordered(storage)
    finite = [c for c in found if _is_finite(c)]
    keep = {c.name for c in found[-keep_last:]} | {c.name for c in finite[-1:]}
    for old in found:
        if old.name not in keep:
            storage.remove(old.name)


def _is_finite(stored: Stored) -> bool:
    """What the manifest says of the weights (a checkpoint written before trainfold recorded it: finite)."""
    try:
        return read_manifest_json(stored).get("finite", True) is not False
    except CheckpointError:
        return False
