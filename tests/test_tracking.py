"""A tracker's series survives a kill: after kill -9 and a resume from the last checkpoint, TensorBoard's, MLflow's,
DVCLive's, (offline) ClearML's, Trackio's and Aim's series hold every update once, with the values the uninterrupted run
logs (tests/scripts/tracked_run.py: its event files, its MLflow store, DVCLive's files, ClearML's session, Trackio's store
and its Aim repository read back)."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

from trainfold import latest_checkpoint, verify_checkpoint

pytestmark = pytest.mark.multiprocess  # spawns processes and kills them

SCRIPT = Path(__file__).resolve().parent / "scripts" / "tracked_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
UPDATES = 36  # 3 epochs of 12 batches


def _run(root, logs, *extra):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(root), str(logs), *extra],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(300),
        env=ENV,
    )
    assert 0 == result.returncode, result.stderr[-3000:]
    return result


def _series(logs):
    """Every scalar series of the run's event files, as TensorBoard shows them: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(str(Path(logs) / "run"), size_guidance={"scalars": 0})  # every point (0: no sampling)
    run.Reload()
    return {tag: [(e.step, e.value) for e in run.Scalars(tag)] for tag in run.Tags()["scalars"]}


def _mlflow_series(logs):
    """Every metric of the run's one MLflow run, as MLflow holds them: {key: [(step, value), ...]} by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{Path(logs).resolve()}/mlruns")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("run").experiment_id]
    )  # one run, the resumed one going on
    return {
        key: [
            (m.step, m.value)
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        ]
        for key in run.data.metrics
    }


TRACKIO_READ = r"""
import json
from trackio.sqlite_storage import SQLiteStorage

(name,) = SQLiteStorage.get_runs("run")  # one run: the resumed run went on with it
rows = SQLiteStorage.get_logs("run", name)
print(json.dumps({key: [(row["step"], row[key]) for row in rows if key in row] for key in sorted({k for row in rows for k in row} - {"step", "timestamp"})}))
"""


def _trackio_series(logs):
    """Every metric of the one Trackio run in the run's store (LOGS/trackio), read by Trackio's own reader (in a process
    of its own: Trackio reads TRACKIO_DIR once, at import): {key: [(step, value), ...]} in the order written."""
    import json

    result = subprocess.run(
        [sys.executable, "-c", TRACKIO_READ],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(120),
        env={**ENV, "TRACKIO_DIR": str(Path(logs) / "trackio")},
    )
    assert 0 == result.returncode, result.stderr[-3000:]
    return {
        key: [tuple(point) for point in points] for key, points in json.loads(result.stdout.splitlines()[-1]).items()
    }


def test_aim_keeps_the_epoch_record_at_a_resumed_epoch_end(tmp_path, monkeypatch):
    """Resumed from the checkpoint of an epoch's last update (12), the run closes the epoch (its record: ``epoch`` 1)
    before ``log_every`` makes update 12's report again (``epoch`` 0). Aim keeps one value per step: it keeps the
    record's, as the uninterrupted run left it, not the report made again after it."""
    import shutil

    from trainfold import list_checkpoints

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _run(tmp_path / "clean-root", tmp_path / "clean-logs")
    ((_, clean),) = [(run["tags"], run["series"]) for run in helpers.aim_runs(tmp_path / "clean-logs").values()]
    root, logs = tmp_path / "root", tmp_path / "logs"
    _run(root, logs)
    for folder in list_checkpoints(root):
        if verify_checkpoint(folder)["step"] > 12:
            shutil.rmtree(folder)
    assert 12 == verify_checkpoint(latest_checkpoint(root))["step"]
    _run(root, logs)  # resumed at update 12, an epoch's last

    ((_, series),) = [(run["tags"], run["series"]) for run in helpers.aim_runs(logs).values()]
    assert (12, 1.0) in clean["epoch"] and clean == series


