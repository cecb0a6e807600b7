"""ClearML: a task tagged with the trainfold run's id; offline, a resumed run goes on with the session so tagged and is
sent only what its ``metrics.jsonl`` lacks; a checkpoint waits until its reporter thread has written what it was given."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from trainfold._src.base.checks import user_stacklevel
from trainfold._src.backend.trackers.protocol import RUN_TAG, GoingOn, Vendor, warn_no_run


def _offline() -> bool:
    """Whether ClearML runs offline (``Task.set_offline(True)``, or ``CLEARML_OFFLINE_MODE``): its sessions are folders here."""
    from clearml import Task

    return bool(Task.is_offline())  # sync: none: a flag of ClearML's


def _task_of(run_id: str) -> str | None:
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


def prepare(run: GoingOn, mine: dict[str, Any]) -> bool:
    """Tag the ClearML task with the trainfold run's id; offline, a resumed run goes on with the session so tagged, its
    iterations as logged (``continue_last_task=0``: ClearML would otherwise shift them past the last it holds).
    Whether the resumed run's ClearML goes on without what it holds (offline; online nothing here can read the server)."""
    tag = f"{RUN_TAG}{run.run_id}"
    mine["tags"] = [*(t for t in (mine.get("tags") or []) if t != tag), tag]
    if run.step == 0 or not run.main:
        return True
    if not _offline():
        return False
    if mine.get("reuse_last_task_id") or mine.get("continue_last_task"):
        mine.setdefault("continue_last_task", 0)
        return True
    found = _task_of(run.run_id)
    if found is None:
        warn_no_run("ClearML", f"offline session tagged {tag}", run, "CLEARML_CACHE_DIR")
        return True
    _mend_session(found)
    mine.update(reuse_last_task_id=found, continue_last_task=0)
    return True


def _mend_session(task_id: str) -> None:
    """Cut off a last line a kill left unfinished in the offline session's ``.jsonl`` files, which ClearML appends to:
    its next line would be glued to it and lost. The values on it came after the last checkpoint (each checkpoint waits
    until ClearML has written what it was given), so the resumed run logs them again."""
    from clearml.config import get_offline_dir

    for path in sorted(Path(get_offline_dir(task_id)).glob("*.jsonl")):
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
            warnings.warn(
                f"init_trackers: ClearML's {path} ended in a line a kill cut short: cut off (what it held came after "
                "the checkpoint, and the resumed run logs it again).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def holds(tracker: Any, at: int) -> dict[str, int]:
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
        warnings.warn(
            f"init_trackers: ClearML's {path} could not be read ({type(exc).__name__}: {exc}), so what the run before "
            f"logged at or after update {at} may appear twice there.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
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
                for key in (title, f"train_{title}") if series == "train" else (f"{series}_{title}",):
                    last[key] = max(last.get(key, step), step)
    return {key: step for key, step in last.items() if step >= at}


def flush(tracker: Any) -> None:
    """Write what the task was given: its reporter's thread writes every event, and is waited for."""
    task = getattr(tracker, "task", None)
    if task is not None:
        task.flush(wait_for_uploads=True)  # its reporter's thread writes every event it was given, and is waited for


VENDOR = Vendor(prepare=prepare, holds=holds, flush=flush)
