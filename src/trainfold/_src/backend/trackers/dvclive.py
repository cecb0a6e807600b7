"""DVCLive: a resumed run goes on with its files (``resume=True``: its default empties the folder) and is sent only
what they lack; a file a kill cut short is set aside first."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from trainfold._src.base.checks import user_stacklevel
from trainfold._src.backend.trackers.protocol import GoingOn, Vendor


def holds(tracker: Any, at: int) -> dict[str, int]:
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
            warnings.warn(
                f"init_trackers: DVCLive's {path} could not be read ({type(exc).__name__}: {exc}), so what the run "
                f"before logged to it at or after update {at} may appear twice there.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
            continue
        if steps and max(steps) >= at:
            holds[path.relative_to(folder).with_suffix("").as_posix()] = max(steps)
    return holds


def prepare(run: GoingOn, mine: dict[str, Any]) -> bool:
    """Have DVCLive go on with its folder for a resumed run (``resume=True``: its default, and Accelerate's, empties it,
    deleting the run's series), first setting aside the files a kill cut short, which DVCLive reads then and fails on:
    it rewrites them in place (its summary at every step, its parameters at every start)."""
    if run.step == 0:
        return True
    if not mine.setdefault("resume", True) or not run.main:
        return True
    folder = Path(mine.get("dir", "dvclive"))  # (Live's own default folder, and its file names)
    for path, what, again in (
        (folder / "metrics.json", "summary", "DVCLive writes a new one as the run logs"),
        (folder / "params.yaml", "parameters", "the config given to init_trackers is written again"),
    ):
        if path.is_file() and not _whole_file(path):
            aside = path.with_name(path.name + ".damaged")
            os.replace(path, aside)
            warnings.warn(
                f"init_trackers: DVCLive's {what} {path} is cut short (a kill while DVCLive wrote it), and DVCLive "
                f"would fail on it: set aside as {aside}; {again}. Its series, the .tsv files under plots/metrics, go "
                "on whole.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
    return True


def _whole_file(path: Path) -> bool:
    """Whether DVCLive can read back its summary (JSON) or parameters (YAML) file ``path``: a mapping."""
    try:
        if path.suffix == ".json":
            return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
        from dvclive.serialize import load_yaml  # DVCLive's own reader of it

        return isinstance(load_yaml(path), dict)
    except Exception:  # (its reader's error for a damaged file: ValueError, DVCLive's YAMLFileCorruptedError...)
        return False


VENDOR = Vendor(prepare=prepare, holds=holds)
