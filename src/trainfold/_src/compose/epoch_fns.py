"""Epoch functions (``state -> state``): early stopping, save-best, LR on plateau, epoch logging.

Each is curried with the state last and keeps its state in
``state.extras`` under its name, so it is checkpointed with the run. Every
decision reads values from ``state.history``, which ``run_epoch`` and
``evaluate`` reduce over all processes: every process decides the same.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from typing import Any, Mapping, overload

import attrs
from safetensors.torch import load, save
from toolz import curry

from trainfold._src.backend.optim import inner_optimizer, set_lr
from trainfold._src.base.records import register_record
from trainfold._src.checkpoint.storage import read_object, write_object
from trainfold._src.compose.tracking import emit, epoch_key, summary_line
from trainfold._src.compose.transforms import LR_SCALE
from trainfold._src.core.checks import expect_owned, expect_state
from trainfold._src.core.context import Context
from trainfold._src.core.modes import eval_mode
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import EpochFn

logger = logging.getLogger("trainfold")

_MODES = ("auto", "min", "max")
#: words of a metric's name that say lower is better, and higher is better (``mode="auto"``, as Keras' ``"auto"``)
_LOWER = frozenset(
    {
        "loss",
        "error",
        "err",
        "errors",
        "perplexity",
        "ppl",
        "nll",
        "mse",
        "mae",
        "rmse",
        "mape",
        "wer",
        "cer",
        "ter",
        "distance",
        "regret",
    }
)
_HIGHER = frozenset(
    {
        "acc",
        "accuracy",
        "f1",
        "fscore",
        "auroc",
        "auc",
        "auprc",
        "ap",
        "map",
        "bleu",
        "rouge",
        "rouge1",
        "rouge2",
        "rougel",
        "meteor",
        "chrf",
        "precision",
        "recall",
        "iou",
        "miou",
        "dice",
        "r2",
        "mcc",
        "matthews",
        "jaccard",
        "em",
        "exact",
        "match",
        "top1",
        "top5",
        "ndcg",
        "mrr",
        "psnr",
        "ssim",
        "score",
        "reward",
        "return",
    }
)


def resolve_mode(metric: str, mode: str, where: str, state: TrainState | None = None) -> str:
    """``mode`` itself, or for ``"auto"`` the direction the metric's name says ("min" for a loss, "max" for an accuracy).

    With ``state``, a name that says no direction and was never recorded is reported as what it most likely is: a
    misspelt name (the recorded ones listed), not a missing ``mode``.

    Raises:
        KeyError: ``state`` given, the name says no direction and is not recorded.
        ValueError: an unknown mode, or ``"auto"`` with a name that says neither (or both).

    Examples:
        >>> resolve_mode("eval_loss", "auto", "early_stop"), resolve_mode("eval_accuracy", "auto", "early_stop")
        ('min', 'max')
    """
    if mode not in _MODES:
        raise ValueError(f"{where}: mode must be 'auto', 'min' or 'max' (got {mode!r}).")
    if mode != "auto":
        return mode
    words = set(re.split(r"[^a-z0-9]+", metric.lower()))
    lower, higher = bool(words & _LOWER), bool(words & _HIGHER)  # sync: none: sets of words
    if lower != higher:
        return "min" if lower else "max"
    if state is not None and metric not in state.history and len(state.history):
        raise _unrecorded(state, metric, where)
    raise ValueError(
        f"{where}: cannot tell from the name {metric!r} whether it improves by going down or up (mode='auto' knows losses, "
        "errors and perplexity as 'min', and accuracy, F1, AUROC, BLEU, precision, recall... as 'max'): pass mode='min' or "
        "mode='max'."
    )


def _latest(state: TrainState, metric: str, where: str) -> float:
    if metric not in state.history:
        raise _unrecorded(state, metric, where)
    return state.history.latest(metric)


def _unrecorded(state: TrainState, metric: str, where: str) -> KeyError:
    names = list(state.history.names)
    close = difflib.get_close_matches(metric, names, n=1)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    return KeyError(
        f"{where}: no {metric!r} has been recorded (recorded: {names}).{guess} Compose "
        f"it after the function that records it, e.g. compose({where}(...), evaluate(...), run_epoch(...))."
    )


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (a NaN never does)."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


@register_record
@attrs.frozen
class PatienceState:
    """Best value so far and epochs since it (``extras["early_stop:<metric>"]``, ``extras["plateau:<metric>"]``)."""

    best: float | None = None
    bad_epochs: int = 0

    def update(self, value: float, mode: str, min_delta: float) -> PatienceState:
        if improved(value, self.best, mode, min_delta):
            return PatienceState(value, 0)
        return PatienceState(self.best, self.bad_epochs + 1)


@overload
def early_stop(metric: str, *, patience: int = ..., mode: str = ..., min_delta: float = ...) -> EpochFn: ...
@overload
def early_stop(
    metric: str, state: TrainState, *, patience: int = ..., mode: str = ..., min_delta: float = ...
) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def early_stop(
    metric: str, state: TrainState, *, patience: int = 3, mode: str = "auto", min_delta: float = 0.0
) -> TrainState:
    """Stop the run (``state.stop``) when ``metric`` has not improved for ``patience`` epochs.

    Reads the latest ``state.history[metric]`` (so compose it after the
    ``evaluate`` that records it); keeps its best value and count in
    ``state.extras["early_stop:<metric>"]``. No exception is raised: ``loop``
    sees the stop and ends. The run is finished (``state.stop.finished``): resumed from its
    checkpoint, it stays stopped. An interrupted epoch (``state.interrupted``)
    is passed through: no epoch ended, so none is counted.

    ``mode="auto"`` (the default) takes the direction from the metric's name, as
    Keras' ``"auto"`` does: a loss, error or perplexity improves by going down,
    an accuracy, F1, AUROC, BLEU, precision or recall by going up; a name that
    says neither is refused (pass ``mode="min"`` or ``mode="max"``). The same
    holds for :func:`save_best` and :func:`reduce_lr_on_plateau`.

    Args:
        metric: the history name to watch (``"eval_loss"``).
        state: the state (curried: ``early_stop("eval_loss", patience=3)`` is an epoch function).
        patience: epochs without improvement before stopping.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the metric's name).
        min_delta: the least change that counts as an improvement.

    Returns:
        ``state`` with the count kept in ``extras``, stopped and ``finished`` once patience runs out.

    Raises:
        KeyError: ``metric`` has not been recorded (compose it after what records it).
        ValueError: an unknown ``mode``, or ``"auto"`` with a name that says no direction.

    Examples:
        >>> s = TrainState(model=None, optimizer=None, scheduler=None, accelerator=None)
        >>> for v in (1.0, 0.5, 0.6, 0.7):
        ...     s = early_stop("eval_loss", attrs.evolve(s, history=s.history.add(epoch=0, step=0, values={"eval_loss": v})), patience=2)
        >>> s.stop, s.extras["early_stop:eval_loss"]
        (Stop(reason='early_stop:eval_loss', final=False, finished=True), PatienceState(best=0.5, bad_epochs=2))
    """
    state = expect_state("early_stop", state)
    mode = resolve_mode(metric, mode, "early_stop", state)
    if state.interrupted or state.ended_mid_epoch:
        return state  # no epoch ended: nothing to count
    key = f"early_stop:{metric}"
    tracker: PatienceState = state.extras.get(key, PatienceState()).update(
        _latest(state, metric, "early_stop"), mode, min_delta
    )
    state = state.with_extra(key, tracker)
    return state.with_stop(key, finished=True) if tracker.bad_epochs >= patience else state


@register_record
@attrs.frozen
class BestState:
    """``extras["save_best:<metric>"]``: the best value, when it was reached, and where the weights are."""

    value: float
    epoch: int
    step: int
    path: str


@overload
def save_best(
    ctx: Context,
    path: str | os.PathLike[str],
    metric: str,
    *,
    mode: str = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> EpochFn: ...
@overload
def save_best(
    ctx: Context,
    path: str | os.PathLike[str],
    metric: str,
    state: TrainState,
    *,
    mode: str = ...,
    storage_options: Mapping[str, Any] | None = ...,
) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def save_best(
    ctx: Context,
    path: str | os.PathLike[str],
    metric: str,
    state: TrainState,
    *,
    mode: str = "auto",
    storage_options: Mapping[str, Any] | None = None,
) -> TrainState:
    """Save the model's weights to ``path`` (safetensors) whenever ``metric`` improves.

    The write is atomic (a temporary file renamed over ``path``; on a store, one
    object written at once: ``path`` may be ``s3://bucket/best.safetensors``, with
    ``storage_options``) and done by the main process; every process waits for it. ``state.extras["save_best:<metric>"]``
    records the best value, epoch and step. Put the weights back with
    :func:`restore_best`.

    Args:
        ctx: the run's Context.
        path: the safetensors file to write (a local path or a URL).
        metric: the history name to watch.
        state: the state (curried: the rest given, an epoch function).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the metric's name).
        storage_options: options for the store's fsspec filesystem (a URL only).

    Returns:
        ``state`` with ``extras["save_best:<metric>"]`` recording the best value, epoch and step.

    Raises:
        KeyError: ``metric`` has not been recorded.
        ValueError: an unknown ``mode``, or ``"auto"`` with a name that says no direction.
        OSError: the file could not be written (on every process: none is left waiting).

    Examples:
        >>> import os, tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "best.safetensors")
        >>> state = save_best(ctx, path, "eval_loss", evaluate(ctx, loss_fn, loader, state))
        >>> state.extras["save_best:eval_loss"].epoch, os.path.exists(path)
        (0, True)
    """
    state = expect_owned("save_best", ctx, expect_state("save_best", state))
    mode = resolve_mode(metric, mode, "save_best", state)
    key = f"save_best:{metric}"
    value = _latest(state, metric, "save_best")
    best: BestState | None = state.extras.get(key)
    if not improved(value, None if best is None else best.value, mode):
        return state
    with eval_mode(state.model, state.optimizer, no_grad=False):  # a schedule-free optimizer's eval weights
        weights = ctx.accelerator.get_state_dict(state.model)  # gathers sharded weights on every process
        cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()} if ctx.is_main_process else {}
    if ctx.is_main_process:
        write_object(path, save(cpu, metadata={"metric": metric, "value": repr(value)}), storage_options)
    ctx.wait_for_everyone()
    return state.with_extra(key, BestState(value, state.epoch, state.step, os.fspath(path)))


@overload
def restore_best(
    ctx: Context, path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = ...
) -> EpochFn: ...
@overload
def restore_best(
    ctx: Context, path: str | os.PathLike[str], state: TrainState, *, storage_options: Mapping[str, Any] | None = ...
) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def restore_best(
    ctx: Context, path: str | os.PathLike[str], state: TrainState, *, storage_options: Mapping[str, Any] | None = None
) -> TrainState:
    """Load the weights :func:`save_best` wrote into the state's model (in place) and return the state.

    Args:
        ctx: the run's Context.
        path: the file :func:`save_best` wrote.
        state: the state whose model receives the weights (curried: an epoch function).
        storage_options: options for the store's fsspec filesystem (a URL only).

    Returns:
        ``state``, its model holding the best weights.

    Raises:
        FileNotFoundError: nothing was saved at ``path``.
        RuntimeError: the file's tensors do not match the model (names or shapes).

    Examples:
        >>> import os, tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "best.safetensors")
        >>> best = save_best(ctx, path, "eval_loss", evaluate(ctx, loss_fn, loader, state))
        >>> weight = best.model.weight.detach().clone()
        >>> later = run_epoch(ctx, make_step(ctx, loss_fn), loader, best)
        >>> torch.equal(restore_best(ctx, path, later).model.weight, weight)
        True
    """
    state = expect_owned("restore_best", ctx, expect_state("restore_best", state))
    try:
        data = read_object(path, storage_options)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"restore_best: no weights at {os.fspath(path)!r}; save_best writes them when the metric improves."
        ) from None
    # Read on the CPU; load_state_dict copies into the parameters where they are.
    weights = load(data)
    ctx.accelerator.unwrap_model(state.model).load_state_dict(weights, strict=True)
    return state


@overload
def reduce_lr_on_plateau(
    metric: str,
    *,
    factor: float = ...,
    patience: int = ...,
    mode: str = ...,
    min_delta: float = ...,
    min_lr: float = ...,
) -> EpochFn: ...
@overload
def reduce_lr_on_plateau(
    metric: str,
    state: TrainState,
    *,
    factor: float = ...,
    patience: int = ...,
    mode: str = ...,
    min_delta: float = ...,
    min_lr: float = ...,
) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def reduce_lr_on_plateau(
    metric: str,
    state: TrainState,
    *,
    factor: float = 0.1,
    patience: int = 2,
    mode: str = "auto",
    min_delta: float = 0.0,
    min_lr: float = 0.0,
) -> TrainState:
    """Multiply the learning rate by ``factor`` when ``metric`` has not improved for ``patience`` epochs.

    Changes the optimizer's parameter groups in place (as a torch scheduler
    does) and records the accumulated factor in ``state.extras["lr_scale"]``,
    which :func:`~trainfold.lr_schedule` applies on top of its schedule.

    Args:
        metric: the history name to watch.
        state: the state (curried: the rest given, an epoch function).
        factor: the multiplier, in (0, 1).
        patience: epochs without improvement before each reduction.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the metric's name).
        min_delta: the least change that counts as an improvement.
        min_lr: no group's learning rate goes below it.

    Returns:
        ``state`` with the plateau count and ``extras["lr_scale"]`` updated.

    Raises:
        KeyError: ``metric`` has not been recorded.
        ValueError: ``factor`` outside (0, 1); an unknown ``mode``, or ``"auto"`` with a name that says no direction.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(lr=0.1)
        >>> for loss in (1.0, 1.0, 1.0):
        ...     state = attrs.evolve(state, history=state.history.add(epoch=0, step=0, values={"eval_loss": loss}))
        ...     state = reduce_lr_on_plateau("eval_loss", state, factor=0.5, patience=2)
        >>> state.optimizer.param_groups[0]["lr"], state.extras["lr_scale"]
        (0.05, 0.5)
    """
    state = expect_state("reduce_lr_on_plateau", state)
    mode = resolve_mode(metric, mode, "reduce_lr_on_plateau", state)
    if not 0.0 < factor < 1.0:
        raise ValueError(f"factor must be in (0, 1) (got {factor!r}).")
    if state.interrupted or state.ended_mid_epoch:
        return state  # no epoch ended (a budget's end changes no learning rate)
    key = f"plateau:{metric}"
    tracker: PatienceState = state.extras.get(key, PatienceState()).update(
        _latest(state, metric, "reduce_lr_on_plateau"), mode, min_delta
    )
    if tracker.bad_epochs < patience:
        return state.with_extra(key, tracker)
    for group in inner_optimizer(state.optimizer).param_groups:
        lr = float(group["lr"])  # sync: once per epoch; a compiled update's lr is a CPU tensor
        set_lr(group, max(lr * factor, min_lr))
    return state.with_extra(key, attrs.evolve(tracker, bad_epochs=0)).with_extra(
        LR_SCALE, state.extras.get(LR_SCALE, 1.0) * factor
    )


@overload
def log_epoch(ctx: Context, *, echo: bool = ..., axis: str = ...) -> EpochFn: ...
@overload
def log_epoch(ctx: Context, state: TrainState, *, echo: bool = ..., axis: str = ...) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def log_epoch(ctx: Context, state: TrainState, *, echo: bool = True, axis: str = "update") -> TrainState:
    """Print the epoch's records, and send them to the trackers, on the main process.

    The printed line names the records as the history does (``train_loss``,
    ``eval_loss``); the trackers get them as ``train/loss_epoch``, ``eval/loss``
    (the ``train/loss`` of :func:`~trainfold.log_every` is the running value
    between its reports, so an epoch's mean of the train loss gets its own name). With
    ``echo=False`` nothing is printed and the line goes to the ``trainfold``
    logger at INFO instead, for a host that configures logging.

    The trackers' step axis is the optimizer update (``state.step``, ``axis="update"``,
    the default: the axis ``log_every`` reports on too, so both share one x axis);
    ``axis="epoch"`` sends the epoch records at the epoch number instead (one point
    per epoch, as Accelerate's examples log them).

    Args:
        ctx: the run's Context.
        state: the state whose latest records to log (curried: ``log_epoch(ctx)`` is an epoch function).
        echo: print the line (True), or send it to the ``trainfold`` logger at INFO (False).
        axis: ``"update"`` (the default) or ``"epoch"``: the trackers' step for these records.

    Returns:
        ``state``, unchanged.

    Raises:
        ValueError: an unknown ``axis``.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
        >>> log_epoch(ctx, state).epoch
        epoch 1 (update 4): train_loss 2.37973
        1
    """
    state = expect_state("log_epoch", state)
    if axis not in ("update", "epoch"):
        raise ValueError(
            f"log_epoch: axis must be 'update' (the records at state.step) or 'epoch' (at state.epoch), not {axis!r}."
        )
    at = state.step if axis == "update" else state.epoch
    reason = state.stop.reason if state.stop is not None else ""
    if state.interrupted:
        if ctx.is_main_process:
            logger.warning(
                "stopped in epoch %d at batch %d (update %d): %s.",
                state.epoch + 1,
                state.batch_in_epoch,
                state.step,
                reason or "stop set",
            )
        return state
    if state.ended_mid_epoch:  # a budget's end: what was recorded for the final model
        values = dict(state.metrics)
        emit(ctx, {epoch_key(k): v for k, v in values.items()}, at, log=False)
        if ctx.is_main_process:
            line = f"stopped in epoch {state.epoch + 1} at update {state.step} ({reason}):" + "".join(
                f"  {k} {v:.6g}" for k, v in values.items()
            )
            print(line, flush=True) if echo else logger.info("%s", line)
        return state
    values = {r.name: r.value for r in state.history if r.epoch == state.epoch}
    done = float(state.epoch)  # sync: none: a host int
    emit(ctx, {epoch_key(k): v for k, v in {**values, "epoch": done}.items()}, at, log=False)
    if ctx.is_main_process:
        if echo:
            print(summary_line(state, values), flush=True)
        else:
            logger.info("%s", summary_line(state, values))
    return state
