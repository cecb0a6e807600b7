"""Where a prepared loader stands inside an epoch: read at a save (:func:`position_at_save`), and resumed from at a load
(:func:`resume_in_epoch`), the one place that chooses how.

An epoch is resumed one of five ways, by what its position says:

- **dealt anew**: a stream's rest, read whole by every process and dealt to this run's processes
  (``streams.resumed_elsewhere``), where the epoch was dealt anew before or goes on on another number of
  processes;
- **from the stream's state**: a stream that said where it stood goes on from there, in O(1)
  (``streams.resumed_from_state``; ``streams.resumed_dispatch`` where process 0 dispatches);
- **by samples**: an epoch saved on another number of processes goes on from its position in samples of
  the epoch's order (``loaders.resumed_by_samples``);
- **by the sampler's order, or by reading again**: the consumed batches skipped (``loaders.resumed_epoch``;
  ``streams.resumed_dispatch`` where process 0 dispatches).

Each draws the epoch's order under the random state the epoch began with and what follows under the
checkpoint's: the two moments ``_restorers`` puts back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

from trainfold._src.backend.loaders import (
    is_dispatcher,
    is_streamed,
    loader_generators,
    read_ahead_batch,
    resumed_by_samples,
    resumed_epoch,
    samples_per_batch,
)
from trainfold._src.backend.sources import check_source, source_identity
from trainfold._src.backend.streams import (
    WHOLE,
    StreamSource,
    StreamState,
    check_saved,
    dealing,
    kind_of,
    redeal,
    resumed_dispatch,
    resumed_elsewhere,
    resumed_from_state,
    stream_source,
    whole_stream,
)
from trainfold._src.base import rng
from trainfold._src.base.checks import length_or_none
from trainfold._src.base.rng import RngStates
from trainfold.errors import CheckpointError


@attrs.frozen
class EpochPosition:
    """What a checkpoint records of an epoch in progress, per process: enough to continue it exactly.

    Made by ``save_checkpoint`` (:func:`position_at_save`), written in the process's own files, read back
    into a ``Resume``.
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


def position_at_save(
    loader: Any,
    iterator: Any,
    epoch_start: RngStates,
    consumed: int,
    processes: int,
    *,
    resumed_at: tuple[int, int] | None = None,
    reader: Any = None,
) -> EpochPosition:
    """Where the epoch over ``loader``, iterated by ``iterator`` from ``epoch_start``, stands after ``consumed`` batches.

    ``resumed_at``: the samples and batches done before this iteration began, for an epoch continued on another
    number of processes (its position is then in samples); ``reader``: the reader of a stream's rest dealt anew
    (``streams.Redealt``), which says where the epoch stands in place of the loader's own stream.
    """
    read_ahead = read_ahead_batch(iterator, loader)
    per_batch = samples_per_batch(loader)
    samples_before, batches_before = resumed_at or (0, 0)
    done = None if per_batch is None else samples_before + (consumed - batches_before) * per_batch
    if done is not None and (total := _epoch_length(loader)) is not None:
        done = min(done, total)  # a last round completed with the epoch's first samples (even_batches) repeats them
    streamed = (
        is_streamed(loader) and read_ahead[0]
    )  # a stream that can say where it is: its state after the batch read ahead
    source = (StreamSource("redealt", reader, 0) if reader is not None else stream_source(loader)) if streamed else None
    return EpochPosition(
        epoch_start,
        read_ahead,
        length_or_none(loader),
        done,
        by_samples=resumed_at is not None,
        stream=None if source is None else source.capture(),
        dispatched=is_dispatcher(loader),
        dealt=(WHOLE if reader is not None else dealing(loader, processes)) if streamed else None,
        source=source_identity(loader, processes) if is_streamed(loader) else None,
    )