def test_every_tracker_holds_each_update_once(tmp_path, monkeypatch):
    """After kill -9 and a resume, TensorBoard, MLflow, DVCLive, ClearML, Trackio and Aim hold every update once with the uninterrupted values."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _run(tmp_path / "clean-root", tmp_path / "clean-logs")
    clean, clean_mlflow = _series(tmp_path / "clean-logs"), _mlflow_series(tmp_path / "clean-logs")
    clean_dvclive = helpers.dvclive_series(tmp_path / "clean-logs" / "dvclive")
    clean_clearml = helpers.clearml_series(tmp_path / "clean-logs" / "clearml")
    clean_trackio = _trackio_series(tmp_path / "clean-logs")
    ((_, clean_aim),) = [(run["tags"], run["series"]) for run in helpers.aim_runs(tmp_path / "clean-logs").values()]

    root, logs = tmp_path / "root", tmp_path / "logs"
    cmd = [sys.executable, str(SCRIPT), str(root), str(logs), "--slow"]
    rng = random.Random(3)
    for _ in range(4):  # a kill that lands after the next checkpoint proves less (it logged nothing past it): again
        newest = latest_checkpoint(root) if root.exists() else None
        start = verify_checkpoint(newest)["step"] if newest else 3  # (the first kill: once a checkpoint is there)
        target = rng.choice([n for n in range(start + 1, UPDATES) if n % 3])  # between two checkpoints (every 3)
        killed = helpers.kill_at_line(cmd, ENV, lambda line, target=target: line == f"logged {target}\n")
        resumed_from = verify_checkpoint(latest_checkpoint(root))["step"]
        before = _series(logs)  # what the killed run left
        if max(step for step, _ in before["train/loss"]) > resumed_from:
            break
    before_mlflow, before_dvclive, before_clearml = (
        _mlflow_series(logs),
        helpers.dvclive_series(logs / "dvclive"),
        helpers.clearml_series(logs / "clearml"),
    )
    before_trackio = _trackio_series(logs)
    ((_, before_aim),) = [(run["tags"], run["series"]) for run in helpers.aim_runs(logs).values()]
    result = _run(root, logs)

    assert -signal.SIGKILL == killed and 0 < resumed_from < UPDATES
    assert max(step for step, _ in before["train/loss"]) > resumed_from  # it had logged past its checkpoint
    assert max(step for step, _ in before_mlflow["train/loss"]) > resumed_from
    assert max(step for step, _ in before_dvclive["train/loss"]) > resumed_from
    assert (
        max(step for step, _ in before_clearml["train/loss"]) >= resumed_from
    )  # (it writes behind: what came after the checkpoint may be lost; nothing before)
    assert max(step for step, _ in before_trackio["train/loss"]) >= resumed_from  # (so does Trackio)
    assert (
        list(range(1, resumed_from + 1)) == [step for step, _ in before_aim["train/loss"]][:resumed_from]
    )  # (Aim writes as it is given)
    assert "cannot cut a series back" not in result.stderr  # trackers that can keep their series: no such warning
    series = _series(logs)
    assert list(range(1, UPDATES + 1)) == [step for step, _ in series["train/loss"]]
    assert clean.keys() == series.keys()
    for tag in clean:
        assert clean[tag] == series[tag], tag  # each step once, the same values (the epoch records too)
    mlflow_series = _mlflow_series(logs)  # MLflow kept what it held and was sent only what it lacked
    assert list(range(1, UPDATES + 1)) == [step for step, _ in mlflow_series["train/loss"]]
    assert clean_mlflow.keys() == mlflow_series.keys() and len(clean_mlflow) > 3
    for key in clean_mlflow:
        assert clean_mlflow[key] == mlflow_series[key], key
    dvclive_series = helpers.dvclive_series(
        logs / "dvclive"
    )  # DVCLive's files went on (not emptied) and were sent only what they lacked
    assert list(range(1, UPDATES + 1)) == [step for step, _ in dvclive_series["train/loss"]]
    assert clean_dvclive.keys() == dvclive_series.keys() and len(clean_dvclive) > 3
    for key in clean_dvclive:
        assert clean_dvclive[key] == dvclive_series[key], key
    clearml_series = helpers.clearml_series(
        logs / "clearml"
    )  # the session went on, each checkpoint waited for what ClearML was given
    assert list(range(1, UPDATES + 1)) == [step for step, _ in clearml_series["train/loss"]]
    assert clean_clearml.keys() == clearml_series.keys() and len(clean_clearml) > 3
    for key in clean_clearml:
        assert clean_clearml[key] == clearml_series[key], key
    trackio_series = _trackio_series(logs)  # the run went on, each checkpoint waited for what Trackio was given
    assert list(range(1, UPDATES + 1)) == [step for step, _ in trackio_series["train/loss"]]
    assert clean_trackio.keys() == trackio_series.keys() and len(clean_trackio) > 3
    for key in clean_trackio:
        assert clean_trackio[key] == trackio_series[key], key
    aim_runs = helpers.aim_runs(logs)  # the run went on, each step logged again replacing its value
    assert 1 == len(aim_runs), aim_runs.keys()
    ((aim_tags, aim_series),) = [(run["tags"], run["series"]) for run in aim_runs.values()]
    assert 1 == len(aim_tags) and aim_tags[0].startswith("trainfold.run_id=")
    assert list(range(1, UPDATES + 1)) == [step for step, _ in aim_series["train/loss"]]
    assert clean_aim.keys() == aim_series.keys() and len(clean_aim) > 3
    for key in clean_aim:
        assert clean_aim[key] == aim_series[key], key


CLEARML_RUN = r"""
import json, sys, warnings
import attrs
from accelerate import Accelerator
from trainfold import init_trackers, testing
from trainfold._src.compose.tracking import emit

