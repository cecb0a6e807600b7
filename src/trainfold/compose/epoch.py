"""Folds over a loader: run_epoch, evaluate, predict (curried, state last)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable, Mapping, cast, overload

import attrs
import torch
from toolz import curry

from trainfold.backend.engine import (
    abandon_epoch,
    dropped_samples,
    is_resumable_loader,
    loader_generators,
    real_samples_in_batch,
    resumed_by_samples,
    resumed_epoch,
    samples_per_batch,
    set_loader_epoch,
)
from trainfold.base import rng
from trainfold.base.batch import batch_size, describe_batch, slice_batch
from trainfold.base.checks import add_note, length_or_none
from trainfold.base.metrics import RunningSums, weighted
from trainfold.base.types import Batch, LossFn
from trainfold.core.checks import expect_args, expect_owned, expect_shared_out, expect_state
from trainfold.core.context import Context
from trainfold.core.cursor import EpochCursor, Resume
from trainfold.core.loss import compute_loss
from trainfold.core.modes import eval_mode, train_mode
from trainfold.core.state import TrainState
from trainfold.core.step import normalize_mode
from trainfold.core.tokens import LOSS_WEIGHT, TOKENS
from trainfold.core.types import EpochFn, Step
from trainfold.distributed.control import check_same_count, check_same_length, explaining_timeouts
from trainfold.distributed.interrupt import signal_name


def _empty_loader(where: str, loader: Any) -> ValueError:
    return ValueError(
        f"{where}: the loader yielded no batches ({type(loader).__name__} over a dataset of "
        f"{_len_or_unknown(getattr(loader, 'dataset', None))} samples). Check the dataset is not empty "
        "and that batch_size is not larger than the dataset with drop_last=True."
    )


def _len_or_unknown(x: Any) -> str:
    n = length_or_none(x)
    return "an unknown number of" if n is None else str(n)


@overload
def run_epoch(ctx: Context, step: Step, loader: Iterable[Batch], *, max_batches: int | None = ...) -> EpochFn: ...
@overload
def run_epoch(ctx: Context, step: Step, loader: Iterable[Batch], state: TrainState, *, max_batches: int | None = ...) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def run_epoch(ctx: Context, step: Step, loader: Iterable[Batch], state: TrainState, *, max_batches: int | None = None) -> TrainState:
    """Train for one epoch: fold ``step`` over ``loader``.

    Per epoch::

        model.train(); optimizer.train()       # the latter where it has modes (schedule-free)
        for batch in loader:                   # to exhaustion, as a plain for loop
            state = step(state, batch)
            if state.should_stop:              # max_steps, nan_guard, a signal...
                return state                   # the epoch stays open: state.interrupted
        record train_loss (and train_<aux>): running sums reduced over processes, once
        epoch + 1, batch_in_epoch = 0, running sums reset

    Curried with the state last: ``run_epoch(ctx, step, loader)`` is an epoch function.

    A stop before the loader's end leaves the epoch open: ``state.epoch`` is
    unchanged, ``state.batch_in_epoch`` is where it stopped, ``state.interrupted``
    is set (the epoch-level functions composed after this one pass the state
    through) and a checkpoint of it continues the epoch. So does ``run_epoch``
    on it, over the same loader, once ``should_stop`` is cleared.

    The Context's signals (SIGINT, SIGTERM) are a request to stop at the next
    step boundary, agreed by every process (see :mod:`trainfold.interrupt`). On several processes it first checks, with one
    all-gather on the control channel, that every process has as many batches
    (a loader of unknown length is checked at its end), so that uneven data
    fails on every process instead of hanging in a collective.

    Args:
        ctx: the run's Context.
        step: a Step, from :func:`make_step` and step transformers.
        loader: a loader prepared with ``ctx.prepare_loaders``.
        state: the state to continue from.
        max_batches: end the epoch after this many batches (smoke tests; what
            pytorch-accelerated calls limiting batches). The loader is not
            exhausted, so an unfinished accumulation group carries over.

    Returns:
        The state after the epoch; ``state.history["train_loss"]`` has the epoch's
        mean batch loss over all processes.

    Raises:
        ValueError: the loader yielded no batches; the processes have different
            numbers of batches.
        RuntimeError: a loader of unknown length ended on this process but not on
            the others.

    Example:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
        >>> state.epoch, state.step, "train_loss" in state.history
        (1, 4, True)

    .. versionadded:: 0.1.0
    """
    state = _checked("run_epoch(ctx, step, loader, state)", ctx, "step", step, loader, state)
    _check_accumulation(ctx, loader)
    train_mode(state.model, state.optimizer)
    length = length_or_none(loader)
    distributed = ctx.accelerator.num_processes > 1
    if distributed:
        check_same_length(ctx.control, length, "run_epoch")
    state = attrs.evolve(state, cursor=_start_epoch(ctx, state, loader))
    iterator = state.cursor.iterator
    seen = 0
    limit = max_batches if max_batches is not None else -1
    interrupt = ctx.interrupt
    acc = ctx.accelerator
    with explaining_timeouts(ctx.accelerator.num_processes):
        for batch in iterator:
            state = step(state, batch)
            seen += 1
            if state.micro_step >= interrupt.next_check and (signum := interrupt.check(state.micro_step, acc.sync_gradients)):
                state = state.with_stop(f"signal {signal_name(signum)}")
                interrupt.clear()  # honoured: the next run on this Context is not stopped by it
            if state.batch_in_epoch == limit or state.end_of_epoch:
                abandon_epoch(iterator, loader)
                break
            if state.should_stop:
                # The epoch stays open: its position is kept (a checkpoint continues it, as does a
                # later run_epoch). After a preemption (a signal, nan_guard) the epoch-level functions
                # after this one pass it through; a final stop (a budget) is the run's own end, which they evaluate.
                return attrs.evolve(state, cursor=attrs.evolve(state.cursor, interrupted=not state.final_stop))
        else:
            if distributed and length is None:
                check_same_count(ctx.control, state.batch_in_epoch, wait_s=max(10 * ctx.stop_check_s, 20 * interrupt.seconds_per_batch()))
    if seen == 0 and state.batch_in_epoch == 0:
        raise _empty_loader("run_epoch", loader)
    return end_epoch(ctx, state)


def _checked(signature: str, ctx: Any, fn_name: str, fn: Any, loader: Any, state: Any) -> TrainState:
    """What every loop over a loader checks first, once per call: the arguments' places, the state and
    its Context, a loader each process reads its share of, and Accelerate's settings unchanged."""
    where = signature.split("(", 1)[0]
    expect_args(where, signature, ctx, fn_name, fn, loader)
    checked = expect_owned(where, ctx, expect_state(where, state))
    expect_shared_out(where, ctx, loader)
    ctx.check()
    if checked.model is not None and checked.model in ctx.released:
        raise ValueError(
            f"{where}: this state's objects were given back with ctx.release(state): the Accelerator no longer knows its model "
            "and optimizer. Train a new state (TrainState.create), or load a checkpoint of this one into a new state."
        )
    return checked