def _restorers(
    loader: Any, start: RngStates, now: RngStates, elastic: bool, by_samples: bool
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two functions that restore the epoch's start and the checkpoint's moment into the process and ``loader``; loosely
    (as far as the generators match) onto another layout's loader. An epoch dealt by samples may have begun on another
    layout (a checkpoint inside an epoch that was itself resumed on another number of processes), whose loader had other
    generators: its order is drawn with the saved ones."""
    generators = loader_generators(loader)
    restore_start = rng.restore_loosely if elastic or by_samples else rng.restore
    restore_now = rng.restore_loosely if elastic else rng.restore
    return (lambda: restore_start(start, generators)), (lambda: restore_now(now, generators))


@attrs.frozen
class Resumed:
    """An interrupted epoch's rest: its ``iterator``; ``resumed_at`` (samples and batches done before it) where it goes on
    by samples; ``reader`` where a stream's rest is dealt anew; ``replayed`` where its consumed part is read again."""

    iterator: Any = attrs.field(repr=False)
    resumed_at: tuple[int, int] | None = None
    reader: Any = attrs.field(default=None, repr=False)
    replayed: bool = False


def resume_in_epoch(
    loader: Any,
    position: EpochPosition,
    consumed: int,
    now: RngStates,
    *,
    epoch: int,
    processes: int,
    index: int,
    elastic: bool,
    saved_processes: int,
    peers: Sequence[EpochPosition | None] = (),
) -> Resumed:
    """The rest of the epoch ``position`` describes, ``consumed`` batches in, saved at the random state ``now`` by
    ``saved_processes`` processes, on this run's ``processes`` (this one ``index``): one of the five ways of this
    module's docstring. ``elastic``: the checkpoint's data-parallel layout is not this run's; ``peers``: every saving
    process's position, where a stream's rest is dealt anew.

    Raises:
        CheckpointError: another source than the one saved, or a stream that cannot be resumed that way (naming the
            setting to resume with).
    """
    _check_dealing(loader, position, saved_processes, elastic)
    check_source(position.source, source_identity(loader, processes) if is_streamed(loader) else None)
    restore_start, restore_now = _restorers(loader, position.epoch_start, now, elastic, position.by_samples)
    if position.stream is not None and (
        position.stream.holder == "redealt" or elastic and not (position.dispatched and is_dispatcher(loader))
    ):
        reader = _redealt(loader, position, peers, epoch, processes)
        return Resumed(
            resumed_elsewhere(
                loader, reader, processes, index, restore_epoch_start=restore_start, restore_now=restore_now
            ),
            reader=reader,
        )
    if (
        position.stream is not None
    ):  # a stream that said where it stood: continued from there, in O(1) (elastic if dispatched)
        source = check_saved(position.stream, stream_source(loader), loader)
        if is_dispatcher(loader):
            return Resumed(
                resumed_dispatch(
                    loader,
                    consumed,
                    position.read_ahead,
                    source,
                    position.stream,
                    restore_epoch_start=restore_start,
                    restore_now=restore_now,
                )
            )
        return Resumed(
            resumed_from_state(
                loader,
                source,
                position.stream,
                position.read_ahead,
                restore_epoch_start=restore_start,
                restore_now=restore_now,
            )
        )
    if elastic or position.by_samples:
        assert position.samples_done is not None  # load_checkpoint refuses a checkpoint without it
        _check_redrawable(loader, saved_processes)
        return Resumed(
            resumed_by_samples(
                loader,
                position.samples_done,
                position.epoch_start.generators,
                restore_epoch_start=restore_start,
                restore_now=restore_now,
            ),
            resumed_at=(position.samples_done, consumed),
        )
    replayed = is_streamed(loader) and bool(position.read_ahead[0])  # sync: none: a host flag
    if is_dispatcher(loader):
        return Resumed(
            resumed_dispatch(
                loader,
                consumed,
                position.read_ahead,
                None,
                None,
                restore_epoch_start=restore_start,
                restore_now=restore_now,
            ),
            replayed=replayed,
        )
    return Resumed(
        resumed_epoch(
            loader, consumed, position.read_ahead, restore_epoch_start=restore_start, restore_now=restore_now
        ),
        replayed=replayed,
    )


def _epoch_length(loader: Any) -> int | None:
    """The samples of one epoch's order: its sampler's (a subset's), else its dataset's; None for a stream."""
    base = getattr(loader, "base_dataloader", loader)
    inner = getattr(base, "batch_sampler", None)
    inner = getattr(inner, "batch_sampler", inner)  # Accelerate's BatchSamplerShard holds the loader's own
    sampler = getattr(inner, "sampler", None)
    return length_or_none(sampler) if sampler is not None else length_or_none(getattr(base, "dataset", None))


def _check_dealing(loader: Any, position: EpochPosition, saved_processes: int, elastic: bool) -> None:
    """Refuse to continue, on the number of processes that saved it, a streamed epoch that was dispatched by process 0
    with a loader that deals shares, or the reverse: each process's position says where its own way stood.

    Raises:
        CheckpointError: naming the setting to resume with.
    """
    if elastic or saved_processes == 1 or not is_streamed(loader) or position.dispatched == is_dispatcher(loader):
        return
    was, now = (
        ("dispatched", "deals each process its share") if position.dispatched else ("dealt in shares", "dispatches")
    )
    raise CheckpointError(
        f"run_epoch: the checkpoint's epoch over a stream was {was} on its {saved_processes} processes, and this loader {now}: "
        f"each process's position says where its own part stood that way. Resume with DataLoaderConfiguration(dispatch_batches="
        f"{position.dispatched}), as it was saved, or from a checkpoint between epochs (on another number of processes, "
        "a streamed epoch with a state continues either way)."
    )


def _check_redrawable(loader: Any, saved_processes: int) -> None:
    """Refuse to draw again the order of an epoch that a ``StatefulDataLoader`` read with workers: its order is not
    the one its sampler draws from the epoch's starting random state after the workers' seed (nor after none or a few
    more draws), as a plain ``DataLoader``'s is, so the rest of the epoch would repeat and leave out samples.

    Raises:
        CheckpointError: naming the ways to resume.
    """
    base = getattr(loader, "base_dataloader", loader)
    if type(base).__name__ != "StatefulDataLoader" or not getattr(base, "num_workers", 0):
        return
    raise CheckpointError(
        f"run_epoch: the checkpoint stopped in the middle of an epoch that a StatefulDataLoader read with "
        f"{base.num_workers} workers on {saved_processes} processes, and this run has another number of processes: "
        "the order of that epoch cannot be drawn again exactly (its workers draw it at another moment than the "
        "epoch's start). Resume on the number of processes that saved it, from a checkpoint taken between epochs, "
        "or with num_workers=0 (or a plain DataLoader, which any number of workers can resume elastically)."
    )


def _redealt(
    loader: Any, position: EpochPosition, peers: Sequence[EpochPosition | None], epoch: int, processes: int
) -> Any:
    """The reader of an interrupted streamed epoch's rest, dealt anew to this run's processes, checked against the loader.

    Raises:
        CheckpointError: the loader dispatches (the saving run dealt shares), or its whole stream cannot be found or is of
            another kind than the one saved.
    """
    assert position.stream is not None and peers
    dealt = (
        position.dealt or WHOLE
    )  # (recorded as dispatched alone by an older trainfold: process 0's state is the whole stream's)
    if is_dispatcher(loader):
        raise CheckpointError(
            "run_epoch: the checkpoint's epoch was dealt to its processes in shares, and this loader has process 0 read and "
            "dispatch the stream (dispatch_batches=True): resume with DataLoaderConfiguration(dispatch_batches=False), as "
            "it was saved, or from a checkpoint between epochs."
        )
    whole = whole_stream(loader, processes)
    if whole is None:
        raise CheckpointError(
            f"run_epoch: the checkpoint's epoch over a stream goes on dealt anew to {processes} processes, which needs the "
            "whole stream this loader reads a share of: prepare the loader with ctx.prepare_loaders (it keeps the dataset "
            "you gave), or resume on the number of processes that saved it."
        )
    if kind_of(whole) != position.stream.kind:
        raise CheckpointError(
            f"run_epoch: the checkpoint holds the state of a {position.stream.kind}, and this loader's stream is a "
            f"{kind_of(whole)}: a state of one kind of source does not fit another. Resume with the dataset that saved it."
        )
    aheads = [p.read_ahead[1] for p in peers if p is not None and p.read_ahead[0] and p.read_ahead[1] is not None]
    saved = [p.stream if p is not None else None for p in peers]
    base = getattr(loader, "base_dataloader", loader)
    return redeal(whole, aheads, saved, dealt, epoch, int(base.batch_size))
