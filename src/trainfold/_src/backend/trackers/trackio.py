"""Trackio: a run marked with the trainfold run's id (in its config); a resumed run goes on with the run so marked and
is sent only what its store lacks; a checkpoint waits until its sender thread has written what it was given."""

from __future__ import annotations

import warnings
from typing import Any

from trainfold._src.base.checks import user_stacklevel
from trainfold._src.backend.trackers.protocol import GoingOn, Vendor, warn_no_run


#: The config key with which ``init_trackers`` marks a Trackio run as this trainfold run's (``TrainState.run_id``).
RUN_KEY = "trainfold.run_id"


def _run_of(project_name: str, run_id: str) -> str | None:
    """The name of the newest Trackio run of ``project_name`` whose config holds trainfold's ``run_id``, or None."""
    from trackio import Api

    try:
        runs = list(Api().runs(project_name))
    except ValueError:  # no such project
        return None
    found = [run.name for run in runs if (run.config or {}).get(RUN_KEY) == run_id]
    return found[-1] if found else None


def holds(tracker: Any, at: int) -> dict[str, int]:
    """Each metric of the Trackio run ``tracker`` goes on with, and the last step its store holds, where that is ``at``
    or later. Read with the store's own reader (``SQLiteStorage.get_logs``, what ``trackio get`` uses: Trackio has no
    public reader of a run's values); where it cannot be read, a warning says what may appear twice."""
    run = tracker.run  # (a Trackio run)
    try:
        from trackio.sqlite_storage import SQLiteStorage

        rows = SQLiteStorage.get_logs(run.project, run.name, run_id=getattr(run, "id", None))
        last: dict[str, int] = {}
        for row in rows:
            step = int(row["step"])
            for key in row.keys() - {"step", "timestamp"}:
                last[key] = max(last.get(key, step), step)
    except Exception as exc:  # another trackio's store, a database it cannot open: the run goes on
        warnings.warn(
            f"init_trackers: Trackio's run {run.name!r} of project {run.project!r} could not be read ({type(exc).__name__}: "
            f"{exc}), so what the run before logged at or after update {at} may appear twice there.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return {}
    return {key: step for key, step in last.items() if step >= at}


def prepare(run: GoingOn, mine: dict[str, Any]) -> bool:
    """Mark the Trackio run with the trainfold run's id (in its config); a resumed run goes on with the run so marked."""
    mine["config"] = {**(mine.get("config") or {}), RUN_KEY: run.run_id}
    if run.step == 0 or not run.main:
        return True
    if mine.get("name"):
        mine.setdefault("resume", "allow")  # the run named goes on (trackio's default, "never", would start another)
        return True
    found = _run_of(run.project, run.run_id)
    if found is None:
        warn_no_run("Trackio", f"project {run.project!r} whose config has {RUN_KEY}={run.run_id}", run, "TRACKIO_DIR")
        return True
    mine.update(name=found, resume="must")
    return True


def flush(tracker: Any) -> None:
    """Write what the run was given. Trackio has no public way to: its local sender's own step is called (Trackio 0.43's
    ``Run._flush_queues_inline``, under ``Run._client_lock``)."""
    run = getattr(tracker, "run", None)
    lock, write = getattr(run, "_client_lock", None), getattr(run, "_flush_queues_inline", None)
    if lock is None or write is None or not getattr(run, "_is_local", False):
        return  # another Trackio (a server's, another version): not waited for, as before
    with lock:  # what its sender thread does every half second, done now, under the sender's own lock
        write()


VENDOR = Vendor(prepare=prepare, holds=holds, flush=flush)