def _check_every_sample(where: str, loader: Any) -> None:
    """Refuse a loader that drops samples (``drop_last=True``): evaluating promises every sample exactly once."""
    dropped = dropped_samples(loader)
    if dropped:
        total = length_or_none(getattr(getattr(loader, "base_dataloader", loader), "dataset", None))
        raise ValueError(
            f"{where}: the loader drops the last {dropped} of {total} samples every epoch (drop_last=True), so the result would "
            f"not be over the whole dataset. Build the evaluation loader with drop_last=False: trainfold counts each sample "
            "once whatever the last batch's size (Accelerate's padding included)."
        )


def _check_per_sample(name: str, args: tuple[Any, ...], samples: int, batch: Any) -> None:
    """Refuse outputs whose first dimension is not the batch's samples: the padding of the last round is dropped by sample."""
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor) and (value.ndim == 0 or value.shape[0] != samples):
            shape = tuple(value.shape)
            raise ValueError(
                f"{name}: fn returned, as argument {i} of update, a tensor of shape {shape} for a batch of {samples} samples "
                f"({describe_batch(batch)}): each output must have the batch's samples as its first dimension, so that the "
                "padding Accelerate adds to the last round is dropped by sample (a flattened (batch*tokens,) tensor would be cut "
                "to the sample count). Return per-sample tensors, such as (batch, tokens) predictions and targets, and flatten "
                "or mask them inside the metric."
            )


