"""Where numbers go: Accelerate's trackers, Python logging, and a tqdm progress bar."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

import attrs

from trainfold._src.backend.trackers import flush_trackers
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
        if step == ctx.runtime.checkpointed_step:  # logged at a checkpoint's update, after it: a resumed run would not log it again
            flush_trackers(ctx.accelerator)
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


def _warn_trackers_not_resumed(ctx: Context) -> None:
    """A resumed run's trackers started by ``accelerator.init_trackers``: nothing cuts their series back to the checkpoint."""
    if ctx.runtime.warn_once("trackers of a resumed run") and ctx.is_main_process:
        names = ", ".join(t.name for t in ctx.accelerator.trackers)
        warnings.warn(f"the run resumed from update {ctx.runtime.resumed_from}, and its trackers ({names}) were started by "
                      "accelerator.init_trackers, which starts them as a new run: what the run before logged after its checkpoint "
                      "is logged again beside it. Start them with init_trackers(ctx, project_name, state), given the loaded "
                      "state. Said once.", UserWarning, stacklevel=user_stacklevel())


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


#: Trackers whose series a resumed run can cut back to its checkpoint, and the init keyword that does it.
PURGING = {"tensorboard": "purge_step"}

#: The tag with which :func:`init_trackers` marks an MLflow run as this trainfold run's (``TrainState.run_id``).
MLFLOW_RUN_TAG = "trainfold.run_id"


def _mlflow_run_of(project_name: str, run_id: str) -> str | None:
    """The id of the newest MLflow run in experiment ``project_name`` tagged with trainfold's ``run_id``, or None."""
    import mlflow

    runs = mlflow.search_runs(experiment_names=[project_name], filter_string=f"tags.`{MLFLOW_RUN_TAG}` = '{run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=1, output_format="list")
    return runs[0].info.run_id if runs else None


def _mlflow_holds(tracker: Any, at: int) -> dict[str, int]:
    """Each metric of the MLflow run ``tracker`` goes on with, and the last step it holds, where that is ``at`` (the
    update the resumed run goes on from: an epoch's record logged after its checkpoint) or later."""
    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(), tracker.active_run.info.run_id
    last = {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in client.get_run(run_id).data.metrics}
    return {key: step for key, step in last.items() if step >= at}


def _tensorboard_holds(tracker: Any, at: int) -> dict[str, int]:
    """The tags TensorBoard holds at update ``at``, the one a resumed run goes on from, each with ``at``.

    ``purge_step`` drops what the run before logged after ``at``, not at it: a checkpoint saved in an epoch's last
    update comes before the epoch's record at that update, which the resumed run logs again. Read from the run's
    event files (``tensorboard``'s reader; without it, nothing is known to be held).
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    writer = tracker.writer
    log_dir = writer.get_logdir() if hasattr(writer, "get_logdir") else tracker.logging_dir
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # every point (0: no sampling)
    tb_logger = logging.getLogger("tensorboard")
    level = tb_logger.level
    tb_logger.setLevel(logging.ERROR)  # its note that a restart's purge drops points: the purge asked for
    try:
        events.Reload()
    except Exception as exc:  # a folder its reader cannot read: the run goes on, and says what it may log twice
        warnings.warn(f"init_trackers: TensorBoard's events in {log_dir} could not be read ({type(exc).__name__}: {exc}), so "
                      f"what the run before logged at update {at} after its checkpoint may appear twice there.",
                      UserWarning, stacklevel=user_stacklevel())
        return {}
    finally:
        tb_logger.setLevel(level)
    return {tag: at for tag in events.Tags()["scalars"] if any(e.step == at for e in events.Scalars(tag))}


def _dvclive_holds(tracker: Any, at: int) -> dict[str, int]:
    """Each metric DVCLive's files hold, with the last step they hold, where that is ``at`` (the update the resumed run
    goes on from) or later: DVCLive appends a row per value to ``<dir>/plots/metrics/<key>.tsv`` (a ``step`` column)."""
    import csv

    folder = Path(tracker.live.plots_dir) / "metrics"
    holds: dict[str, int] = {}
    for path in sorted(folder.rglob("*.tsv")):
        try:
            with open(path, newline="", encoding="utf-8") as f:
                steps = [int(row["step"]) for row in csv.DictReader(f, delimiter="\t") if row.get("step")]
        except (OSError, ValueError, csv.Error) as exc:  # a row cut short by a kill, a file of someone else's
            warnings.warn(f"init_trackers: DVCLive's {path} could not be read ({type(exc).__name__}: {exc}), so what the run "
                          f"before logged to it at or after update {at} may appear twice there.", UserWarning, stacklevel=user_stacklevel())
            continue
        if steps and max(steps) >= at:
            holds[path.relative_to(folder).with_suffix("").as_posix()] = max(steps)
    return holds


def _trackio_holds(tracker: Any, at: int) -> dict[str, int]:
    """Each metric of the Trackio run ``tracker`` goes on with, and the last step its store holds, where that is ``at``
    or later. Read with the store's own reader (``SQLiteStorage.get_logs``, what ``trackio get`` uses: Trackio has no
    public reader of a run's values); where it cannot be read, a warning says what may appear twice."""
    run = tracker.run
    try:
        from trackio.sqlite_storage import SQLiteStorage

        rows = SQLiteStorage.get_logs(run.project, run.name, run_id=getattr(run, "id", None))
        last: dict[str, int] = {}
        for row in rows:
            step = int(row["step"])
            for key in row.keys() - {"step", "timestamp"}:
                last[key] = max(last.get(key, step), step)
    except Exception as exc:  # another trackio's store, a database it cannot open: the run goes on
        warnings.warn(f"init_trackers: Trackio's run {run.name!r} of project {run.project!r} could not be read ({type(exc).__name__}: "
                      f"{exc}), so what the run before logged at or after update {at} may appear twice there.",
                      UserWarning, stacklevel=user_stacklevel())
        return {}
    return {key: step for key, step in last.items() if step >= at}


