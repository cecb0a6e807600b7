"""Aim: a run tagged with the trainfold run's id; a resumed run goes on with the run so tagged, and each update it logs
again replaces the value Aim held for it (Aim keeps one value per step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainfold._src.backend.trackers.protocol import RUN_TAG, GoingOn, Vendor, warn_no_run


def _run_of(repo: str, run_id: str) -> str | None:
    """The hash of the newest run of the Aim repository in ``repo`` tagged with trainfold's ``run_id``, or None (no such
    run, or no repository there). Read from the repository's table of runs, where Aim keeps a run's tags as soon as they
    are added, a killed run's too; Aim's queries read an index its UI builds, which a killed run is not in yet."""
    if not (Path(repo) / ".aim").is_dir():
        return None
    from aim.sdk.repo import Repo

    tag = f"{RUN_TAG}{run_id}"
    found = [
        (run.creation_time or 0.0, run.hash)
        for run in Repo.from_path(repo).structured_db.runs()
        if tag in (run.tags or [])
    ]
    return max(found)[1] if found else None


def prepare(run: GoingOn, mine: dict[str, Any]) -> bool:
    """A resumed run goes on with the Aim run tagged with the trainfold run's id (``run_hash``), in the repository in the
    Accelerator's ``logging_dir`` (where Accelerate's ``AimTracker`` keeps it); a ``run_hash`` given is kept."""
    if run.step == 0 or not run.main or mine.get("run_hash"):
        return True
    repo = str(run.logging_dir)  # (Accelerate refuses Aim without one) AimTracker's Run(repo=logging_dir)
    found = _run_of(repo, run.run_id)
    if found is None:
        warn_no_run("Aim", f"repository {repo} tagged {RUN_TAG}{run.run_id}", run, "the Accelerator's logging_dir")
        return True
    mine["run_hash"] = found
    return True


def started(tracker: Any, run: GoingOn) -> None:
    """Tag the Aim run ``tracker`` writes to with the trainfold run's id (a run gone on with has it: Aim keeps a tag once)."""
    tracker.writer.add_tag(f"{RUN_TAG}{run.run_id}")


VENDOR = Vendor(prepare=prepare, started=started, replaces=True)
