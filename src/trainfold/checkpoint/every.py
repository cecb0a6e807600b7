"""``checkpoint_every``: saving every n updates, at a stop, and at the end of the run's loop (``save_run_end``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import attrs

from trainfold.backend.loaders import is_resumable_loader
from trainfold.base.checks import name_of, named, positive_int
from trainfold.base.types import Batch
from trainfold.checkpoint import codec as _codec
from trainfold.checkpoint.save import flag, position_of, save_checkpoint, sharded_layout
from trainfold.checkpoint.storage import open_root
from trainfold.core.context import Context
from trainfold.core.cursor import EpochCursor
from trainfold.core.state import TrainState
from trainfold.core.types import Step, StepTransformer


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


@attrs.frozen
class RunEndSave:
    """The saving ``checkpoint_every`` composed for a run: what :func:`save_run_end` writes when its loop ends."""

    root: str
    keep_last: int | None
    sharded: bool | None
    async_save: bool
    storage_options: Mapping[str, Any] | None = None


def save_run_end(ctx: Context, state: TrainState) -> TrainState:
    """Checkpoint the state a run's loop ends with, where its ``checkpoint_every`` saves, unless that root holds it already.

    Called by ``loop``, ``repeat`` and ``until`` as they return (every process
    calls them): the normal end (``max_epochs``), an early stop, a stop agreed
    during an evaluation or between two epochs, a budget's end after the epoch
    functions evaluated it. The save is committed before it returns.
    """
    end = ctx.run_end_saves.get(state.run_id)
    if end is None:
        return state
    if ctx.saved_at.get(open_root(end.root, end.storage_options).key) != position_of(state):
        state = save_checkpoint(ctx, end.root, state, keep_last=end.keep_last, sharded=end.sharded, async_save=end.async_save,
                                storage_options=end.storage_options)
    ctx.wait_for_checkpoints()  # committed when the loop returns, whether this call submitted it or the step's own save did
    return state


def checkpoint_every(ctx: Context, root: str | os.PathLike[str], n: int, *, keep_last: int | None = None, sharded: bool | None = None,
                     async_save: bool = False, storage_options: Mapping[str, Any] | None = None) -> StepTransformer:
    """A step transformer that saves a checkpoint after every ``n``-th optimizer update, when the run stops, and when it ends.

    A final checkpoint is written after the step at which the run stops for any
    reason (``max_steps``, ``nan_guard``, or a signal such as Ctrl-C or SIGTERM,
    which ``run_epoch`` turns into a stop at the next step boundary agreed by
    every process), so an interrupted run loses nothing. The state a ``loop``
    (``repeat``, ``until``) ends with is saved there too, unless this root holds
    it already: the normal end of the run, a stop agreed during an evaluation
    or between epochs, and what the epoch functions after a budget's stop
    recorded. Starting a finished job again trains nothing.
    For checkpoints per epoch, compose ``save_checkpoint(ctx, root, keep_last=...)``
    after ``run_epoch`` instead (or ``every_epochs(k, save_checkpoint(...))``).
    ``sharded``, ``async_save`` and ``storage_options`` are ``save_checkpoint``'s (``root``
    may be a URL: ``s3://bucket/run``); with ``async_save`` the final checkpoint at a
    stop is committed before the step returns. A root that cannot be used (an unknown
    protocol, the store's package not installed) is refused here, not at the first save.

    Args:
        ctx: the run's Context.
        root: the folder (or ``s3://...`` URL) that holds the run's checkpoints.
        n: save after every ``n``-th optimizer update (a positive int).
        keep_last: after each commit, delete all but the newest ``keep_last`` checkpoints (never the
            newest finite one); None (the default) keeps every checkpoint.
        sharded: as :func:`save_checkpoint`'s: each process writes its own shard.
        async_save: write in the background while training goes on (:func:`save_checkpoint`).
        storage_options: options for the store's fsspec filesystem (a URL root only).

    Returns:
        A step transformer.

    Raises:
        ValueError: ``n`` or ``keep_last`` is not a positive int; ``storage_options`` for a local root.
        CheckpointError: a root that cannot be used (an unknown protocol, the store's package not
            installed), or another run's lock on it.

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> state = run_epoch(ctx, checkpoint_every(ctx, root, 2, keep_last=1)(make_step(ctx, loss_fn)), loader, state)
        >>> [p.name for p in list_checkpoints(root)]
        ['ckpt-0000000004']
    """
    positive_int("checkpoint_every", n)
    sharded_layout(ctx, sharded)  # wrong values refused now, not at the first save
    flag("async_save", async_save)
    open_root(root, storage_options)  # an unknown protocol, or the store's package missing, refused now
    interrupt = ctx.interrupt

    def transform(step: Step) -> Step:
        checked = [""]

        def saving(state: TrainState, batch: Batch) -> TrainState:
            if checked[0] != state.run_id:  # once per run: what would fail at the first save, refused at the first step
                _check_resumable(state, batch)
                ctx.run_end_saves[state.run_id] = RunEndSave(os.fspath(root), keep_last, sharded, async_save, storage_options)
                checked[0] = state.run_id
            new = step(state, batch)
            due = new.step != state.step and new.step % n == 0
            # a signal agreed at this micro-batch (run_epoch then stops here: the same answer)
            stopping = (new.should_stop and not state.should_stop) or (
                new.micro_step >= interrupt.next_check and interrupt.check(new.micro_step, ctx.accelerator.sync_gradients) != 0
            )
            if stopping:  # the run ends here: its last checkpoint is committed before the step returns
                saved = save_checkpoint(ctx, root, new, keep_last=keep_last, sharded=sharded, async_save=async_save, storage_options=storage_options)
                ctx.wait_for_checkpoints()
                return saved
            if due:
                return save_checkpoint(ctx, root, new, keep_last=keep_last, sharded=sharded, async_save=async_save, storage_options=storage_options)
            return new

        return named(saving, f"checkpoint_every({n})({name_of(step)})")

    return transform
