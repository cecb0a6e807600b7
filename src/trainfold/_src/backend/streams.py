"""Where a stream is: the data-position protocol, and how an interrupted epoch over a stream continues.

A stream (an iterable dataset) has no sampler's order to skip through. One that can say where it is,
``state_dict()`` and ``load_state_dict()``, continues in O(1): a checkpoint records that state per
process, and the resumed epoch loads it and reads on. Which object says it depends on the loader alone
(:func:`stream_source`, asked at each save and at the resume):

- torchdata's ``StatefulDataLoader`` (Accelerate's ``use_stateful_dataloader=True``) over a dataset with
  a state of its own: the loader's state, which holds every worker's;
- in this process (``num_workers=0``), the dataset itself: a ``datasets.IterableDataset``, or a
  user's class with the two methods (also inside Accelerate's ``IterableDatasetShard``).

Any other stream is read again up to the saved position and dropped (exact, and as costly as the part
of the epoch already trained): a plain ``IterableDataset``; a stateful dataset read by workers that no
``StatefulDataLoader`` asks; a ``datasets`` stream with a shuffle buffer, whose state leaves the buffer
out (datasets#7901: loading it loses up to a buffer of samples and can repeat some), unless its loader was
prepared by ``ctx.prepare_loaders``, which gives the buffer a state that holds it (:func:`keep_shuffle_buffers`).

On another number of processes, a stream process 0 read and dispatched goes on from process 0's state
(:func:`resumed_dispatch`); one each process read a share of has the rest of its epoch dealt anew
(:class:`Redealt`, :func:`deal`): every process reads the whole rest and keeps its share, as
Accelerate's ``IterableDatasetShard`` deals any stream.

The state saved is the one after the batch the loader had read ahead, which the checkpoint also holds:
the resumed epoch yields that batch first, then reads on from the state. Nothing is adjusted for
read-ahead or prefetching (what Accelerate's ``adjust_state_dict_for_prefetch`` gets wrong on several
processes, accelerate#3938).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Mapping

import attrs
import torch

from trainfold._src.backend.loaders import begin_again, close_epoch, is_dispatcher, look_ahead
from trainfold._src.base.batch import like
from trainfold.errors import CheckpointError


@attrs.frozen
class StreamState:
    """What a checkpoint records of a stream that can say where it is, in one process."""

    #: which object said it: ``"loader"`` (the base loader, which holds its workers' states), ``"dataset"``, or
    #: ``"redealt"`` (the rest of an epoch dealt anew on another number of processes, :class:`Redealt`)
    holder: str
    #: that object's class, by module and name (the whole stream's, for ``"redealt"``): a state of another kind of source is refused by it
    kind: str
    #: the loader's ``num_workers`` when it was saved (a loader's state is per worker)
    workers: int
    #: what its ``state_dict()`` returned
    state: Any = attrs.field(repr=False)


@attrs.frozen
class StreamSource:
    """The object of a stream that says where it is, as :func:`stream_source` finds it."""

    holder: str
    obj: Any = attrs.field(repr=False)
    workers: int

    @property
    def kind(self) -> str:
        return kind_of(self.obj.whole if self.holder == "redealt" else self.obj)

    def capture(self) -> StreamState:
        # copied: a state_dict() may hand out its live values, and a background save writes them after training goes on
        return StreamState(self.holder, self.kind, self.workers, copy.deepcopy(self.obj.state_dict()))


def kind_of(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def has_state(obj: Any) -> bool:
    """Whether ``obj`` implements the protocol: callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _base_of(loader: Any) -> Any:
    """The loader that reads ``loader``'s data (Accelerate's ``base_dataloader``, also while a resumed dispatch continues it)."""
    base = getattr(loader, "base_dataloader", loader)
    return base._base if isinstance(base, _Continued) else base


def _dataset_of(loader: Any) -> tuple[Any, Any]:
    """(the dataset the base loader reads, the user's dataset under Accelerate's ``IterableDatasetShard``)."""
    from accelerate.data_loader import IterableDatasetShard

    base = _base_of(loader)
    dataset = getattr(base, "dataset", None)
    return dataset, dataset.dataset if isinstance(dataset, IterableDatasetShard) else dataset