def _check_accumulation(ctx: Context, loader: Any) -> None:
    batches = length_or_none(loader)
    steps = ctx.gradient_accumulation_steps
    if batches is not None and 0 < batches < steps:
        raise ValueError(
            f"run_epoch: the loader has {batches} batches per epoch but gradient_accumulation_steps={steps}: "
            f"each update would sum {batches} batches' gradients divided by {steps}, a silently smaller step. "
            f"Use at most {batches} accumulation steps, or smaller batches."
        )


def _start_epoch(ctx: Context, state: TrainState, loader: Iterable[Batch]) -> EpochCursor:
    """The epoch's cursor: its iterator, and the random state it starts from (what a checkpoint needs to replay it).

    A state from ``load_checkpoint`` continues its interrupted epoch: see
    :func:`trainfold._backend.resumed_epoch`, and on another number of
    processes :func:`trainfold._backend.resumed_by_samples`.
    """
    cursor = state.cursor
    if isinstance(cursor, EpochCursor) and cursor.iterator is not None and state.batch_in_epoch > 0:
        if cursor.loader is not loader:
            raise ValueError(
                "run_epoch: the state stopped in the middle of an epoch over another loader: continue it with the "
                "same loader (or save a checkpoint and resume from it, or start from a state between epochs)."
            )
        return attrs.evolve(cursor, interrupted=False)  # an epoch stopped in this process: it goes on
    resume = cursor if isinstance(cursor, Resume) else None
    generators = loader_generators(loader)
    if resume is None:
        return EpochCursor(iter(loader), loader, rng.capture(generators))  # ~60 us, once per epoch
    if not is_resumable_loader(loader):
        raise TypeError(
            "run_epoch: to continue a run from a checkpoint, the loader must be prepared with "
            f"ctx.prepare_loaders (got a {type(loader).__name__})."
        )
    _warn_if_global_batch_changed(ctx, resume, loader)
    by_samples = resume.elastic or resume.by_samples
    if state.batch_in_epoch > 0 and not by_samples and resume.epoch_length is not None and length_or_none(loader) not in (None, resume.epoch_length):
        raise ValueError(
            f"run_epoch: the interrupted epoch had {resume.epoch_length} batches, this loader has {length_or_none(loader)}: "
            "the data or the batch size changed, so the run cannot continue where it stopped. Resume with the "
            "same dataset and loader settings, or finish the epoch boundary first (resume from a checkpoint "
            "taken between epochs)."
        )
    _check_position(state, resume, loader)
    set_loader_epoch(loader, state.epoch)
    restore = rng.restore_loosely if resume.elastic else rng.restore  # another layout may hold other loader generators
    if state.end_of_epoch and state.batch_in_epoch > 0:
        # Saved after a step ended the epoch (stop_when(end="epoch")), before run_epoch closed it: close it now,
        # at the random state the uninterrupted run leaves its loader with.
        restore(resume.now, generators)
        return EpochCursor(iter(()), loader, None)
    if state.batch_in_epoch == 0 or resume.epoch_start is None:
        restore(resume.now, generators)
        return EpochCursor(iter(loader), loader, rng.capture(generators))
    epoch_start = resume.epoch_start
    if by_samples:
        assert resume.samples_done is not None  # load_checkpoint refuses a checkpoint without it
        iterator = resumed_by_samples(
            loader,
            resume.samples_done,
            epoch_start.generators,
            restore_epoch_start=lambda: restore(epoch_start, generators),
            restore_now=lambda: restore(resume.now, generators),
        )
        return EpochCursor(iterator, loader, epoch_start, resumed_at=(resume.samples_done, state.batch_in_epoch))
    iterator = resumed_epoch(
        loader,
        state.batch_in_epoch,
        resume.read_ahead,
        restore_epoch_start=lambda: rng.restore(epoch_start, generators),
        restore_now=lambda: rng.restore(resume.now, generators),
    )
    return EpochCursor(iterator, loader, epoch_start)


