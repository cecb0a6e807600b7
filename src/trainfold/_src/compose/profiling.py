"""``profile``: a step transformer that profiles a window of steps with ``torch.profiler``, one trace file per process.

Owned here: :func:`profile` and its record :class:`ProfileState` in
``state.extras["profile"]``. The profiler is built from Accelerate's
``ProfileKwargs`` (the Accelerator's own handler when it has one), its schedule
the window asked for; outside the window the transformer costs one flag test
per step.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import attrs

from trainfold._src.base.checks import name_of, named, positive_int, user_stacklevel
from trainfold._src.base.records import register_record
from trainfold._src.base.types import Batch
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import Step, StepTransformer

NAME = "profile"


@register_record
@attrs.frozen
class ProfileState:
    """``state.extras["profile"]``: the profiled window is over (a resumed run does not profile it again), and its trace files."""

    done: bool = False
    traces: tuple[str, ...] = ()


class _Window:
    """The running profiler of a :func:`profile` transformer (a handle: never in the state) and its steps so far."""

    def __init__(self) -> None:
        self.profiler: Any = None
        self.taken = 0
        self.over = False

    def start(self, profiler: Any) -> None:
        profiler.__enter__()
        self.profiler, self.taken = profiler, 0

    def close(self) -> None:
        profiler, self.profiler, self.over = self.profiler, None, True
        if profiler is not None:
            profiler.__exit__(None, None, None)


def profile(
    ctx: Context,
    trace_dir: str | os.PathLike[str] | None = None,
    *,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    handler: Any = None,
) -> StepTransformer:
    """Profile a window of steps with ``torch.profiler`` and write one Chrome trace per process.

    The first ``wait`` steps (micro-batches) after the transformer first runs are
    skipped, the next ``warmup`` traced and thrown away (the profiler's own start-up),
    the next ``active`` recorded: ``torch.profiler.schedule(wait, warmup, active)``,
    with ``profiler.step()`` after each step, as Accelerate's ``profiler.py`` example
    calls it. When the window ends (or the run stops inside it) each process writes
    ``trace_dir/profile_<rank>.json`` (Accelerate's file name; open it in Perfetto or
    ``chrome://tracing``), and the profiler is closed: after the window a step costs
    one flag test. ``state.extras["profile"]`` records that the window is done (so a
    run resumed from a checkpoint does not profile again) and the files written.

    Args:
        ctx: the run's Context.
        trace_dir: where each process writes its trace; None takes the handler's
            ``output_trace_dir`` (Accelerate's ``ProfileKwargs(output_trace_dir=...)``), and
            writes none without it (pass a ``handler`` with ``on_trace_ready`` to read the
            profiler yourself). Each window keeps its record under ``extras["profile:<trace_dir>"]``
            (``extras["profile"]`` without one): a second window in a run writes to another folder.
        wait: steps skipped before the window (non-negative).
        warmup: steps traced and thrown away (the profiler's own start-up; non-negative).
        active: steps recorded (a positive int).
        handler: an ``accelerate.utils.ProfileKwargs`` for the profiler's other
            settings (activities, ``record_shapes``, ``profile_memory``, ``with_stack``,
            ``with_flops``...); by default the Accelerator's own
            (``Accelerator(kwargs_handlers=[ProfileKwargs(...)])``), else Accelerate's
            defaults. Its ``schedule_option`` is replaced by the window.

    Returns:
        A step transformer.

    Raises:
        ValueError: a window count that is negative, or ``active`` that is not positive.

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> folder = tempfile.mkdtemp()
        >>> state = run_epoch(ctx, profile(ctx, folder, wait=0, warmup=1, active=2)(make_step(ctx, loss_fn)), loader, state)
        >>> record = state.extras[f"profile:{folder}"]
        >>> record.done, [Path(t).name for t in record.traces]
        (True, ['profile_0.json'])
    """
    positive_int("active", active)
    for name, value in (("wait", wait), ("warmup", warmup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int (got {value!r}).")
    from accelerate.utils import ProfileKwargs

    accelerator = ctx.accelerator
    base = handler if handler is not None else getattr(accelerator, "profile_handler", None) or ProfileKwargs()
    if trace_dir is None and getattr(
        base, "output_trace_dir", None
    ):  # ProfileKwargs(output_trace_dir=...): Accelerate's own setting
        trace_dir = base.output_trace_dir
    folder = None if trace_dir is None else Path(trace_dir)
    key = (
        NAME if folder is None else f"{NAME}:{folder}"
    )  # each window its record: a second one (another folder) profiles too
    path = None if folder is None else folder / f"profile_{accelerator.process_index}.json"
    window = wait + warmup + active
    written: list[str] = []
    run = _Window()

    def on_trace_ready(prof: Any) -> None:
        if base.on_trace_ready is not None:
            base.on_trace_ready(prof)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            written.append(str(path))

    def transform(step: Step) -> Step:
        def profiled(state: TrainState, batch: Batch) -> TrainState:
            if run.over:
                return step(state, batch)
            if run.profiler is None:
                record = state.extras.get(key)
                if record is not None and record.done:  # profiled before this checkpoint (or this window already ran)
                    warnings.warn(
                        f"profile: the window {'writing to ' + str(folder) if folder else 'without a trace folder'} was profiled "
                        f"already in this run ({list(record.traces)}), so it is not profiled again (a run resumed from a "
                        "checkpoint does not repeat it); give a second window another trace_dir.",
                        UserWarning,
                        stacklevel=user_stacklevel(),
                    )
                    run.over = True
                    return step(state, batch)
                schedule = {"wait": wait, "warmup": warmup, "active": active, "repeat": 1}
                run.start(dataclasses.replace(base, schedule_option=schedule, on_trace_ready=on_trace_ready).build())
            try:
                new = step(state, batch)
            except BaseException:
                run.close()
                raise
            run.profiler.step()
            run.taken += 1
            if run.taken < window and not new.should_stop:
                return new
            run.close()  # a window cut short by a stop writes what it recorded
            return new.with_extra(key, ProfileState(True, tuple(written)))

        return named(profiled, f"profile({wait}, {warmup}, {active})({name_of(step)})")

    return transform
