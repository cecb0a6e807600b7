"""Checkpoints that cannot lie: atomic save, verified load, exact resume (mid-epoch too).

Owned here: the save and load protocol, finding checkpoints again, and
``checkpoint_every``. A save encodes everything first (a value that cannot be
written fails before any file exists), writes into ``<root>/.tmp-<name>``
(every file fsynced), writes the manifest last and renames the folder into
place: a crash leaves no checkpoint that looks complete. The main process holds
an exclusive lock on the root for the run's lifetime (``_lock.py``) and cleans
the debris of crashed saves when it commits. A load reads each file once,
verifies it while reading, decodes and checks everything, and only then changes
the live objects. What goes into which file is ``_format.py``'s; what a run
state is, ``_runstate.py``'s.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, overload

import attrs
import torch
from toolz import curry

from . import _codec, _rng
from ._backend import is_resumable_loader, loader_generators, read_ahead_batch
from ._cursor import EpochCursor, Resume
from ._files import (
    CheckpointError,
    Content,
    rank_files,
    read_manifest,
    read_verified,
    verify,
    write_files,
)
from ._format import decode, encode_rank, encode_shared
from ._root import (
    agreed,
    check_same_run,
    checkpoint_name,
    commit,
    fresh,
    hold_lock,
    latest_checkpoint,
    list_checkpoints,
    resolve,
    root_path,
)
from ._runstate import StateMismatch, capture, check_fits, put_back
from ._types import Batch, Step, StepTransformer
from ._validate import (
    expect_owned,
    expect_state,
    length_or_none,
    name_of,
    named,
    positive_int,
)
from .context import Context
from .interrupt import catching_signals
from .state import TrainState

logger = logging.getLogger("trainfold")

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

    The checkpoint is named by optimizer update (``ckpt-<update>``;
    ``ckpt-<update>-<micro_step>`` in the middle of an accumulation group) and
    becomes visible only when complete; with ``keep_last=N`` older ones are
    removed only after it is committed. The first save takes an exclusive
    lock on ``root`` for the rest of the run (until ``ctx.close()`` or the
    process ends): a second run writing there gets a ``CheckpointError``. On
    several processes, the main process writes the shared files and each
    process its own.

    Args:
        ctx: the run's Context.
        root: the folder that holds the run's checkpoints.
        state: the state to save.
        keep_last: keep only the newest N checkpoints under ``root``.

    Returns:
        ``state``, unchanged (so it composes as an epoch function).

    Raises:
        CheckpointError: ``root`` holds another run's checkpoints, or another
            process is writing there.
        TypeError: a value that cannot be written (an unregistered record in
            ``extras``, a batch of a type a checkpoint cannot hold); nothing is written.
        OSError: the disk is full (or another write failed); nothing is committed,
            the unfinished save is removed and earlier checkpoints are intact.

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
    with catching_signals(ctx.interrupt, ctx.signals):  # a signal now is honoured after the save, not in its middle
        return _save(ctx, root, state, keep_last)


def _save(ctx: Context, root: str | os.PathLike[str], state: TrainState, keep_last: int | None) -> TrainState:
    acc = ctx.accelerator
    main = ctx.is_main_process
    now = _rng.capture(_generators(state))  # first: nothing below may draw before this
    root = root_path(root)
    hold_lock(ctx, root, state)
    name = checkpoint_name(ctx, state)
    tmp = root / f".tmp-{name}"
    weights = acc.get_state_dict(state.model)  # every process takes part (sharded engines gather)
    run = capture(state, copied=False, weights=weights, rng=now)
    files = agreed(ctx, lambda: _encode(ctx, state, run, main), "encoding the checkpoint")
    agreed(ctx, lambda: _start(root, tmp, state) if main else None, f"creating {tmp}")
    entries = agreed(ctx, lambda: write_files(tmp, files), f"writing {tmp}", cleanup=lambda: main and shutil.rmtree(tmp, ignore_errors=True))
    finite = _all_finite(weights, name) if main else True
    agreed(ctx, lambda: commit(root, tmp, root / name, ctx, state, entries, keep_last, finite=finite) if main else None,
           f"committing {name}", cleanup=lambda: main and shutil.rmtree(tmp, ignore_errors=True))
    return state


def _all_finite(weights: Mapping[str, torch.Tensor], name: str) -> bool:
    """Whether every floating-point weight is finite (one host sync, at a save); logs an error if not."""
    checks = [torch.isfinite(t).all() for t in weights.values() if t.is_floating_point() and t.numel()]
    finite = bool(torch.stack(checks).all()) if checks else True  # sync: once per save
    if not finite:
        logger.error(
            "trainfold: checkpoint %s holds non-finite weights (NaN or inf): the run has diverged. It is kept, but "
            "keep_last never removes the newest checkpoint of finite weights because of it; resume from that one "
            "(see list_checkpoints) with a lower learning rate, clipping, or make_step(..., stages=[nan_guard()]).",
            name,
        )
    return finite


def _start(root: Path, tmp: Path, state: TrainState) -> None:
    check_same_run(root, state)
    fresh(tmp)


def _encode(ctx: Context, state: TrainState, run: Any, main: bool) -> dict[str, Content]:
    files = encode_rank(ctx.accelerator.process_index, run, _position(state))
    if main:
        files.update(encode_shared(run, accumulation=ctx.gradient_accumulation_steps, mixed_precision=ctx.mixed_precision))
    return files


def _generators(state: TrainState) -> list[torch.Generator]:
    cursor = state.cursor
    return loader_generators(cursor.loader) if isinstance(cursor, EpochCursor) else []


def _position(state: TrainState) -> Resume | None:
    """Where an interrupted epoch stands (for this process), or None between epochs."""
    cursor = state.cursor
    if not (isinstance(cursor, EpochCursor) and cursor.epoch_start is not None and state.batch_in_epoch > 0):
        return None
    if not is_resumable_loader(cursor.loader):
        raise TypeError(
            "save_checkpoint: a checkpoint in the middle of an epoch needs a loader prepared with ctx.prepare_loaders "
            f"(the epoch runs over a {type(cursor.loader).__name__}), so that it can continue where it stopped."
        )
    read_ahead = read_ahead_batch(cursor.iterator, cursor.loader)
    # ``now`` is not written from here: the run state's random states are the moment of the save
    return Resume(epoch_start=cursor.epoch_start, now=cursor.epoch_start, read_ahead=read_ahead, epoch_length=length_or_none(cursor.loader))


# --- load -----------------------------------------------------------------------------------


def verify_checkpoint(path: str | os.PathLike[str], *, rank: int | None = None) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest and return the manifest.

    The manifest must list every file the format needs, and only plain names
    inside the folder; every file it lists (or, with ``rank``, the shared files
    and that process's) must be a regular file (a symbolic link is refused,
    never followed) with the recorded size and SHA-256.

    Raises:
        CheckpointError: not a checkpoint, an unreadable, oversized or incomplete
            manifest, a newer format, or a missing, truncated, altered or linked file (named).
    """
    return verify(Path(path), rank=rank, version=_version())


