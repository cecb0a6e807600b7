"""fit: the common case in one call, composed from the public primitives (not a second implementation)."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

from toolz import compose

from trainfold._src.base.checks import length_or_none
from trainfold._src.base.types import Batch, LossFn
from trainfold._src.checkpoint.load import load_checkpoint
from trainfold._src.checkpoint.root import latest_checkpoint
from trainfold._src.checkpoint.save import save_checkpoint
from trainfold._src.compose.epoch import run_epoch
from trainfold._src.compose.epoch_fns import early_stop, log_epoch
from trainfold._src.compose.evaluate import evaluate
from trainfold._src.compose.loop import expect_epoch_fn, loop
from trainfold._src.compose.tracking import progress_bar
from trainfold._src.compose.transforms import log_every
from trainfold._src.core.checks import expect_args, expect_state
from trainfold._src.core.context import Context
from trainfold._src.core.stages import StageSpec
from trainfold._src.core.state import TrainState
from trainfold._src.core.step import make_step
from trainfold._src.core.types import EpochFn, StepTransformer


def fit(
    ctx: Context,
    loss_fn: LossFn,
    train_loader: Iterable[Batch],
    state: TrainState,
    *,
    max_epochs: int,
    eval_loader: Iterable[Batch] | None = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    patience: int | None = None,
    monitor: str = "eval_loss",
    mode: str = "auto",
    checkpoint_dir: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    keep_last: int | None = 3,
    resume: bool = True,
    log_every_n: int | None = None,
    progress: bool = True,
    echo: bool = True,
    stages: Sequence[StageSpec] = (),
    transforms: Sequence[StepTransformer] = (),
    epoch_fns: Sequence[EpochFn] = (),
) -> TrainState:
    """Train for up to ``max_epochs``: evaluate, stop early and checkpoint each epoch, as asked.

    It is exactly this composition (read bottom-up), and nothing more:

        step = progress_bar(log_every(compose(*transforms)(make_step(ctx, loss_fn, clip..., stages=stages))))
        epoch = compose(save_checkpoint(ctx, checkpoint_dir, keep_last=keep_last),
                        log_epoch(ctx, echo=echo), *reversed(epoch_fns),
                        early_stop(monitor, patience=patience, mode=mode),
                        evaluate(ctx, loss_fn, eval_loader),
                        run_epoch(ctx, step, train_loader))
        state = load_checkpoint(ctx, checkpoint_dir, state)   # if resume and one exists
        return loop(epoch, max_epochs)(state)

    where each optional piece is left out when its option is not given. A line
    per epoch is printed on the main process (``echo=False``: logged to the
    ``trainfold`` logger instead).
    ``stages`` act inside the step (``nan_guard(3)``; see :func:`make_step`);
    ``transforms`` wrap the step (the first outermost); ``epoch_fns`` run after
    early stopping, in order. The checkpoint is written last in each epoch, so it
    holds the epoch's metrics and the states of the epoch functions, and the
    run's last checkpoint is its end (at ``max_epochs`` or an early stop).
    ``checkpoint_dir`` may be a URL (``s3://bucket/run``), with ``storage_options``.

    Args:
        ctx: the run's Context.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``.
        train_loader: the training loader (prepared by ``ctx.prepare_loaders``).
        state: the state to train.
        max_epochs: the run's last epoch (of the whole run: a resumed run ends there too).
        eval_loader: evaluate on it after every epoch (``eval_loss``, ``eval_<aux>``).
        clip_grad_norm: as :func:`make_step`'s.
        clip_grad_value: as :func:`make_step`'s.
        patience: stop early after this many epochs without improvement of ``monitor`` (:func:`early_stop`).
        monitor: the history name early stopping watches.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from ``monitor``'s name).
        checkpoint_dir: save a checkpoint after every epoch there (a folder or a URL), and resume from it.
        storage_options: options for the store's fsspec filesystem (a URL ``checkpoint_dir`` only).
        keep_last: checkpoints to keep (3 by default; None keeps every one).
        resume: load the newest checkpoint of ``checkpoint_dir`` first, where there is one.
        log_every_n: report running means every ``n`` updates (:func:`log_every`).
        progress: show a progress bar (:func:`progress_bar`).
        echo: print each epoch's records (:func:`log_epoch`).
        stages: more stages for the step (:func:`make_step`'s ``stages``).
        transforms: step transformers, applied outermost first.
        epoch_fns: epoch functions run after each epoch's own (evaluation, early stopping, the checkpoint).

    Returns:
        The final state.

    Raises:
        TypeError: an argument in another's place (``fit(ctx, loss_fn, state, train_loader)``), or an
            epoch function that cannot be called as ``fn(state)`` (``epoch_fns=[early_stop]``, the factory
            not called), or a transform that is not callable: said at the call, in fit's words.
        ValueError: ``patience`` watching a name nothing records before early stopping; bad options of
            the functions it composes (named by them).
        CheckpointError: a checkpoint to resume from that is damaged or of another model.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = fit(ctx, loss_fn, loader, state, max_epochs=3, eval_loader=loader, patience=2, progress=False)
        epoch 1 (update 4): train_loss 2.37973  eval_loss 0.816404
        epoch 2 (update 8): train_loss 0.563212  eval_loss 0.200673
        epoch 3 (update 12): train_loss 0.141296  eval_loss 0.0557624
        >>> state.epoch, sorted(state.metrics)
        (3, ['eval_loss', 'train_loss'])
    """
    signature = "fit(ctx, loss_fn, train_loader, state, *, max_epochs=...)"
    expect_args("fit", signature, ctx, "loss_fn", loss_fn, train_loader)
    expect_state("fit", state)
    for fn in epoch_fns:
        expect_epoch_fn("fit(epoch_fns=[...])", fn)
    for transform in transforms:
        if not callable(transform):
            raise TypeError(
                f"fit(transforms=[...]) takes step transformers (step -> step); got {transform!r}, a {type(transform).__name__}."
            )
    if patience is not None and not (
        monitor.startswith("train_") or (eval_loader is not None and monitor.startswith(("eval_", "eval")))
    ):
        raise ValueError(
            f"fit: patience={patience} watches {monitor!r}, which nothing in this fit records before early stopping: "
            + (
                "pass eval_loader=... (evaluate records eval_loss and eval_<aux>), or monitor a train record such as "
                "monitor='train_loss'."
                if eval_loader is None
                else "the evaluation records 'eval_loss' and 'eval_<aux name>', the epoch 'train_loss' and 'train_<aux name>'; "
                "epoch_fns run after early stopping, so what they record cannot be monitored here."
            )
        )
    step = make_step(ctx, loss_fn, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value, stages=stages)
    if transforms:
        step = compose(*transforms)(step)
    if log_every_n is not None:
        step = log_every(ctx, log_every_n)(step)
    if progress:
        step = progress_bar(ctx, total=length_or_none(train_loader))(step)
    epoch_stages: list[EpochFn] = [run_epoch(ctx, step, train_loader)]
    if eval_loader is not None:
        epoch_stages.append(evaluate(ctx, loss_fn, eval_loader))
    if patience is not None:
        epoch_stages.append(early_stop(monitor, patience=patience, mode=mode))
    epoch_stages.extend(epoch_fns)
    epoch_stages.append(log_epoch(ctx, echo=echo))
    if checkpoint_dir is not None:
        # last: the checkpoint holds everything the epoch did, and what the epoch functions
        # drew from the random generators is behind it, so a resumed run continues exactly
        epoch_stages.append(save_checkpoint(ctx, checkpoint_dir, keep_last=keep_last, storage_options=storage_options))
    if (
        checkpoint_dir is not None
        and resume
        and latest_checkpoint(checkpoint_dir, storage_options=storage_options) is not None
    ):
        state = load_checkpoint(ctx, checkpoint_dir, state, storage_options=storage_options)
    return loop(compose(*reversed(epoch_stages)), max_epochs=max_epochs)(state)