def _clearml_holds(tracker: Any, at: int) -> dict[str, int]:
    """Each value of the offline ClearML task ``tracker`` goes on with, and the last iteration its session holds, where
    that is ``at`` or later. Read from the session's ``metrics.jsonl`` (one JSON list of events per line, as ClearML's
    reporter writes them; a line a kill cut short holds nothing), each scalar named back from its title and series as
    Accelerate's ``ClearMLTracker`` names them (``eval_x``: title ``x``, series ``eval``; any other key: itself, series
    ``train``)."""
    folder = tracker.task.get_offline_mode_folder()
    path = Path(folder) / "metrics.jsonl"
    last: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:  # killed before ClearML wrote a value: it holds none
        return {}
    except OSError as exc:
        warnings.warn(f"init_trackers: ClearML's {path} could not be read ({type(exc).__name__}: {exc}), so what the run before "
                      f"logged at or after update {at} may appear twice there.", UserWarning, stacklevel=user_stacklevel())
        return {}
    for line in lines:
        try:
            events = json.loads(line)
        except ValueError:
            continue
        for event in events if isinstance(events, list) else ():
            if isinstance(event, dict) and event.get("type") == "training_stats_scalar":
                title, series, step = event.get("metric"), event.get("variant"), event.get("iter")
                if not (isinstance(title, str) and isinstance(series, str) and isinstance(step, int)):
                    continue
                for key in ((title, f"train_{title}") if series == "train" else (f"{series}_{title}",)):
                    last[key] = max(last.get(key, step), step)
    return {key: step for key, step in last.items() if step >= at}


#: The trackers a resumed run sends only what they lack (see :func:`init_trackers`), and how to read what each holds at
#: or after the update the run goes on from (ClearML: offline only).
HOLDS = {"tensorboard": _tensorboard_holds, "mlflow": _mlflow_holds, "dvclive": _dvclive_holds, "trackio": _trackio_holds,
         "clearml": _clearml_holds}

