"""Where the run is inside an epoch: the live iteration, or what a checkpoint says to resume."""

from __future__ import annotations

from typing import Any

import attrs

from ._rng import RngStates


@attrs.frozen
class EpochCursor:
    """The epoch being iterated by ``run_epoch``: its iterator, its loader and its starting random state.

    Between epochs ``iterator`` and ``epoch_start`` are None and only the loader is kept.
    ``interrupted``: ``run_epoch`` stopped before the loader's end and returned; the
    iterator is left open, so a later ``run_epoch`` continues it.
    """

    iterator: Any = attrs.field(repr=False)
    loader: Any = attrs.field(repr=False)
    epoch_start: RngStates | None = attrs.field(repr=False)
    interrupted: bool = False


@attrs.frozen
class Resume:
    """What ``load_checkpoint`` found: the random states to restore and the batch read ahead, if any."""

    epoch_start: RngStates | None = attrs.field(repr=False)
    now: RngStates = attrs.field(repr=False)
    read_ahead: tuple[bool, Any] = attrs.field(repr=False)
    #: batches per epoch of the interrupted epoch's loader (None if unknown)
    epoch_length: int | None = None
