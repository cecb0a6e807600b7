"""Accelerate's trackers that write behind: a checkpoint waits until they have written what they were given.

A tracker that writes from a thread of its own loses, at a kill, what it had not
written yet. What it was given after the last checkpoint, a resumed run logs
again; what it was given before, it does not: a hole in the series. So a
checkpoint first has each such tracker write out what it holds (:func:`flush_trackers`).
TensorBoard (Accelerate flushes it at every ``log``), MLflow and DVCLive write
as they are given, and need nothing.
"""

from __future__ import annotations

from typing import Any, Callable


def _clearml(tracker: Any) -> None:
    task = getattr(tracker, "task", None)
    if task is not None:
        task.flush(wait_for_uploads=True)  # its reporter's thread writes every event it was given, and is waited for


#: Per tracker (Accelerate's name), how to wait until what it was given is written. Trackio has no public way to.
FLUSHES: dict[str, Callable[[Any], None]] = {"clearml": _clearml}


def flush_trackers(accelerator: Any) -> None:
    """Have each tracker of ``accelerator`` that writes behind write what it was given (on the main process, where they run)."""
    if not accelerator.is_main_process:
        return
    for tracker in getattr(accelerator, "trackers", ()):
        flush = FLUSHES.get(getattr(tracker, "name", ""))
        if flush is not None:
            flush(tracker)
