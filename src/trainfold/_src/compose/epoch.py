"""``run_epoch``: a step folded over a loader, exactly resumable from any batch (curried, state last)."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Iterable, overload

import attrs
from toolz import curry

from trainfold._src.backend.loaders import (
    abandon_epoch,
    is_dispatcher,
    loader_generators,
    not_resumable,
    samples_per_batch,
    set_loader_epoch,
)
from trainfold._src.backend.position import resume_in_epoch
from trainfold._src.backend.streams import replay_advice
from trainfold._src.base import rng
from trainfold._src.base.checks import length_or_none, name_of, user_stacklevel
from trainfold._src.base.running_sums import RunningSums
from trainfold._src.base.types import Batch
from trainfold._src.compose.loader_checks import checked, empty_loader
from trainfold._src.compose.stragglers import epoch_stragglers
from trainfold._src.compose.watch import epoch_figures, epoch_totals
from trainfold._src.core.clock import Clock
from trainfold._src.core.context import Context
from trainfold._src.core.cursor import EpochCursor, Resume
from trainfold._src.core.modes import train_mode
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import EpochFn, Step
from trainfold._src.distributed.control import check_same_count, check_same_length, explaining_timeouts
from trainfold._src.distributed.interrupt import signal_name


@overload
def run_epoch(ctx: Context, step: Step, loader: Iterable[Batch], *, max_batches: int | None = ...) -> EpochFn: ...


@overload
def run_epoch(
    ctx: Context, step: Step, loader: Iterable[Batch], state: TrainState, *, max_batches: int | None = ...
) -> TrainState: ...


@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def run_epoch(
    ctx: Context, step: Step, loader: Iterable[Batch], state: TrainState, *, max_batches: int | None = None
) -> TrainState:
    """Train for one epoch: fold ``step`` over ``loader``.

    Per epoch:

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
    step boundary, agreed by every process (see the Context's ``signals``). On several processes it first checks, with one
    all-gather on the control channel, that every process has as many batches
    (a loader of unknown length is checked at its end), so that uneven data
    fails on every process instead of hanging in a collective.

    Args:
        ctx: the run's Context.
        step: a Step, from :func:`~trainfold.make_step` and step transformers.
        loader: a loader prepared with ``ctx.prepare_loaders``.
        state: the state to continue from.
        max_batches: end the epoch after this many batches (smoke tests; what
            pytorch-accelerated calls limiting batches). The loader is not
            exhausted, so an unfinished accumulation group carries over.

    Returns:
        The state after the epoch; ``state.history["train_loss"]`` has the epoch's
        mean batch loss over all processes (none for an epoch resumed on another
        number of processes at its last update: its running sums hold no batch of it).

    Raises:
        ValueError: the loader yielded no batches; the processes have different
            numbers of batches; the step recorded none of the batches it was given.
        RuntimeError: a loader of unknown length ended on this process but not on
            the others.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
        >>> state.epoch, state.step, "train_loss" in state.history
        (1, 4, True)
    """
    state = checked("run_epoch(ctx, step, loader, state)", ctx, "step", step, loader, state)
    _check_accumulation(ctx, loader)
    train_mode(state.model, state.optimizer)
    length = length_or_none(loader)
    distributed = ctx.accelerator.num_processes > 1
    if distributed:
        check_same_length(ctx.runtime.control, length, "run_epoch")
    cursor = _start_epoch(ctx, state, loader)
    state = attrs.evolve(state, cursor=cursor)
    iterator = cursor.iterator
    seen, started_at = 0, state.batch_in_epoch
    limit = max_batches if max_batches is not None else -1
    interrupt = ctx.runtime.interrupt
    clock = ctx.runtime.clock
    clock.begin_epoch()
    acc = ctx.accelerator
    phase = ctx.runtime.phase  # (what this process is doing, for a timeout to name: one attribute write each)
    with explaining_timeouts(ctx.accelerator.num_processes), ctx.runtime.in_phase("data"):
        for batch in clock.timed(iterator) if clock.on else iterator:  # (the cursor keeps the loader's own iterator)
            phase.now = "forward/backward"
            state = step(state, batch)
            phase.now = "data"
            seen += 1
            if state.micro_step >= interrupt.next_check and (
                signum := _stop_requested(interrupt, clock, state.micro_step, acc.sync_gradients, state.step)
            ):
                state = state.with_stop(f"signal {signal_name(signum)}")
                interrupt.clear()  # honoured: the next run on this Context is not stopped by it
            if state.batch_in_epoch == limit or state.end_of_epoch:
                abandon_epoch(iterator, loader)
                break
            if state.should_stop:
                _check_recorded(step, seen, started_at, state)
                # The epoch stays open: its position is kept (a checkpoint continues it, as does a
                # later run_epoch). After a preemption (a signal, nan_guard) the epoch-level functions
                # after this one pass it through; a final stop (a budget) is the run's own end, which they evaluate.
                return attrs.evolve(
                    state, cursor=attrs.evolve(cursor, interrupted=not (state.stop is not None and state.stop.final))
                )
        else:
            if distributed and length is None:
                check_same_count(
                    ctx.runtime.control,
                    state.batch_in_epoch,
                    wait_s=max(10 * ctx.stop_check_s, 20 * interrupt.seconds_per_batch()),
                )
    if seen == 0 and state.batch_in_epoch == 0:
        raise empty_loader("run_epoch", loader)
    _check_recorded(step, seen, started_at, state)
    return end_epoch(ctx, state)


def _stop_requested(interrupt: Any, clock: Clock, micro_step: int, synced: bool, update: int) -> int:
    """The stop agreement's round (``interrupt.check``), its time counted to the clock's ``stop``."""
    start = time.perf_counter()
    try:
        return int(interrupt.check(micro_step, synced, update) or 0)
    finally:
        clock.add("stop", time.perf_counter() - start)


def _check_recorded(step: Step, seen: int, started_at: int, state: TrainState) -> None:
    """Refuse a step that consumed batches without recording them: its epoch would hold no position and a NaN loss."""
    if seen and state.batch_in_epoch == started_at:
        raise ValueError(
            f"run_epoch: the step {name_of(step)!r} was given {seen} batches and recorded none (state.batch_in_epoch stayed "
            f"{started_at}): a step must return the state a make_step step returns, which counts the batch and adds its loss. "
            "Wrap one (new = inner(state, batch), then your changes to new) instead of replacing it."
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

    A state from ``load_checkpoint`` continues its interrupted epoch, one of the ways
    :func:`trainfold._src.backend.position.resume_in_epoch` chooses from.
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
    if (refused := not_resumable("run_epoch", loader)) is not None:
        raise refused
    _warn_if_global_batch_changed(ctx, resume, loader)
    position = resume.position
    by_samples = resume.elastic or (position is not None and position.by_samples)
    saved_length = position.epoch_length if position is not None else None
    if (
        state.batch_in_epoch > 0
        and not by_samples
        and saved_length is not None
        and length_or_none(loader) not in (None, saved_length)
    ):
        raise ValueError(
            f"run_epoch: the interrupted epoch had {saved_length} batches, this loader has {length_or_none(loader)}: "
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
    if state.batch_in_epoch == 0 or position is None:
        restore(resume.now, generators)
        return EpochCursor(iter(loader), loader, rng.capture(generators))
    acc = ctx.accelerator
    resumed = resume_in_epoch(
        loader,
        position,
        state.batch_in_epoch,
        resume.now,
        epoch=state.epoch,
        processes=acc.num_processes,
        index=acc.process_index,
        elastic=resume.elastic,
        saved_processes=resume.saved_layout[0] if resume.saved_layout is not None else 1,
        peers=resume.peers,
    )
    if resumed.replayed:
        _warn_replay(ctx, state, loader)
    return EpochCursor(
        resumed.iterator, loader, position.epoch_start, resumed_at=resumed.resumed_at, stream=resumed.reader
    )


def _warn_replay(ctx: Context, state: TrainState, loader: Any) -> None:
    """Say once per run that an interrupted epoch over a stream is continued by reading its consumed part again."""
    key = f"stream replay:{state.run_id}"
    if not ctx.runtime.warn_once(key):
        return
    base = getattr(loader, "base_dataloader", loader)
    read = state.batch_in_epoch + 1  # and the batch the loader had read ahead
    if is_dispatcher(loader) and not loader.split_batches:  # process 0 reads a batch of the base loader per process
        read *= ctx.accelerator.num_processes
    size = getattr(base, "batch_size", None)
    samples = f" ({read * size} samples)" if isinstance(size, int) else ""
    who = "process 0 reading" if is_dispatcher(loader) else "reading"
    warnings.warn(
        f"run_epoch: the checkpoint stopped at batch {state.batch_in_epoch} of epoch {state.epoch}, and this loader reads a "
        f"stream ({type(getattr(base, 'dataset', None)).__name__}, an iterable dataset): trainfold continues it exactly by "
        f"{who} the epoch's first {read} batches{samples} again and dropping them (the same samples in the same order, as "
        "long as the stream yields its epoch "
        "in the same order again: seeded shuffles, set_epoch). A resume costs as much reading as the part of the epoch "
        f"already trained; checkpoints between epochs cost none. It is read again because {replay_advice(loader)}.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _check_position(state: TrainState, resume: Resume, loader: Any) -> None:
    """Refuse a checkpoint whose position in the epoch lies past the loader's end (a damaged or hostile counter)."""
    if state.batch_in_epoch == 0:
        return
    done = resume.position.samples_done if resume.position is not None else None
    if resume.elastic or (resume.position is not None and resume.position.by_samples):
        total = length_or_none(getattr(getattr(loader, "base_dataloader", loader), "dataset", None))
        if done is not None and total is not None and done > total:
            raise ValueError(
                f"run_epoch: the checkpoint says {done} samples of this epoch were trained, but the dataset has "
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
        stacklevel=user_stacklevel(),
    )


def end_epoch(ctx: Context, state: TrainState) -> TrainState:
    """Close the current epoch: record its train metrics (and a watched run's throughput), count it, reset the running sums."""
    timed = ctx.runtime.clock.end_epoch()
    sums = state.sums.folded()
    held = (
        state.batch_in_epoch - sums.started_at
    )  # the batches the sums hold: all, but after a resume on another layout
    # none where that resume came at the epoch's last update (so on every process): the record then has no train values
    averaged = sums if held else RunningSums()
    if timed is None:
        means = averaged.means(ctx.accelerator, held)
    else:  # watched: the samples ride in the same one all-reduce (as the reports', in float64)
        seconds, samples = timed
        means, totals = averaged.means_and_totals(ctx.accelerator, held, totals=epoch_totals(ctx, samples))
        means = {**means, **epoch_figures(ctx, seconds, totals), **epoch_stragglers(ctx.runtime.clock)}
    _warn_if_diverged(ctx, state, means.get("loss"))
    history = state.history.add(
        epoch=state.epoch + 1, step=state.step, values={f"train_{k}": v for k, v in means.items()}
    )
    return attrs.evolve(
        state,
        epoch=state.epoch + 1,
        batch_in_epoch=0,
        end_of_epoch=False,
        sums=sums.reset(ctx.accelerator.device, state.batch_in_epoch),
        history=history,
        # Between epochs the cursor keeps the loader (no iteration): a checkpoint taken now
        # records the state of the loader's own random generators.
        cursor=EpochCursor(None, state.cursor.loader, None) if isinstance(state.cursor, EpochCursor) else None,
    )


def _warn_if_diverged(ctx: Context, state: TrainState, loss: float | None) -> None:
    """A NaN or infinite epoch loss without nan_guard: said once per run (the run goes on; the user decides)."""
    if loss is None or math.isfinite(loss) or not ctx.runtime.warn_once(f"diverged:{state.run_id}"):
        return
    if ctx.is_main_process:
        warnings.warn(
            f"run_epoch: epoch {state.epoch + 1}'s train_loss is {loss} (update {state.step}): the run has diverged and every "
            "update since is wasted. Lower the learning rate, clip (make_step(..., clip_grad_norm=1.0)), or skip such batches "
            "with make_step(..., stages=[nan_guard(3)]); save_checkpoint's keep_last keeps the newest checkpoint of finite "
            "weights to resume from. Said once per run.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
