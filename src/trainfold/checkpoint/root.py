"""A run's checkpoint root: the names checkpoints get, their order, the lock, and the commit.

Owned here: :func:`checkpoint_name`, :func:`list_checkpoints` and
:func:`latest_checkpoint` (order by the position each manifest records, only
names trainfold writes), :func:`hold_lock` (one writer per root, ``_lock.py``),
:func:`commit` (the manifest last, the rename, the debris of crashed saves,
``keep_last``) and :func:`resolve` (a folder or a root, to one checkpoint).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from trainfold._version import __version__
from trainfold.backend.engine import accumulation_counter
from trainfold.base.io import fsync_dir
from trainfold.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    digest_files,
    read_manifest_json,
    required_files,
    write_manifest,
)
from trainfold.checkpoint.storage import lock as _lock
from trainfold.core.context import Context
from trainfold.core.state import TrainState
from trainfold.errors import CheckpointError

PREFIX = "ckpt-"
#: The names trainfold gives checkpoints: ``ckpt-<update>``, and ``ckpt-<update>-<micro_step>`` mid-accumulation.
_NAME = re.compile(r"ckpt-[0-9]{1,20}(?:-[0-9]{1,20})?")
#: What crashed saves leave behind: cleaned (under the lock) when a save commits.
_DEBRIS = re.compile(r"\.(?:tmp|del|old)-ckpt-[0-9]{1,20}(?:-[0-9]{1,20})?")

logger = logging.getLogger("trainfold")


def checkpoint_name(ctx: Context, state: TrainState) -> str:
    """``ckpt-<update>``: named by optimizer update, the unit ``checkpoint_every(n)`` counts in.

    A save in the middle of an accumulation group adds the micro-batch count
    (``ckpt-<update>-<micro_step>``), so it never replaces the save at the update.
    """
    mid_group = accumulation_counter(ctx.accelerator) % ctx.gradient_accumulation_steps
    return f"{PREFIX}{state.step:010d}" + (f"-{state.micro_step}" if mid_group else "")


def root_path(root: str | os.PathLike[str]) -> Path:
    if os.fspath(root) == "":
        raise ValueError("save_checkpoint needs a folder for its checkpoints (got ''): pass a path such as 'checkpoints'.")
    return Path(root)


def fresh(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # a save of this position that died half-way (ours: we hold the lock)
    tmp.mkdir()


def agreed(ctx: Context, work: Callable[[], Any], what: str, cleanup: Callable[[], Any] = lambda: None, *, group: Any = None) -> Any:
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

        flag = torch.tensor([float(failed)])
        dist.all_reduce(flag, group=ctx.control.group() if group is None else group)
        failed = bool(flag.item() > 0)  # sync: none, a CPU tensor
    if not failed:
        return result
    cleanup()
    if isinstance(error, OSError):
        advice = ("Free space (or lower keep_last) and save again." if error.errno in (errno.ENOSPC, errno.EDQUOT) else
                  "Check that the folder exists and this process may write there, and save again.")
        raise OSError(error.errno, f"{what} failed ({error}); nothing was committed and the previous checkpoints are intact. {advice}") from error
    if error is not None:
        raise error
    raise CheckpointError(f"{what} failed on another process; nothing was committed (see that process's error).")


def hold_lock(ctx: Context, root: Path, state: TrainState) -> None:
    """Take the root's lock on the first save to it (the main process holds it; every process agrees)."""
    key = os.path.abspath(root)
    if key in ctx.checkpoint_locks:
        held = ctx.checkpoint_locks[key]
        # a syscall or two on the main process: still ours, and its file still there (a removed root is made again)
        agreed(ctx, lambda: None if held is None else _lock.confirm(held, root), f"locking {root}")
        return
    lock = agreed(ctx, lambda: _lock.acquire(root, state.run_id) if ctx.is_main_process else None, f"locking {root}")
    ctx.checkpoint_locks[key] = lock


def check_same_run(root: Path, state: TrainState) -> None:
    """Refuse to mix two runs' checkpoints in one folder (the newest would silently win on resume)."""
    latest = latest_checkpoint(root)
    if latest is None or not state.run_id:
        return
    other = read_manifest_json(latest).get("run_id")  # any format: the run id is what matters here
    if other and other != state.run_id:
        raise CheckpointError(
            f"{root} holds checkpoints of another run (run {other}, newest {latest.name}); this run is {state.run_id}. "
            "Use one folder per run, or resume that run with load_checkpoint(ctx, root, state) before saving."
        )


