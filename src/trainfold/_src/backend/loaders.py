"""Accelerate's prepared loaders from inside: placement, their generators, the batch they read ahead, and resuming them mid-epoch.

An epoch resumes in the same order from any batch (:func:`resumed_epoch`) or, on
another number of processes, from its position in samples (:func:`resumed_by_samples`),
by replaying the shuffle from the random state the epoch began with.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from trainfold._src.backend.engine import is_deepspeed
from trainfold._src.backend.mesh import DataLayout
from trainfold.errors import CheckpointError


def loader_placement(accelerator: Accelerator, count: int) -> list[bool] | None:
    """``device_placement`` for ``accelerator.prepare(*loaders)``: off where batches have nowhere to go.

    On a CPU device a batch from a ``DataLoader`` is already where the model is;
    Accelerate's ``send_to_device`` would still walk it and call ``.to("cpu")``
    on every tensor of every batch (~25,000 instructions a batch, 1.4% of a
    tiny step). Everywhere else (under DeepSpeed or Megatron-LM, which refuse
    a custom placement, and where ``dispatch_batches=True`` is asked for, which
    needs it) ``None``: Accelerate's own setting. (Left unset, Accelerate
    dispatches an iterable dataset's batches only where it places them: on CPU,
    each process reads the stream and keeps its share.)
    """
    if accelerator.device.type != "cpu" or accelerator.distributed_type in (
        DistributedType.DEEPSPEED,
        DistributedType.MEGATRON_LM,
    ):
        return None
    if accelerator.dataloader_config.dispatch_batches:  # process 0 reads and sends each process its part: placed
        return None
    return [False] * count


def real_samples_in_batch(accelerator: Accelerator, layout: DataLayout, batch_size: int) -> int:
    """How many samples of the batch being processed are real, not padding (the same on every process of a group).

    Under ``even_batches`` (Accelerate's default), a dataset that does not fill
    the last round of batches on every data-parallel rank is padded with samples
    from its start. The padding sits at the tail, in rank order: the gathered last
    round holds the ``remainder`` real samples first. This is what
    ``gather_for_metrics`` relies on; here each process computes its own share
    so that sums over samples are exact without gathering per-sample values.
    Under tensor parallelism a group's processes hold one batch, and all of them
    run the model on the same real samples (its forward is collective).
    """
    state = accelerator.gradient_state
    if layout.size == 1 or not state.end_of_dataloader:
        return batch_size
    remainder = state.remainder
    if remainder is None or remainder <= 0:
        return batch_size  # no padding (exact multiple, drop_last, or unknown length)
    before_me = layout.rank * batch_size
    return int(max(0, min(batch_size, remainder - before_me)))


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The torch Generators that decide a loader's shuffle order (deduplicated, in a stable order)."""
    from accelerate.data_loader import get_sampler

    found: list[torch.Generator] = []
    base = getattr(loader, "base_dataloader", loader)
    try:
        sampler = get_sampler(loader)
    except Exception:
        sampler = None
    for g in (
        getattr(loader, "synchronized_generator", None),
        getattr(sampler, "generator", None),
        getattr(base, "generator", None),
    ):
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def shares_out_data(loader: Any) -> bool:
    """Whether each process reads only its share of ``loader``'s data: prepared by Accelerate, marked with
    ``Context.own_shards``, or over torch's ``DistributedSampler``."""
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    return (
        isinstance(loader, (DataLoaderShard, DataLoaderDispatcher))
        or getattr(loader, "_is_accelerate_prepared", False)
        or getattr(loader, "_trainfold_own_shard", False)
        or isinstance(getattr(loader, "sampler", None), torch.utils.data.distributed.DistributedSampler)
    )


def is_resumable_loader(loader: Any) -> bool:
    """Whether an epoch over ``loader`` can continue from a checkpoint: each process's shard, or a stream process 0 dispatches."""
    from accelerate.data_loader import DataLoaderShard

    return isinstance(loader, DataLoaderShard) or (is_dispatcher(loader) and is_streamed(loader))


def not_resumable(where: str, loader: Any) -> TypeError | None:
    """Why an epoch over ``loader`` cannot continue from a checkpoint taken inside it (for ``where`` to raise), or None."""
    if is_resumable_loader(loader):
        return None
    if is_dispatcher(loader):
        return TypeError(
            f"{where}: Accelerate dispatches this loader's batches from process 0 (dispatch_batches=True) over a map-style "
            "dataset, and trainfold continues a dispatched epoch from a checkpoint only for a stream. Leave dispatch_batches "
            "unset (or False): each process then reads its share in the sampler's order, which a checkpoint continues."
        )
    return TypeError(
        f"{where}: the epoch runs over a loader that was not prepared (a {type(loader).__name__}); a checkpoint inside the "
        "epoch could not continue it. Prepare it with ctx.prepare_loaders(loader)."
    )


def is_dispatcher(loader: Any) -> bool:
    """Whether process 0 reads ``loader``'s batches and sends each process its part (Accelerate's ``dispatch_batches``)."""
    from accelerate.data_loader import DataLoaderDispatcher

    return isinstance(loader, DataLoaderDispatcher)


def read_ahead_batch(iterator: Any, loader: Any) -> tuple[bool, Any]:
    """The batch a prepared loader has already read but not yet yielded: ``(True, batch)`` or ``(False, None)``.

    ``DataLoaderShard.__iter__`` (and :func:`resumed_epoch`) read one batch
    ahead, so after the step on batch ``k`` the loader holds batch ``k + 1``,
    drawn with the random state of that moment. A checkpoint stores it, because
    re-reading it later would draw different random numbers (augmentation).
    """
    if loader.end_of_dataloader:
        return False, None
    while getattr(iterator, "gi_yieldfrom", None) is not None:  # resumed epochs delegate to look_ahead
        iterator = iterator.gi_yieldfrom
    frame = getattr(iterator, "gi_frame", None)
    if frame is None or "next_batch" not in frame.f_locals:
        raise RuntimeError(
            "cannot find the batch the loader has read ahead: the epoch is not being iterated by run_epoch "
            "over a loader prepared with ctx.prepare_loaders (or this Accelerate version iterates differently)."
        )
    return True, frame.f_locals["next_batch"]


def begin_again(loader: Any, restore_epoch_start: Callable[[], None]) -> Callable[[Any], Any]:
    """Begin an interrupted epoch again as ``DataLoaderShard.__iter__`` begins one; return how it sends a batch to the device.

    The random state of the epoch's start is restored and synchronised across
    processes, the loader is registered as Accelerate's active one and told its epoch.
    """
    from accelerate.utils import send_to_device, synchronize_rng_states

    def to_device(batch: Any) -> Any:
        return (
            send_to_device(batch, loader.device, non_blocking=loader._non_blocking)
            if loader.device is not None
            else batch
        )

    restore_epoch_start()
    if loader.rng_types is not None:
        synchronize_rng_states(loader.rng_types, loader.synchronized_generator)
    loader.begin()
    loader.set_epoch(loader.iteration)
    return to_device


def resumed_epoch(
    loader: Any,
    consumed: int,
    read_ahead: tuple[bool, Any],
    restore_epoch_start: Callable[[], None],
    restore_now: Callable[[], None],
) -> Any:
    """Iterate the rest of an interrupted epoch exactly as ``DataLoaderShard.__iter__`` would have.

    ``consumed`` batches were stepped on and, if ``read_ahead[0]``, one more was
    read ahead. The sampler's permutation is drawn again under the epoch's
    starting random state, the consumed and read-ahead index batches are skipped
    without loading their data (with ``num_workers=0``; with workers, and for an
    iterable dataset, which has no sampler to skip, they are read and dropped),
    then the random state of the checkpoint is restored and iteration continues
    with the same one-batch look-ahead, so every later batch is read with the same
    random numbers. With nothing read ahead the loader had ended: nothing is read,
    the epoch is only closed.
    """
    from trainfold._src.base.batch import like

    to_device = begin_again(loader, restore_epoch_start)
    base_iter = iter(loader.base_dataloader)
    has_ahead, ahead = read_ahead
    # Nothing read ahead: the loader had yielded its last batch, and the epoch only needs closing (reading it again
    # would cost a whole epoch of a stream for nothing; the random state is the checkpoint's either way).
    skip = consumed + 1 if has_ahead else 0
    template = None
    if has_ahead and skip:
        # One consumed batch loaded again (its random draws are undone by restore_now): the
        # container types the checkpoint could not keep (namedtuple, BatchEncoding...).
        template = next(base_iter, _END)
        if template is _END:
            raise _stream_ended(0, skip)
        skip -= 1
    passing_over(loader, base_iter)(skip, 0 if template is None else 1)
    restore_now()
    if template is not None:
        ahead = like(template, ahead)
    if not has_ahead:
        close_epoch(loader)
        return
    yield from look_ahead(loader, base_iter, to_device(ahead), to_device)


#: what ``next`` gives for a finished iterator here
_END = object()


def _stream_ended(read: int, wanted: int) -> CheckpointError:
    return CheckpointError(
        f"run_epoch: the stream ended after {read} of the {wanted} batches of this epoch that the checkpoint had read: it "
        "is not the stream that saved it (shorter, or changed), or the checkpoint's position is not its own. Resume with "
        "the data that saved it, or from a checkpoint between epochs."
    )


def passing_over(loader: Any, base_iter: Any) -> Callable[[int, int], None]:
    """How a resumed epoch passes over its consumed batches, one way per kind of loader, chosen once.

    A map-style dataset read in this process (``num_workers=0``): its sampler's indices are drawn and
    dropped, nothing is loaded. With workers (the indices are already in flight) or an iterable dataset
    (its sampler is an endless run of Nones: skipping it would advance nothing and train the consumed
    part again): the consumed batches are read and dropped, in order. (A stream that can say where it
    is, ``state_dict()``, is not passed over: it continues from its state, ``streams.py``.) The function
    returned takes how many batches to pass over and how many were read before it; a stream that ends
    first raises a ``CheckpointError`` with both counts.
    """
    sampler_iter = getattr(base_iter, "_sampler_iter", None)
    if sampler_iter is not None and loader.base_dataloader.num_workers == 0 and not is_streamed(loader):

        def by_sampler_order(n: int, already: int = 0) -> None:
            del already  # unused: a map-style epoch's length is checked against the checkpoint's before
            for _ in range(n):  # draws the permutation, loads nothing
                next(sampler_iter)

        return by_sampler_order

    def by_reading_again(n: int, already: int = 0) -> None:
        for done in range(n):
            if next(base_iter, _END) is _END:
                raise _stream_ended(already + done, already + n)

    return by_reading_again


def close_epoch(loader: Any) -> None:
    """End an epoch that yields no more batches as a prepared loader ends one: flagged, counted, unregistered."""
    loader.end_of_dataloader = True
    loader.iteration += 1
    loader.end()


def look_ahead(loader: Any, base_iter: Any, current_batch: Any, to_device: Callable[[Any], Any]) -> Any:
    """Yield the epoch's batches as ``DataLoaderShard.__iter__`` does: one read ahead, the last one flagged, then the epoch closed.

    The batch read ahead is the local ``next_batch`` (``read_ahead_batch`` finds it there).
    """
    while True:
        try:
            next_batch = next(base_iter)
        except StopIteration:
            loader.end_of_dataloader = True
            yield current_batch
            break
        yield current_batch
        current_batch = to_device(next_batch)
    loader.iteration += 1
    loader.end()


def is_streamed(loader: Any) -> bool:
    """Whether ``loader`` reads an iterable dataset (a stream: no sampler's order, no length it must have)."""
    base = getattr(loader, "base_dataloader", loader)
    return isinstance(getattr(base, "dataset", None), torch.utils.data.IterableDataset)


def samples_per_batch(loader: Any) -> int | None:
    """How many samples of the epoch's order one batch of every process covers together (None where unknown).

    A loader prepared for N processes deals the batches of its sampler's order
    out in turn (batch ``i`` to process ``i % N``), so after ``k`` batches each,
    the first ``k * N * batch_size`` samples are done (``k * batch_size`` with
    ``split_batches``). An iterable dataset has no such order: None.
    """
    from accelerate.data_loader import BatchSamplerShard

    if is_streamed(loader):
        return None
    sampler = getattr(getattr(loader, "base_dataloader", None), "batch_sampler", None)
    if isinstance(sampler, BatchSamplerShard):
        size = getattr(sampler, "batch_size", None)
        return None if size is None else size if sampler.split_batches else size * sampler.num_processes
    if type(sampler) is torch.utils.data.BatchSampler:
        return int(sampler.batch_size)
    return None


def dropped_samples(loader: Any) -> int:
    """How many samples of the dataset a loader never yields in an epoch (``drop_last=True``), 0 if none or unknown."""
    base = getattr(loader, "base_dataloader", loader)
    sampler = getattr(base, "batch_sampler", None)
    inner = getattr(sampler, "batch_sampler", None)
    drop = getattr(sampler, "drop_last", False) or getattr(inner, "drop_last", False)
    drop = bool(drop)  # sync: none: loader settings
    per_batch = samples_per_batch(loader)
    if per_batch is None:  # a plain DataLoader: its own batch size
        per_batch = getattr(sampler, "batch_size", None) if type(sampler) is torch.utils.data.BatchSampler else None
    try:
        total, batches = len(base.dataset), len(loader)
    except (TypeError, AttributeError):
        return 0
    return max(0, total - batches * per_batch) if drop and per_batch else 0


def resumed_by_samples(
    loader: Any,
    samples_done: int,
    saved_generators: tuple[torch.Tensor, ...],
    restore_epoch_start: Callable[[], None],
    restore_now: Callable[[], None],
) -> Any:
    """Iterate the rest of an interrupted epoch by its position in samples, dealt out to this run's processes.

    For an epoch saved on another number of processes: the epoch's order is
    drawn again under its starting random state exactly as its first batch drew
    it, the first ``samples_done`` samples are dropped, and the rest are batched
    and dealt out as the prepared loader deals a whole epoch (same batch size,
    ``drop_last`` and ``even_batches``), so that every sample of the epoch is
    trained on once over the two runs. Batches are read again (a random
    augmentation of them draws anew), through a ``DataLoader`` with the loader's
    dataset, collate function and workers.

    The order is drawn by the sampler's generator as it was saved
    (``saved_generators``: the loader's generators at the epoch's start). On one
    process Accelerate leaves a shuffling sampler without a generator of its own
    (it draws from torch's global one), on several it gives it one: when the
    two layouts differ so, the sampler draws with the saved one for this.

    Raises:
        ValueError: the loader has no order to continue (an iterable dataset).
    """
    from accelerate.data_loader import BatchSamplerShard

    base = loader.base_dataloader
    shard = base.batch_sampler
    inner = shard.batch_sampler if isinstance(shard, BatchSamplerShard) else shard
    if samples_per_batch(loader) is None or not isinstance(getattr(inner, "sampler", None), torch.utils.data.Sampler):
        raise ValueError(
            "run_epoch: the checkpoint stopped in the middle of an epoch and this run has another number of processes, "
            "but the loader deals no sampler's order (an iterable dataset, or a custom batch sampler), so the rest of the "
            "epoch cannot be dealt out anew. Resume on the number of processes that saved it, or from a checkpoint "
            "taken between epochs."
        )

    to_device = begin_again(loader, restore_epoch_start)
    # what the epoch's own iterator drew before its order: the workers' base seed, as torch's (and torchdata's)
    # iterator draws it when it is made. Not by making one: with workers it starts them, and their prefetching draws
    # the sampler's order, so the order drawn next here was another (every sample of the rest in another place)
    torch.empty((), dtype=torch.int64).random_(generator=base.generator)
    sampler = inner.sampler
    live = len(loader_generators(loader))
    if live != len(saved_generators) and hasattr(sampler, "generator"):
        own = sampler.generator
        # the synchronized generator, which is the sampler's, comes first among a loader's generators
        sampler.generator = torch.Generator().set_state(saved_generators[0]) if saved_generators else None
        try:
            order = list(sampler)
        finally:
            sampler.generator = own
    else:
        order = list(sampler)  # the epoch's order, drawn as its first batch drew it
    batches: Any = torch.utils.data.BatchSampler(order[samples_done:], inner.batch_size, inner.drop_last)
    if isinstance(shard, BatchSamplerShard):
        batches = BatchSamplerShard(
            batches,
            shard.num_processes,
            shard.process_index,
            split_batches=shard.split_batches,
            even_batches=shard.even_batches,
        )
    rest = torch.utils.data.DataLoader(
        base.dataset,
        batch_sampler=batches,
        collate_fn=base.collate_fn,
        num_workers=base.num_workers,
        pin_memory=base.pin_memory,
        worker_init_fn=base.worker_init_fn,
        timeout=base.timeout,
        multiprocessing_context=base.multiprocessing_context,
    )
    restore_now()
    base_iter = iter(rest)
    try:
        first = next(base_iter)
    except StopIteration:
        close_epoch(loader)
        return
    yield from look_ahead(loader, base_iter, to_device(first), to_device)


def abandon_epoch(iterator: Any, loader: Any) -> None:
    """Close an epoch left before the loader's end (a stop flag, ``max_batches``).

    A prepared loader registers itself as Accelerate's active dataloader when
    iteration starts and unregisters at its end, which an abandoned iteration
    never reaches; without this its stale entry would stay in ``GradientState``.
    """
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    references = getattr(getattr(loader, "gradient_state", None), "dataloader_references", ())
    if any(ref is loader for ref in references):
        loader.end()


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Tell a prepared loader which epoch it is in (a new loader counts from 0; its sampler's ``set_epoch`` needs the real one)."""
    loader.iteration = epoch


def deepspeed_micro_batch_unset(accelerator: Accelerator) -> bool:
    """True under DeepSpeed while its config's ``train_micro_batch_size_per_gpu`` is still ``auto``.

    Accelerate fills it from the loaders passed to the same ``prepare`` call as the
    model; ``TrainState.create`` prepares the model alone, so it must be known first.
    """
    plugin = accelerator.state.deepspeed_plugin if is_deepspeed(accelerator) else None
    return plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu")


def fill_deepspeed_micro_batch(accelerator: Accelerator, loaders: tuple[Any, ...]) -> None:
    """Under DeepSpeed, set an ``auto`` micro-batch size from ``loaders`` as a joint ``prepare`` would.

    Accelerate's rule: the smallest (``is_train_batch_min``, the default) or largest
    of the loaders' batch sizes, per process (divided by the processes under
    ``split_batches``). It only labels DeepSpeed's throughput figures and checks
    its config; the step does not depend on it.
    """
    if not deepspeed_micro_batch_unset(accelerator):
        return
    found = [getattr(dl, "batch_size", None) for dl in loaders]
    sizes = [s for s in found if isinstance(s, int)]
    if not sizes or len(sizes) != len(found):
        return  # Accelerate's own prepare names the problem (a loader with no batch size)
    if accelerator.split_batches:
        sizes = [s // accelerator.num_processes for s in sizes]
    plugin = accelerator.state.deepspeed_plugin
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = min(sizes) if plugin.is_train_batch_min else max(sizes)


class _OwnShard:
    """A loader that takes no attribute (a list of batches), marked by wrapping: iterates and measures as it does."""

    _trainfold_own_shard = True

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def mark_own_shard(loader: Any) -> Any:
    """``loader``, marked as yielding only this process's share (``ctx.own_shards``): :func:`shares_out_data` says yes to it."""
    try:
        loader._trainfold_own_shard = True
        return loader
    except (AttributeError, TypeError):
        return _OwnShard(loader)
