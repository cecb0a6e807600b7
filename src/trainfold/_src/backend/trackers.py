"""Accelerate's trackers that write behind: a checkpoint waits until they have written what they were given.

A tracker that writes from a thread of its own loses, at a kill, what it had not
written yet. What it was given after the last checkpoint, a resumed run logs
again; what it was given before, it does not: a hole in the series. So a
checkpoint first has each such tracker write out what it holds (:func:`flush_trackers`).
TensorBoard (Accelerate flushes it at every ``log``), MLflow and DVCLive write
as they are given, and need nothing; ClearML and Trackio write from a thread.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from trainfold._src.base.checks import user_stacklevel


def _clearml(tracker: Any) -> None:
    task = getattr(tracker, "task", None)
    if task is not None:
        task.flush(wait_for_uploads=True)  # its reporter's thread writes every event it was given, and is waited for


def _trackio(tracker: Any) -> None:
    run = getattr(tracker, "run", None)
    lock, flush = getattr(run, "_client_lock", None), getattr(run, "_flush_queues_inline", None)
    if lock is None or flush is None or not getattr(run, "_is_local", False):
        return  # another Trackio (a server's, another version): not waited for, as before
    with lock:  # what its sender thread does every half second, done now, under the sender's own lock
        flush()


#: Per tracker (Accelerate's name), how to wait until what it was given is written. Trackio has no public way to: its
#: local sender's own step is called (Trackio 0.43's ``Run._flush_queues_inline``, under ``Run._client_lock``).
FLUSHES: dict[str, Callable[[Any], None]] = {"clearml": _clearml, "trackio": _trackio}


def flush_trackers(accelerator: Any) -> None:
    """Have each tracker of ``accelerator`` that writes behind write what it was given (on the main process, where they run).

    A tracker that fails to is named in a warning, and the checkpoint goes on: a tracker's trouble
    must not cost the run its checkpoint.
    """
    if not accelerator.is_main_process:
        return
    for tracker in getattr(accelerator, "trackers", ()):
        name = getattr(tracker, "name", "")
        flush = FLUSHES.get(name)
        if flush is None:
            continue
        try:
            flush(tracker)
        except Exception as exc:  # (ClearML's or Trackio's own error, whatever it is)
            warnings.warn(f"{name} could not be made to write what it was given before this checkpoint ({type(exc).__name__}: {exc}); "
                          "the checkpoint goes on, and a kill now may lose the values it had not written.", UserWarning,
                          stacklevel=user_stacklevel())
