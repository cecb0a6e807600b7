"""Where the run is inside an epoch: the live iteration (:class:`EpochCursor`), what a checkpoint records of it
(:class:`EpochPosition`), and what a load found to resume it (:class:`Resume`).

A state's ``cursor`` is one of the first and the last, or None before the first epoch. ``run_epoch``
chooses, once per epoch, how an epoch starts from it (``_start_epoch``: go on in this process, start
afresh, close an epoch a step ended, continue by the sampler's order, by reading the consumed part
again, or by the position in samples on another number of processes).
"""

from __future__ import annotations

from typing import Any

import attrs

from trainfold._src.backend.streams import StreamState
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
class EpochPosition:
    """What a checkpoint records of an epoch in progress, per process: enough to continue it exactly.

    Made by ``save_checkpoint`` from the live :class:`EpochCursor`, written in the process's own
    files, read back into a :class:`Resume`.
    """

    #: the random states the epoch started from (the sampler's permutation is drawn again under them)
    epoch_start: RngStates = attrs.field(repr=False)
    #: whether the loader had read a batch ahead of the last one stepped on, and that batch
    read_ahead: tuple[bool, Any] = attrs.field(repr=False)
    #: batches per epoch of the interrupted epoch's loader (None if unknown)
    epoch_length: int | None = None
    #: samples of the epoch's order done, over every process (None: not recorded, or unknown)
    samples_done: int | None = None
    #: the epoch can only be continued by its position in samples (it was itself continued on another number of processes)
    by_samples: bool = False
    #: where the stream stood, said by a source with ``state_dict()`` (None: not a stream, or one read again)
    stream: StreamState | None = attrs.field(default=None, repr=False)
    #: process 0 read the stream and dispatched each batch (Accelerate's ``dispatch_batches``): its state is the whole
    #: stream's position, so the epoch can go on on another number of processes
    dispatched: bool = False
    #: how this process's part of the stream stood to the whole (``streams.WHOLE``, ``streams.PART``; None: unknown),
    #: what a resume on another number of processes deals out anew
    dealt: str | None = None
    #: what identifies the stream's data (``streams.source_identity``: its files and sizes, a user's ``source_id()``),
    #: checked at a resume; None where it cannot be known
    source: Any = attrs.field(default=None, repr=False)


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
