"""Accelerate's trackers, vendor by vendor: how a resumed run goes on with each one's run, and how a checkpoint waits
for those that write behind.

One module per vendor, each giving a :class:`~trainfold._src.backend.trackers.protocol.Vendor`
that takes plain values; :func:`vendor` finds one by the name Accelerate gives it. A vendor not
here (Weights & Biases, Comet, SwanLab) is started as given.

A tracker that writes from a thread of its own loses, at a kill, what it had not
written yet. What it was given after the last checkpoint, a resumed run logs
again; what it was given before, it does not: a hole in the series. So a
checkpoint first has each such tracker write out what it holds (:func:`flush_trackers`).
TensorBoard (Accelerate flushes it at every ``log``), MLflow and DVCLive write
as they are given, and need nothing; ClearML and Trackio write from a thread.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from trainfold._src.backend.trackers.protocol import GoingOn, Vendor
from trainfold._src.base.checks import user_stacklevel

#: The vendors by Accelerate's names for them, each in the module of that name here (imported when it is asked for:
#: a vendor's own package is imported only by a run that uses it).
NAMES = ("tensorboard", "mlflow", "dvclive", "trackio", "clearml", "aim")

__all__ = ["NAMES", "GoingOn", "Vendor", "flush_trackers", "vendor"]


def vendor(name: str) -> Vendor | None:
    """The :class:`Vendor` of the tracker Accelerate calls ``name``, or None for one trainfold does not know."""
    if name not in NAMES:
        return None
    found: Vendor = importlib.import_module(f"{__name__}.{name}").VENDOR
    return found


def flush_trackers(accelerator: Any) -> None:
    """Have each tracker of ``accelerator`` that writes behind write what it was given (on the main process, where they run).

    A tracker that fails to is named in a warning, and the checkpoint goes on: a tracker's trouble
    must not cost the run its checkpoint.
    """
    if not accelerator.is_main_process:
        return
    for tracker in getattr(accelerator, "trackers", ()):
        name = getattr(tracker, "name", "")
        found = vendor(name)
        if found is None or found.flush is None:
            continue
        try:
            found.flush(tracker)
        except Exception as exc:  # (ClearML's or Trackio's own error, whatever it is)
            warnings.warn(
                f"{name} could not be made to write what it was given before this checkpoint ({type(exc).__name__}: {exc}); "
                "the checkpoint goes on, and a kill now may lose the values it had not written.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