@overload
def load_checkpoint(ctx: Context, path: str | os.PathLike[str]) -> Any: ...
@overload
def load_checkpoint(ctx: Context, path: str | os.PathLike[str], state: TrainState) -> TrainState: ...
@curry  # type: ignore[misc]
def load_checkpoint(ctx: Context, path: str | os.PathLike[str], state: TrainState) -> TrainState:
    """Load a checkpoint into ``state``'s model, optimizer and scheduler and return the saved state.

    ``path`` is a checkpoint folder, or a root of them (then the newest complete
    one, by the position it records). All or nothing: every file is read once
    and verified against the manifest while it is read, every value is decoded
    and the checkpoint is checked against the run (the same world size, the same
    parameters, names and shapes, the same optimizer layout, a scheduler on both
    sides or neither) before anything is changed. Then the weights, optimizer,
    scheduler, scaler and Accelerate's accumulation counter are restored in
    place, the random states are restored, and a state is returned whose next
    ``run_epoch`` continues the interrupted epoch from the next batch, in the
    same order. Call ``run_epoch`` next: anything that draws random numbers in
    between changes what follows.

    Raises:
        CheckpointError: a damaged or hostile checkpoint (naming the file), another model
            (naming the first parameter that differs), another optimizer layout,
            another world size, another accumulation setting. Nothing is changed.

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
    folder = resolve(path)
    manifest = read_manifest(folder, version=_version())
    if manifest["world_size"] != acc.num_processes:
        raise CheckpointError(
            f"{folder} was written by {manifest['world_size']} processes but this run has {acc.num_processes}: "
            "resume with the same number of processes (the random states and the data position are per process)."
        )
    files = read_verified(folder, manifest, ["state.json", "state.safetensors", "model.safetensors", *rank_files(acc.process_index)])
    run, resume, saved_steps = decode(folder, files, state, acc.process_index)
    del files
    if saved_steps != ctx.gradient_accumulation_steps:
        raise CheckpointError(
            f"{folder} was saved with gradient_accumulation_steps={saved_steps}, this run "
            f"uses {ctx.gradient_accumulation_steps}: the accumulation phase and the updates would not line up. "
            "Resume with the same Accelerator settings."
        )
    try:
        check_fits(run, state)
    except StateMismatch as exc:
        raise CheckpointError(f"{folder} {exc}") from None

    # Everything read and checked: now change things.
    loaded = put_back(run, state, keep_run=False)
    # A stop that ended only the saving invocation (a budget, a signal) is not carried on; a finished run stays stopped.
    return attrs.evolve(loaded, cursor=resume, should_stop=loaded.finished, stop_reason=loaded.stop_reason if loaded.finished else "")


# --- periodic saving ------------------------------------------------------------------------


def _check_resumable(state: TrainState, batch: Batch) -> None:
    """Refuse, at the first step, an epoch that a mid-epoch checkpoint could not record.

    Raises:
        TypeError: the loader is not prepared (``ctx.prepare_loaders``), or the batch holds
            a value a checkpoint cannot hold (a custom object), named.
    """
    cursor = state.cursor
    if isinstance(cursor, EpochCursor) and not is_resumable_loader(cursor.loader):
        raise TypeError(
            "checkpoint_every: the epoch runs over a loader that was not prepared "
            f"(a {type(cursor.loader).__name__}); a checkpoint inside the epoch could not continue it. "
            "Prepare it with ctx.prepare_loaders(loader)."
        )
    try:
        _codec.Encoder().encode(batch, "batch")
    except TypeError as exc:
        raise TypeError(f"checkpoint_every: the loader's batches cannot be checkpointed mid-epoch: {exc}") from None


def checkpoint_every(ctx: Context, root: str | os.PathLike[str], n: int, *, keep_last: int | None = None) -> StepTransformer:
    """A step transformer that saves a checkpoint after every ``n``-th optimizer update, and when the run stops.

    A final checkpoint is written after the step at which the run stops for any
    reason (``max_steps``, ``nan_guard``, or a signal such as Ctrl-C or SIGTERM,
    which ``run_epoch`` turns into a stop at the next step boundary agreed by
    every process), so an interrupted run loses nothing.
    For checkpoints per epoch, compose ``save_checkpoint(ctx, root, keep_last=...)``
    after ``run_epoch`` instead (or ``every_epochs(k, save_checkpoint(...))``).

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
        checked = [False]

        def saving(state: TrainState, batch: Batch) -> TrainState:
            if not checked[0]:  # once: what would fail at the first save, refused at the first step
                _check_resumable(state, batch)
                checked[0] = True
            new = step(state, batch)
            due = new.step != state.step and new.step % n == 0
            # a signal agreed at this micro-batch (run_epoch then stops here: the same answer)
            stopping = (new.should_stop and not state.should_stop) or (
                new.micro_step >= interrupt.next_check and interrupt.check(new.micro_step, ctx.accelerator.sync_gradients) != 0
            )
            if due or stopping:
                return save_checkpoint(ctx, root, new, keep_last=keep_last)
            return new

        return named(saving, f"checkpoint_every({n})({name_of(step)})")

    return transform
