"""Where numbers go: Accelerate's trackers, Python logging, and a tqdm progress bar."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any, Mapping

import attrs

from trainfold._src.backend.trackers import GoingOn, vendor
from trainfold._src.base.checks import name_of, named, user_stacklevel
from trainfold._src.compose.report import report_text
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import Step, StepTransformer

logger = logging.getLogger("trainfold")


def emit(ctx: Context, values: Mapping[str, float], step: int, *, log: bool = True) -> None:
    """Send ``values`` to the Accelerator's trackers and (with ``log``) to the ``trainfold`` logger, on the main process.

    ``accelerator.log`` reaches every tracker configured with
    ``Accelerator(log_with=...)`` and ``accelerator.init_trackers(...)``; without
    one it is not called (it would do nothing, after Accelerate's process
    checks: ~3 us, ~40 us in the cold cache of a training loop).
    """
    if ctx.accelerator.trackers:
        if ctx.runtime.resumed_from and not ctx.runtime.trackers_by_trainfold:
            _warn_trackers_not_resumed(ctx)
        if ctx.runtime.tracker_holds:
            _log_what_trackers_lack(ctx, values, step)
        else:
            ctx.accelerator.log(dict(values), step=step)
        if step == ctx.runtime.resumed_from:
            _hold_what_replacing_trackers_got(ctx, values, step)
        ctx.runtime.wrote_at(
            ctx.accelerator, step
        )  # at a checkpoint's update, after it: a resumed run would not log it again
    elif getattr(ctx.accelerator, "log_with", None) and ctx.runtime.warn_once("trackers not started"):
        if ctx.is_main_process:
            warnings.warn(
                f"the Accelerator was made with log_with={[str(t) for t in ctx.accelerator.log_with]} but its trackers were "
                "never started, so nothing is sent to them: call ctx.accelerator.init_trackers('project-name', config={...}) "
                "before training. Said once.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
    if log and ctx.is_main_process and logger.isEnabledFor(logging.INFO):
        logger.info("step %d: %s", step, report_text(values))


def _hold_what_replacing_trackers_got(ctx: Context, values: Mapping[str, float], step: int) -> None:
    """A resumed run sends values at its checkpoint's update out of the uninterrupted run's order: the epoch that update
    ended is closed (its record sent) before ``log_every`` makes the update's report again. A tracker that keeps one
    value per step (Aim) keeps the first value this run sends it there, as the uninterrupted run's last one was."""
    for tracker in ctx.accelerator.trackers:
        found = vendor(tracker.name)
        if found is not None and found.replaces:
            held = ctx.runtime.tracker_holds.get(tracker.name, {})
            ctx.runtime.hold_tracker_steps(tracker.name, {**held, **{key: step for key in values if key not in held}})


