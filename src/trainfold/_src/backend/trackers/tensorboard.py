"""TensorBoard: a resumed run cuts its series back to the checkpoint (``purge_step``), and is not sent again what
it holds at the checkpoint's own update."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from trainfold._src.base.checks import user_stacklevel
from trainfold._src.backend.trackers.protocol import GoingOn, Vendor


def holds(tracker: Any, at: int) -> dict[str, int]:
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
        warnings.warn(
            f"init_trackers: TensorBoard's events in {log_dir} could not be read ({type(exc).__name__}: {exc}), so "
            f"what the run before logged at update {at} after its checkpoint may appear twice there.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return {}
    finally:
        tb_logger.setLevel(level)
    return {tag: at for tag in events.Tags()["scalars"] if any(e.step == at for e in events.Scalars(tag))}


def prepare(run: GoingOn, kwargs: dict[str, Any]) -> bool:
    """Cut the series back to the update the run goes on from (a ``purge_step`` given is kept)."""
    if run.step > 0:
        kwargs.setdefault("purge_step", run.step + 1)
    return True


VENDOR = Vendor(prepare=prepare, holds=holds)