def _check_position(state: TrainState, resume: Resume, loader: Any) -> None:
    """Refuse a checkpoint whose position in the epoch lies past the loader's end (a damaged or hostile counter)."""
    if state.batch_in_epoch == 0:
        return
    if resume.elastic or resume.by_samples:
        total = length_or_none(getattr(getattr(loader, "base_dataloader", loader), "dataset", None))
        if resume.samples_done is not None and total is not None and resume.samples_done > total:
            raise ValueError(
                f"run_epoch: the checkpoint says {resume.samples_done} samples of this epoch were trained, but the dataset has "
                f"{total}: its position does not belong to this data. Resume with the dataset it was trained on."
            )
        return
    batches = length_or_none(loader)
    if batches is not None and state.batch_in_epoch > batches:
        raise ValueError(
            f"run_epoch: the checkpoint stopped at batch {state.batch_in_epoch} of its epoch, but this loader has {batches} "
            "batches per epoch: its position does not belong to this data (a damaged or altered checkpoint, or another "
            "dataset). Resume with the data and loader it was trained on."
        )


def _warn_if_global_batch_changed(ctx: Context, resume: Resume, loader: Any) -> None:
    """Warn, with the numbers, when a resumed run trains with another global batch than the run that saved."""
    if resume.saved_layout is None:
        return
    processes, per_batch, steps = resume.saved_layout
    now_per_batch, now_steps = samples_per_batch(loader), ctx.gradient_accumulation_steps
    if per_batch is None or now_per_batch is None or per_batch * steps == now_per_batch * now_steps:
        return
    warnings.warn(
        f"run_epoch: the checkpoint was trained with a global batch of {per_batch * steps} samples per update "
        f"({processes} process(es), {per_batch} samples per batch over all of them, gradient_accumulation_steps={steps}); "
        f"this run's is {now_per_batch * now_steps} ({ctx.accelerator.num_processes} process(es), {now_per_batch} samples "
        f"per batch, gradient_accumulation_steps={now_steps}). The schedules go on counting updates, each now over "
        "another number of samples. To keep the global batch, make processes x batch_size x gradient_accumulation_steps "
        f"equal {per_batch * steps}.",
        UserWarning,
        stacklevel=4,
    )


def end_epoch(ctx: Context, state: TrainState) -> TrainState:
    """Close the current epoch: record its train metrics, count it, reset the running sums."""
    means = state.sums.means(ctx.accelerator, state.batch_in_epoch)
    _warn_if_diverged(ctx, state, means.get("loss"))
    history = state.history.add(
        epoch=state.epoch + 1, step=state.step, values={f"train_{k}": v for k, v in means.items()}
    )
    return attrs.evolve(
        state,
        epoch=state.epoch + 1,
        batch_in_epoch=0,
        end_of_epoch=False,
        sums=state.sums.reset(ctx.accelerator.device),
        history=history,
        # Between epochs the cursor keeps the loader (no iteration): a checkpoint taken now
        # records the state of the loader's own random generators.
        cursor=EpochCursor(None, state.cursor.loader, None) if isinstance(state.cursor, EpochCursor) else None,
    )