#: The config key with which :func:`init_trackers` marks a Trackio run as this trainfold run's (``TrainState.run_id``).
TRACKIO_RUN_KEY = "trainfold.run_id"


def _warn_no_run(tracker: str, which: str, state: TrainState, store: str) -> None:
    """Say that ``tracker`` holds no run of this trainfold run's (``which``), so the resumed run starts a new one."""
    warnings.warn(f"init_trackers: {tracker} holds no run of {which}, so this run, resumed at update {state.step}, starts a new one "
                  f"(is {store} the run's store?).", UserWarning, stacklevel=user_stacklevel())


def _prepare_mlflow(ctx: Context, project_name: str, state: TrainState, kwargs: dict[str, dict[str, Any]]) -> None:
    """Tag the MLflow run with the trainfold run's id; a resumed run goes on with the MLflow run so tagged."""
    mine = kwargs.setdefault("mlflow", {})
    if isinstance(mine.get("tags"), str):
        mine["tags"] = json.loads(mine["tags"])  # as Accelerate's MLflowTracker reads a string
    mine["tags"] = {**(mine.get("tags") or {}), MLFLOW_RUN_TAG: state.run_id}
    if state.step > 0 and ctx.is_main_process and not mine.get("run_id") and not os.environ.get("MLFLOW_RUN_ID"):
        found = _mlflow_run_of(project_name, state.run_id)
        if found is None:
            _warn_no_run("MLflow", f"experiment {project_name!r} tagged {MLFLOW_RUN_TAG}={state.run_id}", state, "MLFLOW_TRACKING_URI")
        else:
            mine["run_id"] = found


def _prepare_dvclive(ctx: Context, kwargs: dict[str, dict[str, Any]]) -> None:
    """Have DVCLive go on with its folder for a resumed run (``resume=True``: its default, and Accelerate's, empties it,
    deleting the run's series), first setting aside the files a kill cut short, which DVCLive reads then and fails on:
    it rewrites them in place (its summary at every step, its parameters at every start)."""
    mine = kwargs.setdefault("dvclive", {})
    if not mine.setdefault("resume", True) or not ctx.is_main_process:
        return
    folder = Path(mine.get("dir", "dvclive"))  # (Live's own default folder, and its file names)
    for path, what, again in ((folder / "metrics.json", "summary", "DVCLive writes a new one as the run logs"),
                              (folder / "params.yaml", "parameters", "the config given to init_trackers is written again")):
        if path.is_file() and not _whole_dvclive_file(path):
            aside = path.with_name(path.name + ".damaged")
            os.replace(path, aside)
            warnings.warn(f"init_trackers: DVCLive's {what} {path} is cut short (a kill while DVCLive wrote it), and DVCLive "
                          f"would fail on it: set aside as {aside}; {again}. Its series, the .tsv files under plots/metrics, go "
                          "on whole.", UserWarning, stacklevel=user_stacklevel())


def _whole_dvclive_file(path: Path) -> bool:
    """Whether DVCLive can read back its summary (JSON) or parameters (YAML) file ``path``: a mapping."""
    try:
        if path.suffix == ".json":
            return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
        from dvclive.serialize import load_yaml  # DVCLive's own reader of it

        return isinstance(load_yaml(path), dict)
    except Exception:  # (its reader's error for a damaged file: ValueError, DVCLive's YAMLFileCorruptedError...)
        return False


def _trackio_run_of(project_name: str, run_id: str) -> str | None:
    """The name of the newest Trackio run of ``project_name`` whose config holds trainfold's ``run_id``, or None."""
    from trackio import Api

    try:
        runs = list(Api().runs(project_name))
    except ValueError:  # no such project
        return None
    found = [run.name for run in runs if (run.config or {}).get(TRACKIO_RUN_KEY) == run_id]
    return found[-1] if found else None


