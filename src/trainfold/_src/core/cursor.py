"""Where the run is inside an epoch: the live iteration (:class:`EpochCursor`), what a checkpoint records of it
(``backend.position.EpochPosition``), and what a load found to resume it (:class:`Resume`).

A state's ``cursor`` is one of the first and the last, or None before the first epoch. ``run_epoch``
chooses, once per epoch, how an epoch starts from it (``_start_epoch``: go on in this process, start
afresh, close an epoch a step ended, or continue an interrupted one: ``backend.position.resume_in_epoch``).
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold._src.backend.position import EpochPosition
from trainfold._src.base.rng import RngStates


@attrs.frozen
class EpochCursor:
    """The epoch being iterated by ``run_epoch``: its iterator, its loader and its starting random state.

    Between epochs ``iterator`` and ``epoch_start`` are None and only the loader is kept.
    ``interrupted``: ``run_epoch`` stopped before the loader's end and returned; the
    iterator is left open, so a later ``run_epoch`` continues it.
    ``resumed_at``: for an epoch continued on another number of processes, the
    samples (of the epoch's order, over every process) done before and the batch
    count it continued from; then this iteration covers only the rest, and a
    checkpoint inside it records its position in samples.
    ``stream``: for an epoch over a stream continued on another number of
    processes, the reader of its rest (``streams.Redealt``), which says where the
    epoch stands in place of the loader's own stream.
    """

    iterator: Any = attrs.field(repr=False)
    loader: Any = attrs.field(repr=False)
    epoch_start: RngStates | None = attrs.field(repr=False)
    interrupted: bool = False
    resumed_at: tuple[int, int] | None = None
    stream: Any = attrs.field(default=None, repr=False)


@attrs.frozen
class Resume:
    """What ``load_checkpoint`` found: the random states of the moment of the save, and the epoch's position, if any."""

    #: the random states at the save (restored before the next batch is read)
    now: RngStates = attrs.field(repr=False)
    #: the interrupted epoch's position; None when the checkpoint fell between epochs
    position: EpochPosition | None = None
    #: what the saving run had: processes, samples per batch over every process, accumulation steps (for the warning)
    saved_layout: tuple[int, int | None, int] | None = None
    #: this run has another number of processes than the one that saved
    elastic: bool = False
    #: every saving process's position, in rank order, where the epoch's rest over a stream is dealt anew (read only then)
    peers: tuple[EpochPosition | None, ...] = ()