def _warn_if_diverged(ctx: Context, state: TrainState, loss: float | None) -> None:
    """A NaN or infinite epoch loss without nan_guard: said once per run (the run goes on; the user decides)."""
    if loss is None or math.isfinite(loss) or f"diverged:{state.run_id}" in ctx.flags:
        return
    ctx.flags.add(f"diverged:{state.run_id}")
    if ctx.is_main_process:
        warnings.warn(
            f"run_epoch: epoch {state.epoch + 1}'s train_loss is {loss} (update {state.step}): the run has diverged and every "
            "update since is wasted. Lower the learning rate, clip (make_step(..., clip_grad_norm=1.0)), or skip such batches "
            "with make_step(..., stages=[nan_guard(3)]); save_checkpoint's keep_last keeps the newest checkpoint of finite "
            "weights to resume from. Said once per run.",
            RuntimeWarning,
            stacklevel=4,
        )


@overload
def evaluate(ctx: Context, loss_fn: LossFn, loader: Iterable[Batch], *, prefix: str = ..., model: torch.nn.Module | Callable[[TrainState], torch.nn.Module] | None = ..., max_batches: int | None = ..., normalize: str = ...) -> EpochFn: ...
@overload
def evaluate(ctx: Context, loss_fn: LossFn, loader: Iterable[Batch], state: TrainState, *, prefix: str = ..., model: torch.nn.Module | Callable[[TrainState], torch.nn.Module] | None = ..., max_batches: int | None = ..., normalize: str = ...) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def evaluate(
    ctx: Context,
    loss_fn: LossFn,
    loader: Iterable[Batch],
    state: TrainState,
    *,
    prefix: str = "eval",
    model: torch.nn.Module | Callable[[TrainState], torch.nn.Module] | None = None,
    max_batches: int | None = None,
    normalize: str = "mean",
) -> TrainState:
    """Evaluate: the exact mean loss and aux metrics over every sample of ``loader``.

    Per batch, in eval mode under ``torch.no_grad()`` (the model's training
    mode is restored after; an optimizer with modes, schedule-free's, is put in
    eval mode too when ``state.model`` is evaluated, and back)::

        n = real samples in the batch (padding of the last round excluded)
        loss, aux = loss_fn(model, batch[:n])
        sums += n * (loss, aux)                # on the device, in float64
        count += n
    then one reduction over processes: ``{prefix}_loss = sum / count``.

    A state from a ``run_epoch`` that stopped mid-epoch (``state.interrupted``)
    is passed through unevaluated. A signal that arrives during the evaluation
    (SIGINT, SIGTERM: the Context's) lets it finish and returns the state
    stopped, on every process.

    Every sample is counted once, however the last batch falls: under
    Accelerate's ``even_batches`` padding, each process drops its padded
    samples before calling ``loss_fn`` (a process whose whole last batch is
    padding still runs the model, so collective forwards stay matched, and
    weights it 0). The loss and aux values must be batch means.

    Args:
        ctx: the run's Context.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)`` (batch means).
        loader: a loader prepared with ``ctx.prepare_loaders`` (use ``shuffle=False``).
        state: the state to record into.
        prefix: the names' prefix: ``{prefix}_loss``, ``{prefix}_{aux name}``.
        model: evaluate this model instead of ``state.model``, or a function of the
            state that returns one (``model=ema_model`` for the :func:`ema` average).
        max_batches: stop after this many batches.
        normalize: ``"mean"`` (the default): the loss and aux values are batch means,
            weighted by samples. ``"tokens"``: the loss function is the one of
            ``make_step(normalize="tokens")``, returning the *sum* of the token losses and
            ``aux["tokens"]``; ``{prefix}_loss`` is then all token losses over all real
            tokens of the dataset (``exp`` of it is the perplexity).

    Returns:
        The state with the metrics appended to ``state.history`` (at the
        current epoch and step); nothing else changes.

    Example:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = evaluate(ctx, loss_fn, loader, state)
        >>> round(state.metrics["eval_loss"], 4)
        3.4648

    .. versionadded:: 0.1.0
    """
    state = _checked("evaluate(ctx, loss_fn, loader, state)", ctx, "loss_fn", loss_fn, loader, state)
    _check_every_sample("evaluate", loader)
    if state.interrupted:
        return state  # composed after a run_epoch that stopped mid-epoch: no epoch to evaluate
    by_tokens = normalize_mode(normalize, "evaluate") == "tokens"
    net = state.model if model is None else model if isinstance(model, torch.nn.Module) else model(state)
    acc = ctx.accelerator
    precision = torch.float32 if acc.device.type == "mps" else torch.float64  # MPS has no float64
    sums = RunningSums.zero(acc.device, dtype=precision)
    count = 0
    batches = 0
    interrupt = ctx.interrupt
    with explaining_timeouts(ctx.accelerator.num_processes), eval_mode(net, state.optimizer if net is state.model else None):
        for batch in loader:
            batches += 1
            n = batch_size(batch)
            real = real_samples_in_batch(acc, n)
            loss, aux = compute_loss(loss_fn, net, slice_batch(batch, real) if 0 < real < n else batch, need_grad=False)
            # A batch of padding only (real == 0) still ran the model, so collective forwards stay
            # matched, and adds zeros under the same names, so every process reduces the same shape.
            recorded = {k: weighted(v, real, precision) for k, v in aux.items() if not (by_tokens and k == TOKENS)}  # a count: the loss's weight
            if by_tokens:  # the loss is a sum over the batch's tokens: a per-token mean weighted by them
                tokens = weighted(_tokens_of(aux), 1 if real else 0, precision)
                loss, recorded[LOSS_WEIGHT] = weighted(loss, 1 if real else 0, precision) / tokens.clamp(min=1), tokens
            else:
                loss = weighted(loss, real, precision)
            sums = sums.add(loss, recorded)
            count += real
            if batches == max_batches:
                break
    if batches == 0:
        raise _empty_loader("evaluate", loader)
    values = {f"{prefix}_{k}": v for k, v in sums.means(acc, count).items()}
    state = attrs.evolve(state, history=state.history.add(epoch=state.epoch, step=state.step, values=values))
    signum = interrupt.agree_now()  # a signal during the evaluation: the run stops after it, on every process
    if signum:
        interrupt.clear()
        return state.with_stop(f"signal {signal_name(signum)}")
    return state