resumed = sys.argv[1] == "resumed"
ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="clearml"))
state = attrs.evolve(state, run_id=sys.argv[2] if len(sys.argv) > 2 else "r-1", step=4 if resumed else 0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    init_trackers(ctx, "proj", state, init_kwargs={"clearml": {"auto_connect_frameworks": False, "auto_resource_monitoring": False}})
for update in (5, 6) if resumed else (1, 2, 3, 4, 5):
    emit(ctx, {"train/loss": update + (0.5 if resumed else 0.0)}, update, log=False)
(tracker,) = ctx.accelerator.trackers
print(json.dumps({"task": tracker.task.id, "warnings": [str(w.message) for w in caught]}), file=sys.stderr)
ctx.accelerator.end_training()
ctx.close()
"""


def test_a_resume_goes_on_with_clearml(tmp_path):
    """A run logs updates 1-5 to an offline ClearML session, which a kill then leaves with a last line cut short (appended
    by hand). Resumed at update 4, the run finds the session by its tag (the run's id), cuts the unfinished line off
    (ClearML would glue its next line to it), goes on with the session, its iterations as given (ClearML would shift them
    past the last it holds), and sends it update 6 only."""
    import json

    cache, home = tmp_path / "clearml", tmp_path / "home"
    home.mkdir()
    (home / "clearml.conf").write_text("sdk { development { report_use_subprocess: false } }\n")  # (see tracked_run.py)
    env = {**ENV, "HOME": str(home), "CLEARML_CACHE_DIR": str(cache), "CLEARML_OFFLINE_MODE": "1"}
    reports = []
    for run in ("first", "resumed"):
        result = subprocess.run(
            [sys.executable, "-c", CLEARML_RUN, run],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=helpers.scaled(120),
        )
        assert 0 == result.returncode, result.stderr[-3000:]
        reports.append(json.loads(next(line for line in result.stderr.splitlines() if line.startswith('{"task"'))))
        if run == "first":
            (session,) = [p for p in (cache / "offline").iterdir() if p.is_dir()]
            with open(session / "metrics.jsonl", "a") as f:
                f.write('[{"type": "training_stats_scalar", "iter": 6, "metr')

    assert reports[0]["task"] == reports[1]["task"] == session.name
    warned = reports[1]["warnings"]
    assert any("ended in a line a kill cut short: cut off" in w for w in warned), warned
    assert not any("cannot cut a series back" in w or "holds no run" in w for w in warned), warned
    assert {"train/loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.5)]} == helpers.clearml_series(cache)

    # a resumed state of another run: no session is tagged with its id, so it says so and starts a session of its own
    other = subprocess.run(
        [sys.executable, "-c", CLEARML_RUN, "resumed", "r-2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=helpers.scaled(120),
    )
    assert 0 == other.returncode, other.stderr[-3000:]
    report = json.loads(next(line for line in other.stderr.splitlines() if line.startswith('{"task"')))
    assert any(
        "ClearML holds no run of offline session tagged trainfold.run_id=r-2" in w for w in report["warnings"]
    ), report["warnings"]
    assert report["task"] != session.name
    assert {session.name, report["task"]} == {p.name for p in (cache / "offline").iterdir() if p.is_dir()}


AIM_RUNS = r"""
import json, sys, warnings
import attrs
from accelerate import Accelerator
from trainfold import init_trackers, testing
from trainfold._src.compose.tracking import emit


def run(run_id, resumed, given=None):
    testing.reset_accelerate_state()
    ctx, state, _, _ = testing.tiny_setup(seed=0, accelerator=Accelerator(cpu=True, log_with="aim", project_dir="."))
    state = attrs.evolve(state, run_id=run_id, step=4 if resumed else 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        init_trackers(ctx, "proj", state, init_kwargs={"aim": {"capture_terminal_logs": False, "system_tracking_interval": None,
                                                               **({"run_hash": given} if given else {})}})
    for update in (5, 6) if resumed else (1, 2, 3, 4, 5):
        emit(ctx, {"train/loss": update + (0.5 if resumed else 0.0)}, update, log=False)
    (tracker,) = ctx.accelerator.trackers
    report = {"run": tracker.writer.hash, "warnings": [str(w.message) for w in caught]}
    ctx.accelerator.end_training()
    ctx.close()
    return report


first, resumed, other = run("r-1", False), run("r-1", True), run("r-2", True)
given = run("r-3", True, given=first["run"])  # (one Aim has seen: Aim's list of runs is cached for 0.5 s in a process)
print(json.dumps({"first": first, "resumed": resumed, "other": other, "given": given}), file=sys.stderr)
"""


def test_a_resume_goes_on_with_aim(tmp_path):
    """A run logs updates 1-5 to Aim (a repository in the Accelerator's logging_dir). Resumed at update 4, it finds the Aim
    run by its tag (the run's id) and goes on with it: update 5 logged again replaces the value Aim held (one value per
    step), and update 6 follows. A resumed state of another run finds no run tagged with its id: it says so and starts
    an Aim run of its own. A run_hash given is the run a resumed state goes on with, whatever its tags."""
    import json

    result = subprocess.run(
        [sys.executable, "-c", AIM_RUNS],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
        timeout=helpers.scaled(180),
    )
    assert 0 == result.returncode, result.stderr[-3000:]
    made = json.loads(next(line for line in result.stderr.splitlines() if line.startswith('{"first"')))
    first, resumed, other, given = made["first"], made["resumed"], made["other"], made["given"]
    runs = helpers.aim_runs(tmp_path)

    assert first["run"] == resumed["run"]
    assert not any("cannot cut a series back" in w or "holds no run" in w for w in resumed["warnings"]), resumed[
        "warnings"
    ]
    assert {"train/loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.5), (6, 6.5)]} == runs[first["run"]]["series"]
    # another run's state: no run is tagged with its id, so it says so and starts a run of its own
    assert any("Aim holds no run of repository . tagged trainfold.run_id=r-2" in w for w in other["warnings"]), other[
        "warnings"
    ]
    assert {first["run"], other["run"]} == set(runs)
    assert ["trainfold.run_id=r-2"] == runs[other["run"]]["tags"]
    assert {"train/loss": [(5, 5.5), (6, 6.5)]} == runs[other["run"]]["series"]
    # a run_hash given: that run goes on (no warning, though no run is tagged r-3), and gets this run's tag too
    assert given["run"] == first["run"] and not any("holds no run" in w for w in given["warnings"]), given["warnings"]
    assert ["trainfold.run_id=r-1", "trainfold.run_id=r-3"] == runs[first["run"]]["tags"]