def _prepare_trackio(ctx: Context, project_name: str, state: TrainState, kwargs: dict[str, dict[str, Any]]) -> None:
    """Mark the Trackio run with the trainfold run's id (in its config); a resumed run goes on with the run so marked."""
    mine = kwargs.setdefault("trackio", {})
    mine["config"] = {**(mine.get("config") or {}), TRACKIO_RUN_KEY: state.run_id}
    if state.step == 0 or not ctx.is_main_process:
        return
    if mine.get("name"):
        mine.setdefault("resume", "allow")  # the run named goes on (trackio's default, "never", would start another)
        return
    found = _trackio_run_of(project_name, state.run_id)
    if found is None:
        _warn_no_run("Trackio", f"project {project_name!r} whose config has {TRACKIO_RUN_KEY}={state.run_id}", state, "TRACKIO_DIR")
        return
    mine.update(name=found, resume="must")


#: The tag with which :func:`init_trackers` marks a ClearML task or an Aim run as this trainfold run's (followed by its
#: ``run_id``).
RUN_TAG = "trainfold.run_id="


def _clearml_offline() -> bool:
    """Whether ClearML runs offline (``Task.set_offline(True)``, or ``CLEARML_OFFLINE_MODE``): its sessions are folders here."""
    from clearml import Task

    return bool(Task.is_offline())  # sync: none: a flag of ClearML's


def _clearml_task_of(run_id: str) -> str | None:
    """The id of the newest offline ClearML session (under ClearML's cache folder) tagged with trainfold's ``run_id``."""
    from clearml.config import get_offline_dir

    tag, found = f"{RUN_TAG}{run_id}", []
    for path in Path(get_offline_dir()).glob("*/task.json"):
        try:
            task = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # a session of someone else's, or one cut short
            continue
        if isinstance(task, dict) and tag in (task.get("tags") or []) and isinstance(task.get("id"), str):
            found.append((path.stat().st_mtime, task["id"]))
    return max(found)[1] if found else None


def _prepare_clearml(ctx: Context, state: TrainState, kwargs: dict[str, dict[str, Any]]) -> bool:
    """Tag the ClearML task with the trainfold run's id; offline, a resumed run goes on with the session so tagged, its
    iterations as logged (``continue_last_task=0``: ClearML would otherwise shift them past the last it holds).
    Whether the resumed run's ClearML goes on without what it holds (offline; online nothing here can read the server)."""
    mine = kwargs.setdefault("clearml", {})
    tag = f"{RUN_TAG}{state.run_id}"
    mine["tags"] = [*(t for t in (mine.get("tags") or []) if t != tag), tag]
    if state.step == 0 or not ctx.is_main_process:
        return True
    if not _clearml_offline():
        return False
    if mine.get("reuse_last_task_id") or mine.get("continue_last_task"):
        mine.setdefault("continue_last_task", 0)
        return True
    found = _clearml_task_of(state.run_id)
    if found is None:
        _warn_no_run("ClearML", f"offline session tagged {tag}", state, "CLEARML_CACHE_DIR")
        return True
    _mend_clearml_session(found)
    mine.update(reuse_last_task_id=found, continue_last_task=0)
    return True


def _mend_clearml_session(task_id: str) -> None:
    """Cut off a last line a kill left unfinished in the offline session's ``.jsonl`` files, which ClearML appends to:
    its next line would be glued to it and lost. The values on it came after the last checkpoint (each checkpoint waits
    until ClearML has written what it was given), so the resumed run logs them again."""
    from clearml.config import get_offline_dir

    for path in sorted(Path(get_offline_dir(task_id)).glob("*.jsonl")):
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
            warnings.warn(f"init_trackers: ClearML's {path} ended in a line a kill cut short: cut off (what it held came after "
                          "the checkpoint, and the resumed run logs it again).", UserWarning, stacklevel=user_stacklevel())


#: Trackers that keep one value per step: a resumed run goes on with their run, and a step it logs again replaces what the
#: run before logged there after its checkpoint, so there is nothing to cut back nor to leave out.
REPLACING = ("aim",)