def stream_source(loader: Any) -> StreamSource | None:
    """The object whose state puts ``loader``'s stream back where it was, or None (then the epoch is read again)."""
    base = _base_of(loader)
    dataset, own = _dataset_of(loader)
    workers = int(getattr(base, "num_workers", 0) or 0)
    if not has_state(own) or drops_shuffle_buffer(own):
        return None
    if has_state(base) and dataset is own:  # a StatefulDataLoader asks the dataset in every worker
        return StreamSource("loader", base, workers)
    if workers == 0:  # read in this process: the dataset's own state is the stream's
        return StreamSource("dataset", own, workers)
    return None


def drops_shuffle_buffer(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets`` stream with a shuffle buffer, which its state does not hold."""
    found: list[Any] = [getattr(dataset, "_ex_iterable", None)]
    seen = 0
    while found and seen < 1000:
        it = found.pop()
        seen += 1
        if it is None:
            continue
        if (
            type(it).__name__ == "BufferShuffledExamplesIterable"
            and getattr(it, "buffer_size", 2) > 1
            and "buffer" not in _keys(it)
        ):
            return True
        found.append(getattr(it, "ex_iterable", None))
        found.extend(getattr(it, "ex_iterables", None) or ())
    return False


def _keys(it: Any) -> set[str]:
    try:
        state = it.state_dict()
    except Exception:
        return set()
    return set(state) if isinstance(state, dict) else set()


def replay_advice(loader: Any) -> str:
    """Why ``loader``'s stream is read again on a resume, and what makes the resume O(1)."""
    base = _base_of(loader)
    dataset, own = _dataset_of(loader)
    workers = int(getattr(base, "num_workers", 0) or 0)
    name = type(own).__name__
    if has_state(own) and drops_shuffle_buffer(own):
        return (
            f"its {name} shuffles through a buffer that its state_dict() leaves out (datasets#7901: loading it would "
            "lose up to a buffer of samples): trainfold reads the epoch again instead. Prepare the loader with "
            "ctx.prepare_loaders, which keeps the buffer in the stream's state, for an O(1) resume"
        )
    if has_state(own) and dataset is not own:
        return (
            f"its {name} has a state, but Accelerate wraps it in an IterableDatasetShard read by {workers} workers, whose "
            "states no loader collects: use num_workers=0 for an O(1) resume"
        )
    if has_state(own):
        return (
            f"its {name} has a state, but {workers} workers read it and a plain DataLoader does not collect their states: "
            "prepare a torchdata StatefulDataLoader (Accelerator(dataloader_config=DataLoaderConfiguration("
            "use_stateful_dataloader=True))) or use num_workers=0 for an O(1) resume"
        )
    return (
        f"its {name} cannot say where it is: give it state_dict() and load_state_dict() (the guide 'Streamed data' "
        "shows how) for an O(1) resume"
    )


def check_saved(saved: StreamState, source: StreamSource | None, loader: Any) -> StreamSource:
    """The live loader's source, checked against the state a checkpoint saved for it. (Another number of processes
    gets here only with a dispatched stream, whose state is process 0's and the whole stream's: ``load_checkpoint``
    refuses the others before anything changes.)

    Raises:
        CheckpointError: the loader cannot take the state (no such source now, another kind of source,
            another number of workers), naming both sides.
    """
    if source is None:
        raise CheckpointError(
            f"run_epoch: the checkpoint holds where the stream stood, said by a {saved.kind} ({saved.holder}), but this "
            f"loader's stream cannot take it ({replay_advice(loader)}). Resume with the loader and dataset that saved it."
        )
    if (source.holder, source.kind) != (saved.holder, saved.kind):
        raise CheckpointError(
            f"run_epoch: the checkpoint holds the state of a {saved.kind} ({saved.holder}), and this loader's stream is "
            f"said by a {source.kind} ({source.holder}): a state of one kind of source does not fit another. Resume "
            "with the loader and dataset that saved it."
        )
    if source.workers != saved.workers and source.holder == "loader":
        raise CheckpointError(
            f"run_epoch: the checkpoint holds the states of {saved.workers} loader worker(s), and this loader has "
            f"num_workers={source.workers}: each worker read its own part of the stream. Resume with num_workers="
            f"{saved.workers}."
        )
    return source


def resumed_from_state(
    loader: Any,
    source: StreamSource,
    saved: StreamState,
    read_ahead: tuple[bool, Any],
    restore_epoch_start: Callable[[], None],
    restore_now: Callable[[], None],
) -> Any:
    """Iterate the rest of an interrupted epoch over a stream from its saved state: nothing consumed is read again.

    The epoch begins again as the loader begins one (its random state, so that workers draw the same
    seeds), the state is loaded, the batch the loader had read ahead is yielded first, and the rest is
    read from the stream at the random state of the save.
    """
    to_device = begin_again(loader, restore_epoch_start)
    has_ahead, ahead = read_ahead
    assert has_ahead, "a stream's state is saved only with the batch read ahead (save._position)"
    _load(source, saved)
    base_iter = iter(loader.base_dataloader)
    restore_now()
    try:
        after = [next(base_iter)]
    except StopIteration:  # the batch read ahead is the epoch's last
        after = []
    # the read-ahead batch as the checkpoint kept it, in the container types the loader's own batches have
    yield from look_ahead(
        loader, _chain(after, base_iter), to_device(like(after[0], ahead) if after else ahead), to_device
    )


def resumed_dispatch(
    loader: Any,
    consumed: int,
    read_ahead: tuple[bool, Any],
    source: StreamSource | None,
    saved: StreamState | None,
    restore_epoch_start: Callable[[], None],
    restore_now: Callable[[], None],
) -> Any:
    """Iterate the rest of an interrupted epoch whose stream process 0 reads and dispatches (``dispatch_batches``).

    Accelerate's own dispatching loop runs over the base loader's batches as they would have come: on
    process 0 first the batches of the dispatched batch it had read ahead (the checkpoint holds it), then
    the stream from its saved state, or, for a stream that cannot say where it is, from its start with
    the consumed batches read and dropped. The base loader's iterator is made under the epoch's starting
    random state (its workers' seeds), and the reading goes on at the random state of the save. The other
    processes read nothing, as in any dispatched epoch.

    Under ``drop_last=False``, a stream whose length is no multiple of the dispatched batch has its last
    batch completed with samples of the first batch Accelerate's loop dispatched, which after a resume is
    the batch read ahead rather than the epoch's first.
    """
    from accelerate.data_loader import DataLoaderDispatcher
    from accelerate.utils import find_batch_size, slice_tensors

    has_ahead, ahead = read_ahead
    if not has_ahead:  # the loader had yielded its epoch's last batch: nothing to read, the epoch only closes
        restore_now()
        close_epoch(loader)
        return
    base = loader.base_dataloader
    pieces: list[Any] = []
    if ahead is not None:  # process 0: the dispatched batch it had read ahead, as the base loader's batches it joined
        step = base.batch_size
        pieces = [slice_tensors(ahead, slice(i, i + step)) for i in range(0, find_batch_size(ahead), step)]
    per_dispatch = 1 if loader.split_batches else loader.state.num_processes
    # a stream without a state is read from its start: process 0 drops the consumed batches and those it had read ahead
    skip = 0 if source is not None else (consumed + 1) * per_dispatch
    position = functools.partial(_load, source, saved) if source is not None and saved is not None else (lambda: None)
    restore_epoch_start()
    loader.base_dataloader = _Continued(base, pieces, position, restore_now, skip)
    try:
        yield from DataLoaderDispatcher.__iter__(loader)
    finally:
        loader.base_dataloader = base


class _Continued:
    """A base loader whose next iteration continues an interrupted epoch: ``pieces`` first, then the stream, placed by ``position``."""

    def __init__(
        self, base: Any, pieces: list[Any], position: Callable[[], None], restore_now: Callable[[], None], skip: int
    ) -> None:
        self._base, self._pieces, self._position, self._restore_now, self._skip = (
            base,
            pieces,
            position,
            restore_now,
            skip,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def __len__(self) -> int:
        return len(self._base)

    def __iter__(self) -> Any:
        self._position()  # a state is loaded before the iterator that reads it is made
        real = iter(self._base)  # under the epoch's starting random state, as its first iterator was made
        if self._pieces:  # process 0 (the others never read)
            for _ in range(self._skip):
                next(real)
        self._restore_now()
        return _chain(self._pieces, real)


def _chain(first: list[Any], rest: Any) -> Any:
    yield from first
    yield from rest


def _load(source: StreamSource, saved: StreamState) -> None:
    try:
        source.obj.load_state_dict(saved.state)
    except Exception as exc:
        raise CheckpointError(
            f"run_epoch: the checkpoint's stream state does not load into this {source.kind} ({type(exc).__name__}: {exc}). "
            "Resume with the loader and dataset that saved it."
        ) from exc


# --- Another number of processes: the rest of an interrupted epoch dealt anew --------------------------------------

#: ``EpochPosition.dealt``: how one process's part of a stream stood to the whole stream when the checkpoint was saved.
#: The process's state is the whole stream's (one process; Accelerate's ``IterableDatasetShard``, where every process
#: reads the stream and keeps its share; process 0 dispatching it; an epoch already dealt anew).
WHOLE = "whole"
#: The process read a part of its own: a ``datasets`` stream Accelerate split by process (``shard(num_shards=N, index=rank)``).
PART = "part"
#: The attribute ``Context.prepare_loaders`` leaves on a prepared loader over a stream: the dataset the user gave,
#: before Accelerate dealt it (a resume on another number of processes reads the saving run's parts from it).
GIVEN = "_trainfold_given_stream"


def keep_shuffle_buffers(loader: Any) -> None:
    """Give a ``datasets`` stream's shuffle buffer (``shuffle(seed, buffer_size)``) a state that holds it, before the
    loader is prepared (``backend/shuffle_buffer.py``): its resume is then O(1), like a stream's without a buffer."""
    dataset = getattr(loader, "dataset", None)
    if type(dataset).__module__.split(".")[0] == "datasets" and drops_shuffle_buffer(dataset):
        from trainfold._src.backend.shuffle_buffer import keep_buffers_in_state

        keep_buffers_in_state(dataset)


def keep_given_stream(given: Any, prepared: Any) -> None:
    """Leave on a prepared loader over a stream the dataset the user gave it (:data:`GIVEN`)."""
    dataset = getattr(given, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        setattr(prepared, GIVEN, dataset)


def dealing(loader: Any, processes: int) -> str | None:
    """How ``loader``'s stream is dealt to this run's ``processes`` (:data:`WHOLE` or :data:`PART`; None: by the user,
    in a way trainfold cannot repeat)."""
    dataset, own = _dataset_of(loader)
    if is_dispatcher(loader) or dataset is not own or processes == 1:
        return WHOLE
    given = getattr(loader, GIVEN, None)
    if given is not None and given is not own and callable(getattr(given, "shard", None)):
        return PART  # Accelerate replaced the user's datasets stream by its shard(num_shards=processes, index=rank)
    return None


def whole_stream(loader: Any, processes: int) -> Any:
    """The whole stream ``loader`` reads a share of: the dataset the user gave (None when it cannot be found)."""
    given = getattr(loader, GIVEN, None)
    if given is not None:
        return given
    dataset, own = _dataset_of(loader)
    return own if dataset is not own or processes == 1 else None


class Redealt:
    """The rest of an interrupted epoch over a stream, read whole by every process of a run with another number of
    processes: first the batches the saving processes had read ahead (as this run's batches), then each part of the
    stream the saving processes had left, from where its state says it stood. :func:`deal` gives each process its share.

    It says where it is (``state_dict()``) in what a checkpoint can hold: the batches still to come, and each part
    still to read (``[N, r]``: the whole stream's ``shard(num_shards=N, index=r)``, or None: the whole stream) with its
    state. Every process's copy stands at the same place whenever a batch is taken (:func:`deal` reads whole rounds),
    so a checkpoint inside the epoch resumes, again on any number of processes, by this same rule.
    """

    def __init__(
        self, whole: Any, pieces: list[Any], parts: list[tuple[tuple[int, int] | None, Any]], epoch: int
    ) -> None:
        self.whole, self._pieces, self._parts, self._epoch = whole, list(pieces), list(parts), epoch
        self._reading: Any = None  # the part being read, whose own state says where it is

    def state_dict(self) -> dict[str, Any]:
        parts = [[list(spec) if spec is not None else None, state] for spec, state in self._parts]
        if self._reading is not None and parts:
            parts[0][1] = copy.deepcopy(self._reading.state_dict())
        return {"pieces": list(self._pieces), "parts": parts}

    def __iter__(self) -> Any:
        while self._pieces:
            yield True, self._pieces.pop(0)
        while self._parts:
            spec, state = self._parts[0]
            part = self.whole if spec is None else self.whole.shard(num_shards=spec[0], index=spec[1])
            if callable(getattr(part, "set_epoch", None)):
                part.set_epoch(self._epoch)  # a datasets stream applies a state to the epoch it was saved in
            _load(StreamSource("dataset", part, 0), StreamState("dataset", kind_of(part), 0, state))
            self._reading = part
            for sample in part:
                yield False, sample
            self._reading = None
            self._parts.pop(0)


def _parts_of(state: Any, whole: Any) -> tuple[list[Any], list[tuple[tuple[int, int] | None, Any]]]:
    """The batches still to come and the parts still to read, from a :class:`Redealt`'s ``state_dict()``, checked: each
    part once, of one split of ``whole`` (which can be split), or the whole stream alone."""
    if not (
        isinstance(state, dict)
        and set(state) == {"pieces", "parts"}
        and isinstance(state["pieces"], list)
        and isinstance(state["parts"], list)
    ):
        raise CheckpointError(
            f"run_epoch: the checkpoint's stream state is not one of a stream dealt anew ({str(state)[:200]})."
        )
    parts: list[tuple[tuple[int, int] | None, Any]] = []
    for entry in state["parts"]:
        spec = entry[0] if isinstance(entry, list) and len(entry) == 2 else "bad"
        if not (
            spec is None
            or (
                isinstance(spec, list)
                and len(spec) == 2
                and all(type(n) is int for n in spec)
                and 0 <= spec[1] < spec[0]
            )
        ):
            raise CheckpointError(
                f"run_epoch: the checkpoint's stream names a part {entry!r:.200}, not [processes, index] or null."
            )
        parts.append((None if spec is None else (spec[0], spec[1]), entry[1]))
    _check_parts([spec for spec, _ in parts], whole)
    return state["pieces"], parts


def _check_parts(specs: list[tuple[int, int] | None], whole: Any) -> None:
    where = "run_epoch: the checkpoint's stream dealt anew"
    seen: set[tuple[int, int] | None] = set()
    for spec in specs:
        if spec in seen:
            raise CheckpointError(
                f"{where} names the part {list(spec) if spec else None} twice: its samples would be trained twice."
            )
        seen.add(spec)
    splits = sorted({spec[0] for spec in specs if spec is not None})
    if len(splits) > 1:
        raise CheckpointError(
            f"{where} names parts of streams split {' and '.join(map(str, splits))} ways: not one stream's rest."
        )
    if splits and None in specs:
        raise CheckpointError(f"{where} names the whole stream and a part of it: the part would be trained twice.")
    if splits and not callable(getattr(whole, "shard", None)):
        raise CheckpointError(
            f"{where} names parts of a split stream, and this loader's {type(whole).__name__} cannot be split "
            "(it has no shard()): resume with the dataset that saved it."
        )


def units_of(pieces: list[Any], unit: int) -> list[Any]:
    """Batches read ahead by the saving processes, as batches of this run's ``unit`` samples (unchanged where they are).

    Raises:
        CheckpointError: they do not add up to whole batches of ``unit``, or would have to be cut and hold something
            other than tensors.
    """
    from accelerate.utils import concatenate, find_batch_size

    if all(_size(p) == unit for p in pieces):
        return list(pieces)
    try:
        joined = concatenate(pieces) if pieces else None
        total = find_batch_size(joined) if pieces else 0
        if total % unit:
            raise ValueError(f"{total} samples are no whole number of batches of {unit}")
        return [_cut(joined, slice(i, i + unit)) for i in range(0, total, unit)]
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"run_epoch: the batches the saving processes had read ahead ({', '.join(str(_size(p)) for p in pieces)} samples) "
            f"cannot be dealt out as this run's batches of {unit} ({exc}). Resume with a batch size that divides them, or "
            "from a checkpoint between epochs."
        ) from None


def _size(batch: Any) -> int | None:
    from accelerate.utils import find_batch_size

    try:
        return int(find_batch_size(batch))
    except (TypeError, ValueError):
        return None


def _cut(batch: Any, part: slice) -> Any:
    """``batch[part]`` along the samples, for tensors in lists, tuples and mappings (anything else is refused)."""
    if isinstance(batch, torch.Tensor):
        return batch[part]
    if isinstance(batch, Mapping):
        return type(batch)({k: _cut(v, part) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cut(v, part) for v in batch)
    raise TypeError(f"a batch holding a {type(batch).__name__}, which cannot be cut into batches")


def deal(
    items: Any, *, unit: int, processes: int, index: int, drop_last: bool, collate: Callable[[list[Any]], Any]
) -> Any:
    """Process ``index``'s batches of a sequence dealt to ``processes`` as Accelerate's ``IterableDatasetShard`` deals
    a stream: the sequence cut into batches of ``unit`` samples, batch ``i`` to process ``i % processes``, a round of
    ``processes`` batches taken only once it is whole (so every process takes as many).

    ``items`` yields ``(True, batch)`` (a whole batch, already collated) and then ``(False, sample)``. The last round
    when the sequence ends inside it: dropped under ``drop_last``; otherwise completed with the first samples read
    (the whole batches, if no sample was read), as Accelerate completes an epoch's last global batch. One process takes
    a last short batch as it is, as a ``DataLoader`` does.
    """
    round_: list[Any] = []  # this round's batches: collated ones, or _Samples still to collate
    first: list[Any] = []  # the first samples read, for completing the last round
    wanted = unit * processes

    def filling() -> bool:  # the round's last batch is samples, not yet ``unit`` of them
        return isinstance(round_[-1], _Samples) and len(round_[-1]) < unit

    for whole, item in items:
        if whole:
            round_.append(item)
        else:
            if len(first) < wanted:
                first.append(item)
            if not round_ or not filling():
                round_.append(_Samples())
            round_[-1].append(item)
        if len(round_) == processes and not filling():
            mine = round_[index]
            round_ = []
            yield collate(mine) if isinstance(mine, _Samples) else mine
    if not round_ or drop_last and (len(round_) < processes or filling()):
        return
    if processes > 1:
        fill = first or [b for b in round_ if not isinstance(b, _Samples)]
        at = 0
        while len(round_) < processes or filling():
            if first:
                if not filling():
                    round_.append(_Samples())
                round_[-1].append(fill[at % len(fill)])
            else:
                round_.append(fill[at % len(fill)])
            at += 1
    if index < len(round_):
        mine = round_[index]
        yield collate(mine) if isinstance(mine, _Samples) else mine


class _Samples(list[Any]):
    """Samples of one batch still to collate: told apart from a collated batch that is itself a list (the
    ``default_collate`` of tuple samples)."""


def redeal(
    whole: Any, aheads: list[Any], saved: list[StreamState | None], dealt: str, epoch: int, unit: int
) -> Redealt:
    """The reader of an interrupted epoch's rest, dealt anew (:class:`Redealt`), from what the saving processes recorded
    (in rank order): the batches they had read ahead and their streams' states."""
    states = [s for s in saved if s is not None]
    if not states:  # every process had ended its part: the batches read ahead are all that is left
        return Redealt(whole, units_of(aheads, unit), [], epoch)
    if states[0].holder == "redealt":  # an epoch dealt anew before: every process's reader stood at the same place
        pending, parts = _parts_of(states[0].state, whole)
        return Redealt(whole, units_of([*aheads, *pending], unit), parts, epoch)
    pieces = units_of(aheads, unit)
    if dealt == WHOLE:  # each process's state is the whole stream's, past the batches read ahead
        return Redealt(whole, pieces, [(None, states[0].state)], epoch)
    return Redealt(whole, pieces, [((len(saved), r), s.state) for r, s in enumerate(saved) if s is not None], epoch)


def resumed_elsewhere(
    loader: Any,
    reader: Redealt,
    processes: int,
    index: int,
    restore_epoch_start: Callable[[], None],
    restore_now: Callable[[], None],
) -> Any:
    """Iterate this process's share of an interrupted epoch's rest, dealt anew to this run's processes (:func:`deal`)."""
    to_device = begin_again(loader, restore_epoch_start)
    restore_now()
    base = _base_of(loader)
    batches = deal(
        iter(reader),
        unit=base.batch_size,
        processes=processes,
        index=index,
        drop_last=base.drop_last,
        collate=base.collate_fn,
    )
    try:
        first = next(batches)
    except StopIteration:  # nothing was left of the epoch
        close_epoch(loader)
        return
    yield from look_ahead(loader, batches, to_device(first), to_device)
