"""``save_checkpoint``: everything a run needs to continue exactly, committed at once or not at all.

A save captures everything first, on the calling thread (a value that cannot
be written fails before any file exists; a background save copies to host
memory and returns), through the format chosen once for it (``formats/``:
gathered, sharded, DeepSpeed), then writes each process's files into a staging
place of the root's storage (``storage/``) and commits with the manifest last
(``background.py``, ``commit.py``): a crash leaves no checkpoint that looks
complete. The main process holds the root's lock for the run's lifetime.
Nothing here branches on the engine or knows where the bytes go. What goes
into which file is ``encoding.py``'s; what a run state is, ``core/runstate.py``'s.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping, overload

import torch
from toolz import curry

from trainfold._src.backend.engine import engine_name, is_deepspeed, shards_parameters, unwrap
from trainfold._src.backend.loaders import loader_generators, not_resumable, samples_per_batch
from trainfold._src.backend.position import EpochPosition, position_at_save
from trainfold._src.base import rng as _rng
from trainfold._src.base.checks import positive_int
from trainfold._src.checkpoint.background import SaveJob, write_and_commit
from trainfold._src.checkpoint.commit import agreed, begin_checkpoint, checkpoint_name, hold_lock
from trainfold._src.checkpoint.content import Content
from trainfold._src.checkpoint.encoding import encode_rank, encode_shared
from trainfold._src.checkpoint.formats import for_save
from trainfold._src.checkpoint.adapters import peft_record
from trainfold._src.checkpoint.frozen import model_fingerprint
from trainfold._src.checkpoint.staging_budget import within_budget
from trainfold._src.checkpoint.storage import Storage, open_root
from trainfold._src.core.checks import expect_context, expect_owned, expect_state
from trainfold._src.core.context import Context
from trainfold._src.core.cursor import EpochCursor
from trainfold._src.core.modes import eval_mode
from trainfold._src.core.runstate import FrozenTensor, values_of
from trainfold._src.core.state import TrainState

logger = logging.getLogger("trainfold")


@overload
def save_checkpoint(
    ctx: Context,
    root: str | os.PathLike[str],
    *,
    keep_last: int | None = ...,
    sharded: bool | None = ...,
    async_save: bool = ...,
    staging_budget: int | None = ...,
    storage_options: Mapping[str, Any] | None = ...,
    save_frozen: bool = ...,
) -> Any: ...


@overload
def save_checkpoint(
    ctx: Context,
    root: str | os.PathLike[str],
    state: TrainState,
    *,
    keep_last: int | None = ...,
    sharded: bool | None = ...,
    async_save: bool = ...,
    staging_budget: int | None = ...,
    storage_options: Mapping[str, Any] | None = ...,
    save_frozen: bool = ...,
) -> TrainState: ...


@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def save_checkpoint(
    ctx: Context,
    root: str | os.PathLike[str],
    state: TrainState,
    *,
    keep_last: int | None = None,
    sharded: bool | None = None,
    async_save: bool = False,
    staging_budget: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    save_frozen: bool = False,
) -> TrainState:
    """Write a checkpoint of ``state`` under ``root`` and return the state unchanged.

    Everything needed to continue exactly is written: the model, optimizer,
    scheduler and loss-scaler states, Accelerate's accumulation counter, the
    whole TrainState (counters, history, the states of step transformers and
    epoch functions, running sums), every process's random states, and the data
    position: the epoch, the batch inside it, the random state the epoch began
    with (to replay its shuffle order) and the batch the loader has read ahead.
    Mid-accumulation, the partial gradients are kept too.

    The checkpoint is named by optimizer update (``ckpt-<update>``;
    ``ckpt-<update>-<micro_step>`` in the middle of an accumulation group) and
    becomes visible only when complete; with ``keep_last=N`` older ones are
    removed only after it is committed. The first save takes an exclusive
    lock on ``root`` for the rest of the run (until ``ctx.close()`` or the
    process ends): a second run writing there gets a ``CheckpointError``. On
    several processes, the main process writes the shared files and each
    process its own.

    A sharded checkpoint (the default on several processes) writes the model's
    and optimizer's tensors through ``torch.distributed.checkpoint``, each
    process its own pieces, and resumes on any number of processes; a gathered
    one (the default on one process) writes them into the main process's
    ``model.safetensors`` and ``state.safetensors``. Under DeepSpeed, the
    checkpoint holds the engine's own files (its model states and each
    process's ZeRO optimizer partition), taken at an optimizer update.

    A model with frozen parameters (``requires_grad=False``: a base under LoRA
    adapters, a frozen backbone) gets an adapter checkpoint: it holds what
    changes (the trainable parameters, every buffer, the optimizer...) and
    records each frozen parameter by a fingerprint (name, shape, dtype, digest),
    which a load checks against the live model before anything changes (see the
    guide "Fine-tuning with adapters"). ``save_frozen=True`` writes them too.

    Args:
        ctx: the run's Context.
        root: the folder that holds the run's checkpoints.
        state: the state to save.
        keep_last: keep only the newest N checkpoints under ``root``.
        sharded: True for a sharded checkpoint, False for a gathered one (refused
            under FSDP), None (the default) for sharded on several processes.
        async_save: copy the state to host memory and return; a background thread
            writes and commits the checkpoint while training goes on (at most one
            in flight; ``ctx.wait_for_checkpoints()``, the next save, a load and
            ``ctx.close()`` wait for it and raise its error).
        staging_budget: with ``async_save``, the most bytes of host memory the background save's copy of the state
            may take on a process; a save whose copy would be larger is written before it returns instead, from the
            live tensors, with no copy (every process alike; said once). None: no bound (the state once).
        storage_options: options of the store's fsspec filesystem when ``root`` is a URL
            (``s3://bucket/run``: ``endpoint_url``, ``key``, ``secret``...); fsspec's own
            configuration and the provider's credential chain apply too.
        save_frozen: write the frozen parameters too (a checkpoint of the whole model), instead of
            their fingerprint. Under DeepSpeed the engine's files always hold them.

    Returns:
        ``state``, unchanged (so it composes as an epoch function).

    ``root`` may be a local folder or an fsspec URL (``s3://bucket/run`` with the ``s3`` extra,
    ``az://container/run`` with ``azure``, ``gs://`` with gcsfs): on a store, the manifest, written
    last, is the commit, and the lock is a lease (see the guide "Checkpoints on
    object storage").

    Raises:
        CheckpointError: ``root`` holds another run's checkpoints, or another
            process is writing there.
        TypeError: a value that cannot be written (an unregistered record in
            ``extras``, a batch of a type a checkpoint cannot hold); nothing is written.
        OSError: the disk is full (or another write failed); nothing is committed,
            the unfinished save is removed and earlier checkpoints are intact.

    Examples:
        >>> import tempfile
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> root = tempfile.mkdtemp()
        >>> state = save_checkpoint(ctx, root, run_epoch(ctx, make_step(ctx, loss_fn), loader, state))
        >>> latest_checkpoint(root).name
        'ckpt-0000000004'
    """
    expect_context("save_checkpoint", "save_checkpoint(ctx, root, state)", ctx)
    state = expect_owned("save_checkpoint", ctx, expect_state("save_checkpoint", state))
    if keep_last is not None:
        positive_int("keep_last", keep_last)
    check_staging_budget(staging_budget, flag("async_save", async_save), "save_checkpoint")
    background = async_save and _background(ctx, state, staging_budget)
    _check_replicas_equal(state)
    # a signal now is honoured after the save, not in its middle (the Context's handlers only record it);
    # a schedule-free optimizer saves its eval weights
    start = time.perf_counter()
    try:
        with eval_mode(state.model, state.optimizer, no_grad=False), ctx.runtime.in_phase("checkpoint"):
            return _save(
                ctx,
                _storage(ctx, root, storage_options),
                state,
                keep_last,
                sharded_layout(ctx, sharded),
                background,
                flag("save_frozen", save_frozen),
            )
    finally:
        ctx.runtime.clock.add("checkpoint", time.perf_counter() - start)  # the time the save held training up


def _check_replicas_equal(state: TrainState) -> None:
    """Refuse a state whose processes hold different parameters (a record of its extras says ``replicas_differ``,
    as ``local_sgd``'s does between two averages): a checkpoint holds one copy of the model."""
    for name, record in state.extras.items():
        if getattr(record, "replicas_differ", False):
            raise ValueError(
                f"save_checkpoint: the processes' parameters differ ({name}: {record!r}), and a checkpoint holds one "
                "copy of the model. Save where they were just averaged: at an epoch's end, with save_checkpoint composed "
                "after average_parameters(ctx), or at a stop (local_sgd averages there)."
            )


def _background(ctx: Context, state: TrainState, staging_budget: int | None) -> bool:
    """Whether a save asked to run in the background does: always without a budget, else where every process's copy fits."""
    if staging_budget is None:
        return True
    return within_budget(ctx, state, positive_int("staging_budget", staging_budget))


def check_staging_budget(staging_budget: int | None, async_save: bool, where: str) -> None:
    """A staging budget bounds a background save's copy: refused without ``async_save``, or where it is not a count."""
    if staging_budget is None:
        return
    positive_int("staging_budget", staging_budget)
    if not async_save:
        raise ValueError(
            f"{where}: staging_budget bounds the copy a background save makes, and this save is blocking (it copies "
            "nothing): pass async_save=True with it, or leave staging_budget unset."
        )


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"save_checkpoint: {name} must be True or False, not {value!r}.")
    return value


def sharded_layout(ctx: Context, sharded: bool | None) -> bool:
    """Sharded on several processes (and whenever asked); gathered into the main process's files on one, unless asked."""
    if sharded is not None and not isinstance(sharded, bool):
        raise TypeError(f"save_checkpoint: sharded must be True, False or None (automatic), not {sharded!r}.")
    if sharded is False and is_deepspeed(ctx.accelerator):
        raise ValueError(
            "save_checkpoint: sharded=False gathers the whole model into one process's files; under DeepSpeed a checkpoint "
            "holds the engine's own files, one ZeRO partition per process. Leave sharded unset."
        )
    if sharded is False and shards_parameters(ctx.accelerator):
        raise ValueError(
            "save_checkpoint: sharded=False gathers the whole model into one process's files, which the sharded "
            f"parameters of {engine_name(ctx.accelerator)} do not allow here; leave sharded unset (a sharded checkpoint) there."
        )
    return ctx.accelerator.num_processes > 1 or shards_parameters(ctx.accelerator) if sharded is None else sharded


def _save(
    ctx: Context,
    storage: Storage,
    state: TrainState,
    keep_last: int | None,
    sharded: bool,
    async_save: bool,
    save_frozen: bool,
) -> TrainState:
    ctx.runtime.saver.wait()  # at most one save in flight: the previous one is committed (or its error raised) first
    acc = ctx.accelerator
    main = ctx.is_main_process
    now = _rng.capture(_generators(state))  # first: nothing below may draw before this
    # A background save to a root whose lock this run holds confirms the lock and creates the checkpoint's staging on
    # the saver thread: on a store those are requests (round trips), which would otherwise keep training waiting.
    deferred = async_save and ctx.runtime.holds_lock(storage.key)
    if not deferred:
        hold_lock(ctx, storage, state)
    ctx.runtime.checkpointing(acc, state.step)  # the trackers write what they were given before this checkpoint exists
    name = checkpoint_name(ctx, state)
    # Read (and, for a background save, copy to host memory) everything the files hold: after this, training may go on.
    fmt = for_save(ctx, sharded)
    captured = fmt.capture(ctx, state, now, async_save, () if save_frozen else _fingerprint(ctx, state))
    files = {
        **agreed(ctx, lambda: _encode(ctx, state, captured.run, main), "encoding the checkpoint"),
        **captured.files,
    }
    if not deferred:
        begin_checkpoint(ctx, storage, name, state)
    job = SaveJob(storage, name, files, captured.shards, captured.weights, values_of(state), keep_last, fmt)
    if async_save:
        group = ctx.runtime.saver.group(acc.num_processes)
        ctx.runtime.saver.submit(lambda: write_and_commit(ctx, job, group, deferred))
    else:
        write_and_commit(ctx, job)
    ctx.runtime.note_held(storage.key, position_of(state))
    return state


def _fingerprint(ctx: Context, state: TrainState) -> tuple[FrozenTensor, ...]:
    """The fingerprints an adapter checkpoint records instead of the frozen parameters (none under DeepSpeed, whose
    engine files hold every parameter). Every process computes them: a sharded tensor is gathered."""
    if is_deepspeed(ctx.accelerator):
        return ()
    fingerprints: tuple[FrozenTensor, ...] = agreed(
        ctx,
        lambda: model_fingerprint(ctx, unwrap(ctx.accelerator, state.model)),
        "fingerprinting the frozen parameters",
    )
    return fingerprints


def position_of(state: TrainState) -> tuple[int, ...]:
    """What tells two saves of a run apart: its counters, whether it is finished, and how many records it holds."""
    finished = state.stop is not None and state.stop.finished
    return (state.step, state.micro_step, state.epoch, state.batch_in_epoch, int(finished), len(state.history))


def _storage(ctx: Context, root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> Storage:
    """The root's storage, refused where it cannot hold this run's checkpoints (an empty path, one process's memory for several).

    Raises:
        ValueError: an empty path; ``memory://`` on several processes; an unknown protocol.
        ImportError: the store's package is not installed.
    """
    if not isinstance(root, (str, os.PathLike)) or os.fspath(root) == "":
        raise ValueError(
            f"save_checkpoint needs a folder for its checkpoints (got {root!r}): pass a path such as 'checkpoints' (or a URL: s3://bucket/run)."
        )
    storage = open_root(root, storage_options)
    if ctx.accelerator.num_processes > 1 and not storage.shared:
        raise ValueError(
            f"{storage} is one process's memory, and this run has {ctx.accelerator.num_processes} processes: "
            "give them a root they all see (a shared folder, s3://...)."
        )
    return storage


def _encode(ctx: Context, state: TrainState, run: Any, main: bool) -> dict[str, Content]:
    files = encode_rank(ctx.accelerator.process_index, run, _position(state, ctx.accelerator.num_processes))
    if main:
        files.update(
            encode_shared(
                run,
                accumulation=ctx.gradient_accumulation_steps,
                mixed_precision=ctx.mixed_precision,
                layout=_layout(ctx, state),
                parameters=_parameters(ctx, state),
                peft=peft_record(unwrap(ctx.accelerator, state.model)),
                frozen_ids=_frozen_ids(ctx, state),
            )
        )
    return files


def _generators(state: TrainState) -> list[torch.Generator]:
    cursor = state.cursor
    return loader_generators(cursor.loader) if isinstance(cursor, EpochCursor) else []


def _position(state: TrainState, processes: int) -> EpochPosition | None:
    """Where an interrupted epoch stands (for this process, and in samples over every process), or None between epochs."""
    cursor = state.cursor
    if not (isinstance(cursor, EpochCursor) and cursor.epoch_start is not None and state.batch_in_epoch > 0):
        return None
    if (refused := not_resumable("save_checkpoint", cursor.loader)) is not None:
        raise refused
    return position_at_save(
        cursor.loader,
        cursor.iterator,
        cursor.epoch_start,
        state.batch_in_epoch,
        processes,
        resumed_at=cursor.resumed_at,
        reader=cursor.stream,
    )


def _frozen_ids(ctx: Context, state: TrainState) -> dict[int, str]:
    """The model's frozen parameters by ``id``: what an EMA's average shares with the model (the codec writes them by name)."""
    return {id(p): n for n, p in unwrap(ctx.accelerator, state.model).named_parameters() if not p.requires_grad}


def _parameters(ctx: Context, state: TrainState) -> dict[str, int]:
    """How many values of the model train and how many are frozen (whole: a DTensor counts its global size, a ZeRO-3
    partition its parameter's)."""
    params = list(unwrap(ctx.accelerator, state.model).parameters())
    sizes = [(int(getattr(p, "ds_numel", p.numel())), p.requires_grad) for p in params]
    return {"trainable": sum(n for n, trains in sizes if trains), "frozen": sum(n for n, trains in sizes if not trains)}


def _layout(ctx: Context, state: TrainState) -> dict[str, Any]:
    """The global batch this run trains with: processes, samples per batch over all of them, accumulation."""
    cursor = state.cursor
    return {
        "processes": ctx.accelerator.num_processes,
        "batch_samples": samples_per_batch(cursor.loader) if isinstance(cursor, EpochCursor) else None,
        "gradient_accumulation_steps": ctx.gradient_accumulation_steps,
    }