def _aim_run_of(repo: str, run_id: str) -> str | None:
    """The hash of the newest run of the Aim repository in ``repo`` tagged with trainfold's ``run_id``, or None (no such
    run, or no repository there). Read from the repository's table of runs, where Aim keeps a run's tags as soon as they
    are added, a killed run's too; Aim's queries read an index its UI builds, which a killed run is not in yet."""
    if not (Path(repo) / ".aim").is_dir():
        return None
    from aim.sdk.repo import Repo

    tag = f"{RUN_TAG}{run_id}"
    found = [(run.creation_time or 0.0, run.hash) for run in Repo.from_path(repo).structured_db.runs() if tag in (run.tags or [])]
    return max(found)[1] if found else None


def _prepare_aim(ctx: Context, state: TrainState, kwargs: dict[str, dict[str, Any]]) -> None:
    """A resumed run goes on with the Aim run tagged with the trainfold run's id (``run_hash``), in the repository in the
    Accelerator's ``logging_dir`` (where Accelerate's ``AimTracker`` keeps it); a ``run_hash`` given is kept."""
    mine = kwargs.setdefault("aim", {})
    if state.step == 0 or not ctx.is_main_process or mine.get("run_hash"):
        return
    repo = str(ctx.accelerator.logging_dir)  # (Accelerate refuses Aim without one) AimTracker's Run(repo=logging_dir)
    found = _aim_run_of(repo, state.run_id)
    if found is None:
        _warn_no_run("Aim", f"repository {repo} tagged {RUN_TAG}{state.run_id}", state, "the Accelerator's logging_dir")
        return
    mine["run_hash"] = found


def _tag_aim_run(tracker: Any, run_id: str) -> None:
    """Tag the Aim run ``tracker`` writes to with trainfold's ``run_id`` (a run gone on with has it: Aim keeps a tag once)."""
    tracker.writer.add_tag(f"{RUN_TAG}{run_id}")


def init_trackers(ctx: Context, project_name: str, state: TrainState, *, config: Mapping[str, Any] | None = None,
                  init_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
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

    names = [t.name if isinstance(t, GeneralTracker) else str(t) for t in ctx.accelerator.log_with]  # (an enum's own name is its member's)
    if "mlflow" in names:
        _prepare_mlflow(ctx, project_name, state, kwargs)
    if "trackio" in names:
        _prepare_trackio(ctx, project_name, state, kwargs)
    if "dvclive" in names and state.step > 0:
        _prepare_dvclive(ctx, kwargs)
    if "aim" in names:
        _prepare_aim(ctx, state, kwargs)
    going_on = {*HOLDS, *REPLACING}
    if "clearml" in names and not _prepare_clearml(ctx, state, kwargs):
        going_on.discard("clearml")  # online: started as given
    if state.step > 0:
        for name in names:
            if name in PURGING:
                kwargs.setdefault(name, {}).setdefault(PURGING[name], state.step + 1)
        others = [n for n in names if n not in going_on]
        if others and ctx.is_main_process:
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
        if tracker.name == "aim":
            _tag_aim_run(tracker, state.run_id)
        if state.step > 0 and tracker.name in going_on and tracker.name in HOLDS:
            ctx.runtime.hold_tracker_steps(tracker.name, HOLDS[tracker.name](tracker, state.step))


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


def progress_bar(ctx: Context, total: int | None = None, *, desc: str = "epoch", force: bool = False, **tqdm_kwargs: Any) -> StepTransformer:
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
        raise ImportError("progress_bar needs tqdm to show a bar: pip install 'trainfold[progress]' (or pass progress=False to fit).") from None

    def transform(step: Step) -> Step:
        bar = None
        shown: dict[str, Any] = {"epoch": -1, "values": None}

        def with_bar(state: TrainState, batch: Any) -> TrainState:
            nonlocal bar
            if bar is None or shown["epoch"] != state.epoch:
                if bar is not None:
                    bar.close()
                bar = tqdm(total=total, desc=f"{desc} {state.epoch + 1}", initial=state.batch_in_epoch, dynamic_ncols=True, **tqdm_kwargs)
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