def _warn_trackers_not_resumed(ctx: Context) -> None:
    """A resumed run's trackers started by ``accelerator.init_trackers``: nothing cuts their series back to the checkpoint."""
    if ctx.runtime.warn_once("trackers of a resumed run") and ctx.is_main_process:
        names = ", ".join(t.name for t in ctx.accelerator.trackers)
        warnings.warn(
            f"the run resumed from update {ctx.runtime.resumed_from}, and its trackers ({names}) were started by "
            "accelerator.init_trackers, which starts them as a new run: what the run before logged after its checkpoint "
            "is logged again beside it. Start them with init_trackers(ctx, project_name, state), given the loaded "
            "state. Said once.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _log_what_trackers_lack(ctx: Context, values: Mapping[str, float], step: int) -> None:
    """Log to each tracker the values of ``step`` it does not hold yet (an append-only tracker a resumed run goes on
    with: :func:`init_trackers`); once ``step`` is past all they held, every value goes to every tracker again."""
    holds = ctx.runtime.tracker_holds
    if ctx.is_main_process:
        for tracker in ctx.accelerator.trackers:
            held = holds.get(tracker.name, {})
            fresh = {k: v for k, v in values.items() if step > held.get(k, -1)}
            if fresh:
                tracker.log(fresh, step=step)
    for name, held in list(holds.items()):
        if step > max(held.values()):
            ctx.runtime.hold_tracker_steps(name, {})


def init_trackers(
    ctx: Context,
    project_name: str,
    state: TrainState,
    *,
    config: Mapping[str, Any] | None = None,
    init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Start the Accelerator's trackers (``Accelerator(log_with=...)``) for a run that goes on from ``state``.

    ``accelerator.init_trackers``, and for a resumed run (``state.step > 0``) TensorBoard's
    ``purge_step`` set to the update after the checkpoint's: what the run before logged after
    its checkpoint (up to a kill) is purged, and the resumed run logs those updates again, so
    each series holds every update once, with the values of an uninterrupted run (the resume
    is exact). Every value logged at or before the checkpoint's update stays, and what TensorBoard
    holds at that update (an epoch's record logged after a checkpoint saved in the epoch's last
    update, or ``log_every``'s report there, which the resumed run makes again) is not sent again.

    MLflow's runs are tagged ``trainfold.run_id`` (:attr:`TrainState.run_id`), and a resumed
    run goes on with the MLflow run so tagged in experiment ``project_name`` (unless a
    ``run_id`` is given, or ``MLFLOW_RUN_ID`` set; a warning where none is found). MLflow
    cannot delete what it holds, so the values it already holds (each metric up to its last
    step there) are not logged again: each series holds every update once, the values before
    the kill being those the resumed run would log. DVCLive, which empties its folder when
    started, goes on with its files (``resume=True``) and is sent only what they lack, in the
    same way. Trackio's run is marked ``trainfold.run_id`` in its config, a resumed run goes on
    with the run so marked and is sent only what its store lacks. An offline ClearML task is tagged
    ``trainfold.run_id=<run_id>``; a resumed run goes on with the session so tagged, its
    iterations as given, and is sent only what its ``metrics.jsonl`` lacks. Trackio and ClearML
    write from a thread: a checkpoint first waits until they have written what they were given,
    so a kill loses only what came after it, which the resumed run logs again. Aim's run is
    tagged ``trainfold.run_id=<run_id>`` too; a resumed run goes on with the run so tagged in
    the repository in the Accelerator's ``logging_dir``, and each update it logs again replaces
    the value Aim held for it (Aim keeps one value per step).
    Trackers that can do none of these (Weights & Biases, Comet, SwanLab, ClearML online)
    are started as given, and a warning says their series may hold the updates after the
    checkpoint twice.

    Args:
        ctx: the run's Context.
        project_name: the run's name, as ``init_trackers`` takes it.
        state: the state the run goes on from (a fresh one, or ``load_checkpoint``'s).
        config: hyperparameters to store, as ``init_trackers`` takes them.
        init_kwargs: keyword arguments per tracker (``{"tensorboard": {"flush_secs": 30}}``); a
            ``purge_step``, MLflow ``run_id``, DVCLive ``resume``, Trackio ``name``, ClearML ``reuse_last_task_id``
            or Aim ``run_hash`` given is kept, MLflow ``tags``, ClearML ``tags`` and Trackio's ``config`` get the run's.

    Raises:
        Exception: nothing of its own; what ``accelerator.init_trackers`` raises (a tracker not installed).

    Examples:
        >>> import tempfile
        >>> from accelerate import Accelerator
        >>> from trainfold import testing
        >>> ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="tensorboard",
        ...                                                                       project_dir=tempfile.mkdtemp()))
        >>> init_trackers(ctx, "demo", state)
        >>> [t.name for t in ctx.accelerator.trackers]
        ['tensorboard']
    """
    kwargs = {name: dict(values) for name, values in (init_kwargs or {}).items()}
    from accelerate.tracking import GeneralTracker

    names = [
        t.name if isinstance(t, GeneralTracker) else str(t) for t in ctx.accelerator.log_with
    ]  # (an enum's own name is its member's)
    logging_dir = ctx.accelerator.logging_dir
    run = GoingOn(
        project_name, state.run_id, state.step, ctx.is_main_process, None if logging_dir is None else str(logging_dir)
    )
    vendors = {name: found for name in names if (found := vendor(name)) is not None}
    going_on = {name for name, found in vendors.items() if found.prepare(run, kwargs.setdefault(name, {}))}
    others = [n for n in names if n not in going_on]
    if state.step > 0 and others and ctx.is_main_process:
        warnings.warn(
            f"init_trackers: the run goes on from update {state.step}, and {', '.join(others)} cannot cut a series back "
            f"to it: what the run before logged after its checkpoint (up to its end) is logged again, so those "
            "updates may appear twice there (with the same values: the resume is exact). TensorBoard's series are cut back, "
            "MLflow's and Trackio's runs, DVCLive's files and an offline ClearML session go on without them, and Aim's run "
            "goes on, replacing them.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    ctx.accelerator.init_trackers(project_name, config=dict(config) if config is not None else None, init_kwargs=kwargs)
    ctx.runtime.trackers_by_trainfold = True
    if not ctx.is_main_process:
        return
    for tracker in ctx.accelerator.trackers:
        found = vendors.get(tracker.name)
        if found is not None and found.started is not None:
            found.started(tracker, run)
        if state.step > 0 and tracker.name in going_on and found is not None and found.holds is not None:
            ctx.runtime.hold_tracker_steps(tracker.name, found.holds(tracker, state.step))


def step_key(name: str) -> str:
    """The tracker key of a value ``log_every`` reports (``loss``, ``lr``, an aux name): ``train/<name>``; ``epoch`` stays."""
    return name if name == "epoch" else f"train/{name}"


def epoch_key(record: str) -> str:
    """The tracker key of an epoch record: ``<prefix>/<name>`` for ``<prefix>_<name>``; ``train/<name>_epoch`` for
    the training records, apart from the running values ``log_every`` sends as ``train/<name>``; ``epoch`` stays.

    Examples:
        >>> [epoch_key(n) for n in ("train_loss", "eval_loss", "ema_accuracy", "epoch")]
        ['train/loss_epoch', 'eval/loss', 'ema/accuracy', 'epoch']
    """
    prefix, sep, name = record.partition("_")
    if not sep or not name:
        return record
    return f"train/{name}_epoch" if prefix == "train" else f"{prefix}/{name}"


def summary_line(state: TrainState, values: Mapping[str, float]) -> str:
    """The line ``log_epoch`` prints: the epoch, the update, and the epoch's records as they are named in the history."""
    return f"epoch {state.epoch} (update {state.step}): " + "  ".join(f"{k} {v:.6g}" for k, v in values.items())


#: What the progress bar shows of ``log_every``'s last report (the rates and MFU where it watches).
SHOWN = ("loss", "lr", "samples_per_s", "tokens_per_s", "mfu")


@attrs.frozen
class _BarState:
    epoch: int


def progress_bar(
    ctx: Context, total: int | None = None, *, desc: str = "epoch", force: bool = False, **tqdm_kwargs: Any
) -> StepTransformer:
    """A step transformer that shows a tqdm bar of the batches of each epoch.

    Main process only; off when stderr is not a terminal unless ``force=True``
    (then the transformer returns the step unchanged and costs nothing). The
    bar shows the epoch, its batches per second and time left (with ``total``), and
    the running loss last reduced by :func:`~trainfold.log_every` (it never
    synchronises by itself): with ``log_every(..., watch=True)``, samples and
    tokens per second and MFU too. The bar is a
    display, not run state: it is not checkpointed.

    Args:
        ctx: the run's Context.
        total: batches per epoch (``len(train_loader)``), for a bar with an end.
        desc: the bar's label; the epoch number is appended.
        force: show the bar even when stderr is not a terminal.
        **tqdm_kwargs: passed to ``tqdm.tqdm``.

    Returns:
        A step transformer (the step itself, unchanged, where no bar is shown).

    Raises:
        ImportError: a bar is to be shown and tqdm is not installed (``pip install 'trainfold[progress]'``).

    Examples:
        >>> import io
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> out = io.StringIO()
        >>> step = progress_bar(ctx, total=len(loader), force=True, file=out)(make_step(ctx, loss_fn))
        >>> _ = run_epoch(ctx, step, loader, state)
        >>> "4/4" in out.getvalue()
        True
    """
    if not ctx.is_main_process or not (force or sys.stderr.isatty()):
        return _identity("progress_bar(off)")
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(
            "progress_bar needs tqdm to show a bar: pip install 'trainfold[progress]' (or pass progress=False to fit)."
        ) from None

    def transform(step: Step) -> Step:
        bar = None
        shown: dict[str, Any] = {"epoch": -1, "values": None}

        def with_bar(state: TrainState, batch: Any) -> TrainState:
            nonlocal bar
            if bar is None or shown["epoch"] != state.epoch:
                if bar is not None:
                    bar.close()
                bar = tqdm(
                    total=total,
                    desc=f"{desc} {state.epoch + 1}",
                    initial=state.batch_in_epoch,
                    dynamic_ncols=True,
                    **tqdm_kwargs,
                )
                shown["epoch"] = state.epoch
            new = step(state, batch)
            bar.update(1)
            logged = new.extras.get("log_every")
            if logged is not None and logged.values is not shown["values"]:
                shown["values"] = logged.values
                bar.set_postfix({k: f"{v:.4g}" for k, v in logged.values.items() if k in SHOWN}, refresh=False)
            if total is not None and new.batch_in_epoch >= total:
                bar.close()  # the epoch's last batch: show the bar complete
                bar = None
            return new

        return named(with_bar, f"progress_bar({name_of(step)})")

    return transform


def _identity(name: str) -> StepTransformer:
    def transform(step: Step) -> Step:
        return step

    return named(transform, name)
