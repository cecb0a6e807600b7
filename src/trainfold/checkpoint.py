"""Checkpoints that cannot lie: atomic save, verified load, exact resume (mid-epoch too).

Owned here: the save and load protocol (a folder ``<root>/ckpt-<micro_step>``
written into ``<root>/.tmp-ckpt-<micro_step>``, every file fsynced, the
manifest written last, then renamed into place: a crash leaves no checkpoint
that looks complete; loading verifies and decodes everything before it touches
anything), finding checkpoints again, and ``checkpoint_every``. What goes into
which file is ``_format.py``'s; what a run state is, ``_runstate.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, overload

import attrs
import torch
from toolz import curry

from . import _rng
from ._backend import loader_generators, read_ahead_batch
from ._cursor import EpochCursor, Resume
from ._format import MANIFEST, CheckpointError, read_json, read_rank, read_shared, verify, write_manifest, write_rank, write_shared
from ._io import fsync_dir
from ._runstate import StateMismatch, capture, check_fits, put_back
from ._types import Batch, Step, StepTransformer
from ._validate import expect_owned, expect_state, length_or_none, name_of, named, positive_int
from .context import Context
from .state import TrainState

PREFIX = "ckpt-"

__all__ = ["CheckpointError", "checkpoint_every", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint", "verify_checkpoint"]


def _version() -> str:
    from . import __version__

    return __version__


# --- save -----------------------------------------------------------------------------------


@overload
def save_checkpoint(ctx: Context, root: str | os.PathLike[str], *, keep_last: int | None = ...) -> Any: ...
@overload
def save_checkpoint(ctx: Context, root: str | os.PathLike[str], state: TrainState, *, keep_last: int | None = ...) -> TrainState: ...
@curry  # type: ignore[misc]
def save_checkpoint(ctx: Context, root: str | os.PathLike[str], state: TrainState, *, keep_last: int | None = None) -> TrainState:
    """Write a checkpoint of ``state`` under ``root`` and return the state unchanged.

    Everything needed to continue exactly is written: the model, optimizer,
    scheduler and loss-scaler states, Accelerate's accumulation counter, the
    whole TrainState (counters, history, the states of step transformers and
    epoch functions, running sums), every process's random states, and the data
    position: the epoch, the batch inside it, the random state the epoch began
    with (to replay its shuffle order) and the batch the loader has read ahead.
    Mid-accumulation, the partial gradients are kept too.

    The new checkpoint becomes visible only when complete; with ``keep_last=N``
    older ones are removed only after it is committed. On several processes,
    the main process writes the shared files and each process its own.

    Args:
        ctx: the run's Context.
        root: the folder that holds the run's checkpoints.
        state: the state to save.
        keep_last: keep only the newest N checkpoints under ``root``.

    Returns:
        ``state``, unchanged (so it composes as an epoch function).

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> state = save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
        >>> latest_checkpoint(root).name
        'ckpt-0000000004'

    .. versionadded:: 0.1.0
    """
    state = expect_owned("save_checkpoint", ctx, expect_state("save_checkpoint", state))
    if keep_last is not None:
        positive_int("keep_last", keep_last)
    acc = ctx.accelerator
    now = _rng.capture(_generators(state))  # first: nothing below may draw before this
    root = Path(root)
    name = f"{PREFIX}{state.micro_step:010d}"
    tmp = root / f".tmp-{name}"
    if ctx.is_main_process:
        _check_same_run(root, state)
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a save of this position that died half-way
        tmp.mkdir()
    ctx.wait_for_everyone()
    weights = acc.get_state_dict(state.model)  # every process takes part (sharded engines gather)
    run = capture(state, copied=False, weights=weights, rng=now)
    try:
        if ctx.is_main_process:
            write_shared(tmp, run, accumulation=ctx.gradient_accumulation_steps, mixed_precision=ctx.mixed_precision)
        write_rank(tmp, acc.process_index, run, _position(state))
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(
            f"saving a checkpoint under {root} failed ({exc}); nothing was committed and the previous "
            "checkpoints are intact. Free space (or lower keep_last) and save again."
        ) from exc
    ctx.wait_for_everyone()
    if ctx.is_main_process:
        _commit(tmp, root / name, ctx, state)
        if keep_last is not None:
            _prune(root, keep_last)
    ctx.wait_for_everyone()
    return state


def _check_same_run(root: Path, state: TrainState) -> None:
    """Refuse to mix two runs' checkpoints in one folder (the newest would silently win on resume)."""
    latest = latest_checkpoint(root)
    if latest is None or not state.run_id:
        return
    try:
        other = json.loads((latest / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError):
        return  # a damaged manifest is reported when loading
    if other and other != state.run_id:
        raise CheckpointError(
            f"{root} holds checkpoints of another run (run {other}, newest {latest.name}); this run is {state.run_id}. "
            "Use one folder per run, or resume that run with load_checkpoint(ctx, root, state) before saving."
        )


def _generators(state: TrainState) -> list[torch.Generator]:
    cursor = state.cursor
    return loader_generators(cursor.loader) if isinstance(cursor, EpochCursor) else []


def _position(state: TrainState) -> Resume | None:
    """Where an interrupted epoch stands (for this process), or None between epochs."""
    cursor = state.cursor
    if not (isinstance(cursor, EpochCursor) and cursor.epoch_start is not None and state.batch_in_epoch > 0):
        return None
    read_ahead = read_ahead_batch(cursor.iterator, cursor.loader)
    return Resume(epoch_start=cursor.epoch_start, now=cursor.epoch_start, read_ahead=read_ahead, epoch_length=length_or_none(cursor.loader))


def _commit(tmp: Path, final: Path, ctx: Context, state: TrainState) -> None:
    write_manifest(
        tmp,
        trainfold_version=_version(),
        torch_version=torch.__version__,
        world_size=ctx.accelerator.num_processes,
        run_id=state.run_id,
        step=state.step,
        epoch=state.epoch,
        micro_step=state.micro_step,
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
    fsync_dir(final.parent)


def _prune(root: Path, keep_last: int) -> None:
    for old in list_checkpoints(root)[:-keep_last]:
        doomed = old.with_name(f".del-{old.name}")
        os.replace(old, doomed)  # never a half-deleted folder that still looks committed
        shutil.rmtree(doomed, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The committed checkpoints under ``root``, oldest first (folders with a manifest)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / MANIFEST).is_file())


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root``, or None.

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


# --- load -----------------------------------------------------------------------------------


def verify_checkpoint(path: str | os.PathLike[str], *, rank: int | None = None) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest and return the manifest.

    Every file the manifest lists (or, with ``rank``, the shared files and that
    process's) must exist with the recorded size and SHA-256.

    Raises:
        CheckpointError: not a checkpoint, an unreadable manifest, a newer
            format, or a missing, truncated or altered file (named).
    """
    return verify(Path(path), rank=rank, version=_version())


def _resolve(path: str | os.PathLike[str]) -> Path:
    folder = Path(path)
    if (folder / MANIFEST).is_file():
        return folder
    latest = latest_checkpoint(folder)
    if latest is None:
        if folder.is_dir() and any(p.name.startswith(f".tmp-{PREFIX}") for p in folder.iterdir()):
            raise CheckpointError(f"{folder} holds only unfinished checkpoints (.tmp-*): no save completed.")
        raise CheckpointError(f"{folder} is neither a trainfold checkpoint nor a folder of checkpoints.")
    return latest


@overload
def load_checkpoint(ctx: Context, path: str | os.PathLike[str]) -> Any: ...
@overload
def load_checkpoint(ctx: Context, path: str | os.PathLike[str], state: TrainState) -> TrainState: ...
@curry  # type: ignore[misc]
def load_checkpoint(ctx: Context, path: str | os.PathLike[str], state: TrainState) -> TrainState:
    """Load a checkpoint into ``state``'s model, optimizer and scheduler and return the saved state.

    ``path`` is a checkpoint folder, or a root of them (then the newest complete
    one). Before anything is changed, the files are verified against the
    manifest and the checkpoint is checked against the run: the same world size,
    the same parameters (names and shapes) and the same optimizer layout. Then
    the weights, optimizer, scheduler, scaler and Accelerate's accumulation
    counter are restored in place, the random states are restored, and a state
    is returned whose next ``run_epoch`` continues the interrupted epoch from
    the next batch, in the same order. Call ``run_epoch`` next: anything that
    draws random numbers in between changes what follows.

    Raises:
        CheckpointError: a damaged checkpoint (naming the file), another model
            (naming the first parameter that differs), another optimizer layout,
            another world size, another accumulation setting.

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> trained = save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
        >>> resumed = load_checkpoint(ctx, root, state)
        >>> resumed.step, resumed.epoch
        (4, 1)

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> _ = save_checkpoint(ctx, root, state)
        >>> sorted(verify_checkpoint(latest_checkpoint(root))["files"])[:2]
        ['model.safetensors', 'rank-0.json']

    .. versionadded:: 0.1.0
    """
    state = expect_owned("load_checkpoint", ctx, expect_state("load_checkpoint", state))
    acc = ctx.accelerator
    folder = _resolve(path)
    manifest = verify_checkpoint(folder, rank=acc.process_index)
    if manifest["world_size"] != acc.num_processes:
        raise CheckpointError(
            f"{folder} was written by {manifest['world_size']} processes but this run has {acc.num_processes}: "
            "resume with the same number of processes (the random states and the data position are per process)."
        )
    doc = read_json(folder / "state.json")
    saved_acc = doc["accelerate"]
    if saved_acc["gradient_accumulation_steps"] != ctx.gradient_accumulation_steps:
        raise CheckpointError(
            f"{folder} was saved with gradient_accumulation_steps={saved_acc['gradient_accumulation_steps']}, this run "
            f"uses {ctx.gradient_accumulation_steps}: the accumulation phase and the updates would not line up. "
            "Resume with the same Accelerator settings."
        )
    rank = read_rank(folder, acc.process_index, acc.device)
    run = read_shared(folder, doc, state, rank)
    try:
        check_fits(run, state)
    except StateMismatch as exc:
        raise CheckpointError(f"{folder} {exc}") from None

    # Everything read and checked: now change things.
    return attrs.evolve(put_back(run, state), cursor=rank["resume"])


# --- periodic saving ------------------------------------------------------------------------


def checkpoint_every(ctx: Context, root: str | os.PathLike[str], n: int, *, keep_last: int | None = None) -> StepTransformer:
    """A step transformer that saves a checkpoint after every ``n``-th optimizer update, and when the run stops.

    A final checkpoint is written after the step at which the run stops for any
    reason (``max_steps``, ``nan_guard``, or Ctrl-C, which ``run_epoch`` turns
    into a stop at the next step boundary), so an interrupted run loses nothing.
    For checkpoints per epoch, compose ``save_checkpoint(ctx, root, keep_last=...)``
    after ``run_epoch`` instead (or ``every(k, save_checkpoint(...))``).

    Example:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> state = run_epoch(ctx, checkpoint_every(ctx, root, 2, keep_last=1)(make_step(ctx, loss_fn)), loader, state)
        >>> [p.name for p in list_checkpoints(root)]
        ['ckpt-0000000004']

    .. versionadded:: 0.1.0
    """
    positive_int("checkpoint_every", n)
    interrupt = ctx.interrupt

    def transform(step: Step) -> Step:
        def saving(state: TrainState, batch: Batch) -> TrainState:
            new = step(state, batch)
            due = new.step != state.step and new.step % n == 0
            stopping = (new.should_stop and not state.should_stop) or (interrupt.requested and interrupt.agreed(ctx.accelerator, new.step))
            if due or stopping:
                return save_checkpoint(ctx, root, new, keep_last=keep_last)
            return new

        return named(saving, f"checkpoint_every({n})({name_of(step)})")

    return transform