def _tokens_of(aux: Mapping[str, torch.Tensor]) -> torch.Tensor:
    tokens = aux.get(TOKENS)
    if tokens is None:
        raise ValueError(
            "evaluate(normalize='tokens') needs loss_fn to return (summed_loss, {'tokens': n}) with n the number of "
            "real (non-padding) tokens of the batch, as make_step(normalize='tokens') does."
        )
    return tokens


@overload
def evaluate_metrics(ctx: Context, metrics: Mapping[str, Any], fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch], *,
                     prefix: str = ...) -> EpochFn: ...
@overload
def evaluate_metrics(ctx: Context, metrics: Mapping[str, Any], fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch],
                     state: TrainState, *, prefix: str = ...) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def evaluate_metrics(ctx: Context, metrics: Mapping[str, Any], fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch],
                     state: TrainState, *, prefix: str = "eval") -> TrainState:
    """Metrics that are not batch means (F1, AUROC, BLEU...): update metric objects over ``loader`` and record their values.

    A metric is a torchmetrics ``Metric``, any object with ``update(...)``,
    ``compute()`` and ``reset()``, or a Hugging Face ``evaluate`` metric (what
    Accelerate's examples use: ``add_batch(predictions=..., references=...)`` and
    ``compute()``, which resets it). For each batch ``fn(model, batch)`` returns
    the arguments of ``update``: a tuple (``(preds, target)``) or one tensor.
    They are gathered from every process with ``gather_for_metrics`` (the
    padding of the last round dropped), and every process updates its metrics
    with all of them: each process computes each metric over every sample of the
    dataset exactly once, and a torchmetrics metric's own sync is turned off for
    the ``compute`` (its inputs are already everyone's). Each value is recorded
    in the history as ``<prefix>_<name>`` (a float), or, when ``compute`` returns a
    dict (``evaluate``'s ``{"accuracy": ..., "f1": ...}``, a ``MetricCollection``), one
    record per key, ``<prefix>_<key>``; then the metric is reset.
    In eval mode under ``torch.no_grad()``; a state stopped in the middle of an
    epoch is passed through, as by :func:`evaluate`.

    Args:
        ctx: the run's Context.
        metrics: the metric objects, by name.
        fn: ``fn(model, batch)`` returning the arguments of ``update``: tensors whose first
            dimension is the batch's samples (per-token outputs as ``(batch, tokens)``, not
            flattened), or non-tensor values.
        loader: a prepared loader.
        state: the state whose model is evaluated.
        prefix: the records' prefix.

    Returns:
        The state with the values appended to ``state.history``.

    Raises:
        TypeError: a metric without ``update``, ``compute`` and ``reset``, or one whose
            ``compute`` returns more than one number.
        ValueError: an output tensor whose first dimension is not the batch's samples; a
            loader that drops samples (``drop_last=True``).

    Example:
        >>> from trainfold import testing
        >>> class MaxError:  # any object with update, compute and reset
        ...     def __init__(self): self.worst = 0.0
        ...     def update(self, preds, target): self.worst = max(self.worst, (preds - target).abs().max().item())
        ...     def compute(self): return self.worst
        ...     def reset(self): self.worst = 0.0
        >>> ctx, state, loader, _ = testing.tiny_setup(seed=0)
        >>> state = evaluate_metrics(ctx, {"max_error": MaxError()}, lambda m, b: (m(b[0]), b[1]), loader, state)
        >>> round(state.metrics["eval_max_error"], 4)
        3.5974

    .. versionadded:: 0.2.0
    """
    state = _checked("evaluate_metrics(ctx, metrics, fn, loader, state)", ctx, "fn", fn, loader, state)
    for name, metric in metrics.items():
        if not (_has(metric, "update", "compute", "reset") or _has(metric, "add_batch", "compute")):
            raise TypeError(
                f"evaluate_metrics: metric {name!r} is a {type(metric).__name__}, which has neither update, compute and reset "
                "(torchmetrics) nor add_batch and compute (Hugging Face evaluate)."
            )
    _check_every_sample("evaluate_metrics", loader)
    if state.interrupted:
        return state
    acc = ctx.accelerator
    batches = 0
    with explaining_timeouts(ctx.accelerator.num_processes), eval_mode(state.model, state.optimizer):
        for batch in loader:
            batches += 1
            try:
                args = fn(state.model, batch)
            except Exception as exc:
                add_note(exc, f"trainfold: raised by evaluate_metrics' fn on a batch of structure {describe_batch(batch)}")
                raise
            args = args if isinstance(args, tuple) else (args,)
            _check_per_sample("evaluate_metrics", args, batch_size(batch), batch)
            args = acc.gather_for_metrics(args)
            for name, metric in metrics.items():
                _feed(name, metric, args)
    if batches == 0:
        raise _empty_loader("evaluate_metrics", loader)
    values: dict[str, float] = {}
    for name, metric in metrics.items():
        computed = _computed(name, metric)
        named_values = {f"{prefix}_{name}": computed} if isinstance(computed, float) else {f"{prefix}_{k}": v for k, v in computed.items()}
        clash = sorted(values.keys() & named_values.keys())
        if clash:
            raise ValueError(f"evaluate_metrics: two metrics record {clash[0]!r}; give them other names (a dict result's keys name its records).")
        values.update(named_values)
    return attrs.evolve(state, history=state.history.add(epoch=state.epoch, step=state.step, values=values))