def commit(root: Path, tmp: Path, final: Path, ctx: Context, state: TrainState, entries: dict[str, Any], keep_last: int | None,
           *, finite: bool = True, fmt: int = FORMAT, fields: dict[str, Any] | None = None) -> None:
    world = ctx.accelerator.num_processes
    others = [n for n in required_files(world, fmt) if n not in entries]
    entries = {**entries, **digest_files(tmp, others)}  # the other processes' files (not already reported): read back
    missing = [n for n in required_files(world, fmt) if n not in entries]
    if missing:
        raise CheckpointError(f"{tmp}: {missing[0]} was not written; a checkpoint missing a file is never committed.")
    write_manifest(
        tmp,
        entries,
        fmt,
        trainfold_version=__version__,
        torch_version=torch.__version__,
        world_size=world,
        run_id=state.run_id,
        step=state.step,
        epoch=state.epoch,
        micro_step=state.micro_step,
        finite=finite,
        **(fields or {}),
    )
    fsync_dir(tmp)
    if final.exists():  # the same position saved again: swap, then drop the old one
        old = final.with_name(f".old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    _clean_debris(root)
    if keep_last is not None:
        _prune(root, keep_last)


def _clean_debris(root: Path) -> None:
    """Remove what crashed saves left (``.tmp-``, ``.del-``, ``.old-`` folders): ours, since we hold the lock."""
    for p in root.iterdir():
        if _DEBRIS.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` checkpoints, and never the newest one of finite weights.

    A run that went non-finite (a NaN on one process, no ``nan_guard``) goes on
    writing checkpoints of NaN weights: ``keep_last`` alone would push out the
    last one worth resuming from.
    """
    found = list_checkpoints(root)
    finite = [p for p in found if _is_finite(p)]
    keep = set(found[-keep_last:]) | set(finite[-1:])
    for old in found:
        if old in keep:
            continue
        doomed = old.with_name(f".del-{old.name}")
        os.replace(old, doomed)  # never a half-deleted folder that still looks committed
        shutil.rmtree(doomed, ignore_errors=True)


def _is_finite(folder: Path) -> bool:
    """What the manifest says of the weights (a checkpoint written before trainfold recorded it: finite)."""
    try:
        return read_manifest_json(folder).get("finite", True) is not False
    except CheckpointError:
        return False


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first.

    Only folders named as trainfold names checkpoints (``ckpt-<update>``...)
    with a readable manifest count, ordered by the position recorded in that
    manifest (not by name: a copy named ``ckpt-best`` is not "newest"). A
    checkpoint whose manifest is damaged is left out, with a warning on the
    ``trainfold`` logger.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if not _NAME.fullmatch(p.name) or p.is_symlink() or not p.is_dir() or not (p / MANIFEST).exists():
            continue
        try:
            manifest = read_manifest_json(p)  # any format: a newer one is ordered, and refused when loaded
            position = (manifest["micro_step"], manifest["step"])
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in position):
                raise CheckpointError(f"{p / MANIFEST} is damaged: its position is not a pair of ints.")
        except (CheckpointError, KeyError) as exc:
            logger.warning("skipping %s: %s", p, exc)
            continue
        found.append((position, p.name, p))
    return [p for *_, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root`` (by the position it records), or None.

    Example:
        >>> latest_checkpoint("/nonexistent") is None
        True

    Example:
        >>> list_checkpoints("/nonexistent")
        []

    .. versionadded:: 0.1.0
    """
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve(path: str | os.PathLike[str]) -> Path:
    folder = Path(path)
    if (folder / MANIFEST).exists() or (folder / MANIFEST).is_symlink():
        return folder
    latest = latest_checkpoint(folder)
    if latest is None:
        if folder.is_dir() and any(p.name.startswith(f".tmp-{PREFIX}") for p in folder.iterdir()):
            raise CheckpointError(f"{folder} holds only unfinished checkpoints (.tmp-*): no save completed.")
        raise CheckpointError(f"{folder} is neither a trainfold checkpoint nor a folder of checkpoints.")
    return latest


