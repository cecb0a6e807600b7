"""``checkpoint_every``: saving every n updates and at a stop, and (``.at_end``, composed after the loop) at the run's end."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Mapping

import attrs

from trainfold._src.backend.loaders import not_resumable
from trainfold._src.base.checks import name_of, named, positive_int, user_stacklevel
from trainfold._src.base.types import Batch
from trainfold._src.checkpoint import codec as _codec
from trainfold._src.checkpoint.save import check_staging_budget, flag, position_of, save_checkpoint, sharded_layout
from trainfold._src.checkpoint.storage import open_root
from trainfold._src.core.context import Context
from trainfold._src.core.cursor import EpochCursor
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import Step
from trainfold.errors import CheckpointError

logger = logging.getLogger("trainfold")


def _check_resumable(state: TrainState, batch: Batch) -> None:
    """Refuse, at the first step, an epoch that a mid-epoch checkpoint could not record.

    Raises:
        TypeError: the loader is not prepared (``ctx.prepare_loaders``) or dispatches a map-style dataset, or the batch holds
            a value a checkpoint cannot hold (a custom object), named.
    """
    cursor = state.cursor
    if isinstance(cursor, EpochCursor) and (refused := not_resumable("checkpoint_every", cursor.loader)) is not None:
        raise refused
    try:
        _codec.Encoder().encode(batch, "batch")
    except TypeError as exc:
        raise TypeError(f"checkpoint_every: the loader's batches cannot be checkpointed mid-epoch: {exc}") from None


@attrs.frozen(eq=False)
class CheckpointEvery:
    """What :func:`checkpoint_every` returns: a step transformer, and :meth:`at_end`, the run's final save.

    Calling it on a step (``saving(step)``) gives the step that saves every ``n`` updates and at a stop
    inside an epoch. :meth:`at_end` is the epoch function that saves the state a loop ended with;
    compose it after the loop: ``compose(saving.at_end, loop(...))``. It holds the settings it was
    made with and nothing that changes.

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> saving = checkpoint_every(ctx, 2, tempfile.mkdtemp())
        >>> saving.n, callable(saving), saving.at_end(state).step
        (2, True, 0)
    """

    ctx: Context = attrs.field(repr=False)
    root: str
    n: int
    keep_last: int | None = None
    sharded: bool | None = None
    async_save: bool = False
    storage_options: Mapping[str, Any] | None = attrs.field(default=None, repr=False)
    save_frozen: bool = False
    best_effort: bool = False
    staging_budget: int | None = None

    def __call__(self, step: Step) -> Step:
        """The step that saves after every ``n``-th update and at a stop (see :func:`checkpoint_every`)."""
        ctx, n, interrupt, runtime = self.ctx, self.n, self.ctx.runtime.interrupt, self.ctx.runtime
        key = open_root(self.root, self.storage_options).key
        checked = ""  # the run whose first step was checked

        def saving(state: TrainState, batch: Batch) -> TrainState:
            nonlocal checked
            if checked != state.run_id:  # once per run: what would fail at the first save, refused at the first step
                _check_resumable(state, batch)
                self._first_step(key)
                checked = state.run_id
            new = step(state, batch)
            runtime.note_stepped(key, new)
            due = new.step != state.step and new.step % n == 0
            # a signal agreed at this micro-batch (run_epoch then stops here: the same answer)
            stopping = (new.should_stop and not state.should_stop) or (
                new.micro_step >= interrupt.next_check
                and interrupt.check(new.micro_step, ctx.accelerator.sync_gradients, new.step) != 0
            )
            if stopping:  # the run ends here: its last checkpoint is committed before the step returns
                saved = self._save(new)
                ctx.wait_for_checkpoints()
                return saved
            return self._save(new) if due else new

        return named(saving, f"checkpoint_every({n})({name_of(step)})")

    def at_end(self, state: TrainState) -> TrainState:
        """Commit a checkpoint of ``state`` (what a loop ended with) to the root, unless the root holds it already.

        Compose it after the loop, on every process: ``compose(saving.at_end, loop(...))``. It saves
        the normal end of the run (``max_epochs``), an early stop, a stop agreed during an evaluation
        or between two epochs, and what the epoch functions recorded after a budget's stop. A state
        this process already saved there, or loaded from there (a finished job started again), is
        not saved again. The save is committed before it returns, even with ``async_save``.

        Args:
            state: the state the run's loop returned.

        Returns:
            The state (as ``save_checkpoint`` returns it when it saves).
        """
        key = open_root(self.root, self.storage_options).key
        if self.ctx.runtime.last_stepped(key) is None:
            self.ctx.runtime.note_end_before_steps(key)
        if self.ctx.runtime.held_position(key) != position_of(state):
            state = self._save(state)
        self.ctx.wait_for_checkpoints()  # committed when this returns, whether this call submitted it or the step's own save did
        return state

    def _first_step(self, key: str) -> None:
        """At a run's first step: say that ``at_end`` ran before it (composed on the wrong side), and have the close say
        what the end of the run left unsaved (no ``at_end`` composed after the loop)."""
        runtime = self.ctx.runtime
        if runtime.ended_before_steps(key) and runtime.warn_once(f"at_end first:{key}") and self.ctx.is_main_process:
            warnings.warn(
                f"checkpoint_every({self.root!r}).at_end ran before its step trained anything: it saved the state the loop "
                "started from, and the loop's end will not be saved. Compose it after the loop: compose(saving.at_end, "
                "loop(...)) (compose applies right to left).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        if not self.best_effort and runtime.warn_once(f"unsaved end:{key}"):  # (a memory tier's end is not the point)
            runtime.at_close(lambda: self._say_unsaved(key))

    def _say_unsaved(self, key: str) -> None:
        runtime = self.ctx.runtime
        last, held = runtime.last_stepped(key), runtime.held_position(key)
        saved = held[0] if held is not None else 0  # the update of the checkpoint the root holds (position_of's first)
        if last is None or last.step <= saved or not self.ctx.is_main_process:
            return
        after = f"after update {saved}" if held is not None else "and none before them"
        logger.warning(
            "checkpoint_every(%r): the run's last %d update(s), %s, are not in a checkpoint: a restart trains "
            "them again. Compose saving.at_end after the loop to save the end: compose(saving.at_end, loop(...)).",
            self.root,
            last.step - saved,
            after,
        )

    def _save(self, state: TrainState) -> TrainState:
        if not self.best_effort:
            return self._save_now(state)
        self.ctx.wait_for_checkpoints()  # another root's background save: its error is its own, raised here
        try:
            return self._save_now(state)
        except OSError as exc:  # every process alike (a save agrees on its outcome): nothing committed, the run goes on
            if self.ctx.is_main_process:
                logger.error(
                    "checkpoint_every(%r, best_effort=True): the save at update %d failed and training goes on (the "
                    "checkpoints before it are intact): %s",
                    self.root,
                    state.step,
                    exc,
                )
            return state

    def _save_now(self, state: TrainState) -> TrainState:
        return save_checkpoint(
            self.ctx,
            self.root,
            state,
            keep_last=self.keep_last,
            sharded=self.sharded,
            async_save=self.async_save,
            staging_budget=self.staging_budget,
            storage_options=self.storage_options,
            save_frozen=self.save_frozen,
        )


def checkpoint_every(
    ctx: Context,
    n: int,
    root: str | os.PathLike[str],
    *,
    keep_last: int | None = None,
    sharded: bool | None = None,
    async_save: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    save_frozen: bool = False,
    best_effort: bool = False,
    staging_budget: int | None = None,
) -> CheckpointEvery:
    """A step transformer that saves a checkpoint after every ``n``-th optimizer update and when the run stops; ``.at_end`` saves the end.

    A final checkpoint is written after the step at which the run stops for any
    reason (``max_steps``, ``nan_guard``, or a signal such as Ctrl-C or SIGTERM,
    which ``run_epoch`` turns into a stop at the next step boundary agreed by
    every process), so an interrupted run loses nothing. The state a loop ends
    with is saved by the returned value's :meth:`~CheckpointEvery.at_end`,
    composed after the loop (unless this root holds it already): the normal end
    of the run, a stop agreed during an evaluation or between epochs, and what
    the epoch functions after a budget's stop recorded. Starting a finished job
    again trains and saves nothing:

        saving = checkpoint_every(ctx, 100, root)
        train = loop(compose(log_epoch(ctx), run_epoch(ctx, saving(step), train_dl)), max_epochs=10)
        state = compose(saving.at_end, train)(load_checkpoint(ctx, root, state, missing_ok=True))

    For checkpoints per epoch, compose ``save_checkpoint(ctx, root, keep_last=...)``
    after ``run_epoch`` instead (or ``every_epochs(k, save_checkpoint(...))``).
    ``sharded``, ``async_save``, ``staging_budget``, ``storage_options`` and ``save_frozen`` are ``save_checkpoint``'s (``root``
    may be a URL: ``s3://bucket/run``); with ``async_save`` the final checkpoint at a
    stop is committed before the step returns. A root that cannot be used (an unknown
    protocol, the store's package not installed) is refused here, not at the first save.

    The period comes right after the Context, as in every periodic name (``log_every(ctx, n)``,
    ``every_steps(n, fn)``); the order before, ``checkpoint_every(ctx, root, n)``, still works
    and warns.

    Args:
        ctx: the run's Context.
        n: save after every ``n``-th optimizer update (a positive int).
        root: the folder (or ``s3://...`` URL) that holds the run's checkpoints.
        keep_last: after each commit, delete all but the newest ``keep_last`` checkpoints (never the
            newest finite one); None (the default) keeps every checkpoint.
        sharded: as :func:`save_checkpoint`'s: each process writes its own shard.
        async_save: write in the background while training goes on (:func:`save_checkpoint`).
        storage_options: options for the store's fsspec filesystem (a URL root only).
        save_frozen: write a model's frozen parameters too, instead of their fingerprint (:func:`save_checkpoint`).
        best_effort: a tier beside a durable one (a memory tier, ``/dev/shm``): a save that fails with an
            ``OSError`` (the tier full) is logged as an error, nothing of it committed, and training goes on;
            closing the Context does not warn that the run's end is not in this root.
        staging_budget: with ``async_save``, the most host memory a background save's copy may take on a process
            (:func:`save_checkpoint`).

    Returns:
        The step transformer, a :class:`CheckpointEvery`, with :meth:`~CheckpointEvery.at_end` for the run's end.

    Raises:
        ValueError: ``n``, ``keep_last`` or ``staging_budget`` is not a positive int; ``storage_options`` for a
            local root; ``best_effort`` with ``async_save``; ``staging_budget`` without it.
        CheckpointError: a root that cannot be used (an unknown protocol, the store's package not
            installed, a bucket that does not exist, a folder that cannot be written), or another run's lock on it.

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> saving = checkpoint_every(ctx, 3, root)
        >>> state = saving.at_end(loop(run_epoch(ctx, saving(make_step(ctx, loss_fn)), loader), max_epochs=2)(state))
        >>> [p.name for p in list_checkpoints(root)]
        ['ckpt-0000000003', 'ckpt-0000000006', 'ckpt-0000000008']
    """
    n, root = _period_first(n, root)
    positive_int("checkpoint_every", n)
    if keep_last is not None:
        positive_int("keep_last", keep_last)
    sharded_layout(ctx, sharded)  # wrong values refused now, not at the first save
    flag("async_save", async_save)
    flag("save_frozen", save_frozen)
    flag("best_effort", best_effort)
    check_staging_budget(staging_budget, async_save, "checkpoint_every")
    if best_effort and async_save:
        raise ValueError(
            "checkpoint_every: best_effort=True saves blocking (async_save=False): a memory tier's writes are quick, and "
            "a failure of its save must be told apart from another root's background save."
        )
    # an unknown protocol, the store's package missing, a bucket that does not exist (one request): refused now, not at the first save
    reason = open_root(root, storage_options).unusable()
    if reason is not None:
        raise CheckpointError(
            f"checkpoint_every: {os.fspath(root)} cannot hold checkpoints: {reason}. Nothing was trained yet."
        )
    return CheckpointEvery(
        ctx,
        os.fspath(root),
        n,
        keep_last,
        sharded,
        async_save,
        storage_options,
        save_frozen,
        best_effort,
        staging_budget,
    )


def _period_first(n: Any, root: Any) -> tuple[Any, Any]:
    """``(n, root)``, also when given in the order before (``checkpoint_every(ctx, root, n)``), which warns."""
    if isinstance(root, int) and not isinstance(root, bool) and isinstance(n, (str, os.PathLike)):
        warnings.warn(
            f"checkpoint_every(ctx, root, n) is now checkpoint_every(ctx, n, root), the period first as in every periodic "
            f"name: write checkpoint_every(ctx, {root}, {os.fspath(n)!r}). The order before still works for now.",
            DeprecationWarning,
            stacklevel=user_stacklevel(),
        )
        return root, n
    return n, root
