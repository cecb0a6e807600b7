"""Which process holds the others up, and why: per-process figures carried in the watch's one reduction.

Owned here: :func:`slots` (this process's figures, in its own slots of a vector that the report's all-reduce sums:
every process's figures come back to every process, with no other collective), :func:`per_process` (the report's
figures and the stragglers it names) and :func:`epoch_stragglers` (how often an epoch's reports named one).

A process is a straggler when one of its figures exceeds the median process's by more than a share of an update's
time (``Watch(stragglers=...)``, and at least ``Watch(straggler_min_s=...)``): of kind ``input`` where the figure is
its wait for the loader, ``compute`` where it is its forward and backward up to its last gradient. The figures are
host times (:class:`~trainfold._src.core.clock.Compute` says where each is read).
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from typing import Any, Sequence

import torch

#: The per-process figures, in their order in the reduced vector: the wait for the loader, the forward and backward up
#: to the last gradient, and the rest of the backward (the wait for the gradients' collectives).
FIGURES = ("data", "compute", "collective")

#: The kind of straggler each figure names (the collective wait names none: it is the others' waiting).
KINDS = {"data": "input", "compute": "compute"}

logger = logging.getLogger("trainfold")


def slots(rank: int, processes: int, figures: Sequence[float]) -> torch.Tensor:
    """This process's ``figures`` in its own slots of a vector of ``len(figures) * processes`` (zeros elsewhere): their
    sum over processes holds every process's figures, figure by figure.

    Examples:
        >>> slots(1, 3, [0.5, 2.0]).tolist()
        [0.0, 0.5, 0.0, 0.0, 2.0, 0.0]
    """
    out = torch.zeros(len(figures), processes, dtype=torch.float64)
    out[:, rank] = torch.tensor(list(figures), dtype=torch.float64)
    return out.reshape(-1)


def per_process(
    summed: Sequence[float], processes: int, updates: int, seconds: float, share: float, floor_s: float
) -> dict[str, float]:
    """The report's per-process figures, each in seconds per update: ``<figure>_s_median``, ``<figure>_s_max`` and
    ``<figure>_s_max_process`` for ``data``, ``compute`` and ``collective``; and ``straggler_input`` or
    ``straggler_compute``, the process whose data wait or compute exceeds the median's by more than ``share`` of an
    update's time (``seconds / updates``) and more than ``floor_s``.

    Examples:
        >>> figures = [0.01, 0.01, 0.31, 0.01] + [0.4] * 4 + [0.3, 0.3, 0.0, 0.3]  # process 2 waited for its data
        >>> out = per_process(figures, 4, 1, 0.72, 0.25, 0.01)
        >>> out["straggler_input"], out["data_s_max"], out["data_s_median"], "straggler_compute" in out
        (2.0, 0.31, 0.01, False)
    """
    updates = max(updates, 1)
    limit = max(share * seconds / updates, floor_s)
    out: dict[str, float] = {}
    for k, figure in enumerate(FIGURES):
        values = [v / updates for v in summed[k * processes : (k + 1) * processes]]
        top = max(range(processes), key=values.__getitem__)
        median = statistics.median(values)
        out[f"{figure}_s_median"], out[f"{figure}_s_max"] = median, values[top]
        out[f"{figure}_s_max_process"] = float(top)  # sync: none: host numbers (after the report's reduction)
        if figure in KINDS and values[top] - median > limit:
            out[f"straggler_{KINDS[figure]}"] = float(top)  # sync: none: a host int
    return out


def say(values: dict[str, float], update: int, share: float) -> None:
    """Name each straggler of a report on the ``trainfold`` logger (a warning: the job is as slow as that process)."""
    for figure, kind in KINDS.items():
        if f"straggler_{kind}" not in values:
            continue
        waited = "waited for its data" if kind == "input" else "computed its forward and backward"
        logger.warning(
            "update %d: process %d holds the others up (%s): it %s %.3g s per update, the median process %.3g s "
            "(named beyond %.0f%% of an update's time)",
            update,
            int(values[f"straggler_{kind}"]),
            kind,
            waited,
            values[f"{figure}_s_max"],
            values[f"{figure}_s_median"],
            share * 100,
        )


class Named:
    """How often this epoch's reports named a straggler of each kind, and which process (host counts: the reports'
    values are the same on every process, so the counts are too)."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter[int]] = {kind: Counter() for kind in KINDS.values()}

    def note(self, values: dict[str, float]) -> None:
        for kind, counts in self.counts.items():
            if f"straggler_{kind}" in values:
                counts[int(values[f"straggler_{kind}"])] += 1

    def take(self) -> dict[str, float]:
        """``stragglers_<kind>`` (the reports that named one) and, where some did, ``straggler_<kind>_process`` (the
        process named most often); and start the next epoch from zero."""
        out: dict[str, float] = {}
        for kind, counts in self.counts.items():
            out[f"stragglers_{kind}"] = float(sum(counts.values()))  # sync: none: host counts
            if counts:
                out[f"straggler_{kind}_process"] = float(counts.most_common(1)[0][0])  # sync: none: a host int
            counts.clear()
        return out


def epoch_stragglers(clock: Any) -> dict[str, float]:
    """The epoch's straggler counts for its record, where the watch names stragglers (``{}`` otherwise)."""
    named: Named | None = getattr(clock, "named", None)
    return named.take() if named is not None else {}