def _has(metric: Any, *methods: str) -> bool:
    return all(callable(getattr(metric, m, None)) for m in methods)


def _feed(name: str, metric: Any, args: tuple[Any, ...]) -> None:
    """``metric.update(*args)`` (torchmetrics and the like), or Hugging Face evaluate's ``add_batch(predictions=, references=)``."""
    if _has(metric, "update"):
        metric.update(*args)
        return
    if len(args) != 2:
        raise TypeError(f"evaluate_metrics: metric {name!r} takes add_batch(predictions=..., references=...): fn must return (predictions, references), not {len(args)} values.")
    metric.add_batch(predictions=args[0], references=args[1])


def _computed(name: str, metric: Any) -> float | dict[str, float]:
    """``metric.compute()`` as a float (or a dict of them, by name), without a torchmetrics metric syncing inputs every process already holds; then reset.

    torchmetrics decides whether ``compute`` syncs from ``_to_sync``, set from
    ``sync_on_compute`` when the metric is built and after each ``forward``
    (``update`` alone leaves it): both are turned off for the call and put back.
    A test counts the samples a metric saw on 2 processes, so a torchmetrics that
    decides otherwise fails it (100 samples instead of 50) rather than passing silently.
    """
    saved = {a: getattr(metric, a) for a in ("sync_on_compute", "_to_sync") if isinstance(getattr(metric, a, None), bool)}
    for attribute in saved:
        setattr(metric, attribute, False)
    try:
        value = metric.compute()
    finally:
        for attribute, flag in saved.items():
            setattr(metric, attribute, flag)
    if _has(metric, "reset"):  # Hugging Face evaluate's compute() empties the metric itself
        metric.reset()
    if isinstance(value, Mapping):  # Hugging Face evaluate, a torchmetrics MetricCollection: one record per key
        return {str(k): _number(f"{name!r}[{k!r}]", v) for k, v in value.items()}
    return _number(repr(name), value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"evaluate_metrics: metric {name} computed a tensor of shape {tuple(value.shape)}; the history holds numbers (average it, e.g. average='macro').")
        return float(value)  # sync: once per metric per evaluation
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"evaluate_metrics: metric {name} computed a {type(value).__name__}, not a number.")
    return float(value)


