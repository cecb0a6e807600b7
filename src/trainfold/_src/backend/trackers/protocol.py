"""What a tracker vendor's module gives trainfold: one :class:`Vendor`, taking plain values (:class:`GoingOn`).

A vendor prepares its own ``init_kwargs`` before Accelerate starts it (a run tagged
with the trainfold run's id; for a resumed run, the vendor's run to go on with), and
may read what it holds at or after the update the run goes on from (so that it is
not sent again), do something once it is started, and be waited for at a checkpoint
until it has written what it was given (a tracker that writes from a thread).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import attrs

from trainfold._src.base.checks import user_stacklevel

#: The tag with which a ClearML task or an Aim run is marked as a trainfold run's (followed by its ``run_id``).
RUN_TAG = "trainfold.run_id="


@attrs.frozen
class GoingOn:
    """The run a tracker is started for: its project, its trainfold ``run_id``, the update it goes on from (0: a new
    run), whether this is the process that talks to the trackers, and the Accelerator's ``logging_dir``."""

    project: str
    run_id: str
    step: int
    main: bool
    logging_dir: str | None = None


#: ``prepare(run, its_init_kwargs)``: edits the vendor's keyword arguments in place; whether a resumed run goes on without
#: what the tracker holds
Prepare = Callable[[GoingOn, dict[str, Any]], bool]
#: ``holds(tracker, step)``: each key the tracker holds at or after ``step``, with the last step it holds
Holds = Callable[[Any, int], dict[str, int]]


@attrs.frozen
class Vendor:
    """One tracker vendor: ``prepare(run, its_init_kwargs)`` edits its keyword arguments in place and says whether a
    resumed run goes on without what the tracker holds; ``holds(tracker, step)`` is each key it holds at or after
    ``step``, with the last step it holds; ``started(tracker, run)`` runs once it is started; ``flush(tracker)`` waits
    until it has written what it was given; ``replaces``: it keeps one value per step, so a step logged again
    replaces what it held."""

    prepare: Prepare
    holds: Holds | None = None
    started: Callable[[Any, GoingOn], None] | None = None
    flush: Callable[[Any], None] | None = None
    replaces: bool = False


def warn_no_run(tracker: str, which: str, run: GoingOn, store: str) -> None:
    """Say that ``tracker`` holds no run of this trainfold run's (``which``), so the resumed run starts a new one."""
    warnings.warn(
        f"init_trackers: {tracker} holds no run of {which}, so this run, resumed at update {run.step}, starts a new one "
        f"(is {store} the run's store?).",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
