"""Where the run is inside an epoch: the live iteration, or what a checkpoint says to resume."""

from __future__ import annotations

from typing import Any

import attrs

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
    """

    iterator: Any = attrs.field(repr=False)
    loader: Any = attrs.field(repr=False)
    epoch_start: RngStates | None = attrs.field(repr=False)
    interrupted: bool = False
    resumed_at: tuple[int, int] | None = None


@attrs.frozen
class Resume:
    """What ``load_checkpoint`` found: the random states to restore and the batch read ahead, if any."""

    epoch_start: RngStates | None = attrs.field(repr=False)
    now: RngStates = attrs.field(repr=False)
    read_ahead: tuple[bool, Any] = attrs.field(repr=False)
    #: batches per epoch of the interrupted epoch's loader (None if unknown)
    epoch_length: int | None = None
    #: samples of the epoch's order done, over every process (None: not recorded, or unknown)
    samples_done: int | None = None
    #: the epoch can only be continued by its position in samples (it was itself continued on another number of processes)
    by_samples: bool = False
    #: what the saving run had: processes, samples per batch over every process, accumulation steps (for the warning)
    saved_layout: tuple[int, int | None, int] | None = None
    #: this run has another number of processes than the one that saved
    elastic: bool = False