@overload
def predict(ctx: Context, fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch]) -> Callable[[TrainState], Any]: ...
@overload
def predict(ctx: Context, fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch], state: TrainState) -> Any: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def predict(ctx: Context, fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch], state: TrainState) -> Any:
    """Run ``fn(model, batch)`` over ``loader`` and return the outputs for every sample, in order.

    In eval mode under ``torch.no_grad()``. Outputs are gathered from every
    process with ``accelerator.gather_for_metrics`` (the padding of the last
    round dropped) and concatenated along the first dimension, so on every
    process the result has exactly one row per sample of the dataset, in the
    loader's order (use ``shuffle=False``).

    Args:
        ctx: the run's Context.
        fn: ``fn(model, batch)`` returning a tensor with a leading batch dimension,
            or a tuple/list/dict of such tensors.
        loader: a prepared loader.
        state: the state whose model predicts.

    Returns:
        The concatenated outputs, of the structure ``fn`` returns (on the device).

    Example:
        >>> from trainfold import testing
        >>> ctx, state, loader, _ = testing.tiny_setup(seed=0)
        >>> predict(ctx, lambda m, b: m(b[0]), loader, state).shape
        torch.Size([16, 1])

    .. versionadded:: 0.1.0
    """
    state = _checked("predict(ctx, fn, loader, state)", ctx, "fn", fn, loader, state)
    _check_every_sample("predict", loader)
    acc = ctx.accelerator
    outputs = []
    with eval_mode(state.model, state.optimizer):
        for batch in loader:
            try:
                out = fn(state.model, batch)
            except Exception as exc:
                add_note(exc, f"trainfold: raised by predict's fn on a batch of structure {describe_batch(batch)}")
                raise
            outputs.append(acc.gather_for_metrics(out))
    if not outputs:
        raise _empty_loader("predict", loader)
    return _concat(outputs)


def _concat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([p.reshape(1) if p.ndim == 0 else p for p in parts])
    if isinstance(first, Mapping):
        return cast(Any, type(first))({k: _concat([p[k] for p in parts]) for k in first})  # its own mapping type
    if isinstance(first, (list, tuple)):
        return type(first)(_concat(list(items)) for items in zip(*parts))
    raise TypeError(
        f"predict's fn must return tensors (or a tuple/list/dict of them); it returned a {type(first).__name__}."
    )
