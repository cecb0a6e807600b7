"""Checkpoint formats: what each process captures for a save, and how a checkpoint of that format is read, checked and put back.

One interface, three implementations, chosen once per save (:func:`for_save`)
and once per load (:func:`for_load`), so that ``save_checkpoint`` and
``load_checkpoint`` hold no engine branches:

- :class:`Gathered` (format 1): the model gathered into the main process's
  ``model.safetensors``, the optimizer into the shared ``state.*`` files; it
  resumes on any number of replicas (DDP, one process);
- :class:`Sharded` (format 2): every process writes its own pieces of the model and
  optimizer (``_sharded.py``, torch.distributed.checkpoint on trainfold's files); it
  resumes on any number of processes;
- :class:`DeepSpeedFormat` (format 3): the engine's own files (each process its ZeRO
  partition), read back through torch's restricted unpickler (``_deepspeed.py``).

A format says *what the bytes are*; writing them into a folder, committing it and
finding it again (the storage) is ``_background.py``'s, ``_files.py``'s and ``_root.py``'s.
Every ``load`` reads and checks everything before it changes anything, and every
process calls it (the sharded and DeepSpeed loads are collectives).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Mapping, Protocol

import attrs
import torch

from trainfold.backend.engine import (
    accumulation_counter,
    inner_optimizer,
    is_deepspeed,
    local,
    shards_parameters,
    unwrap,
)
from trainfold.base import rng as _rng
from trainfold.checkpoint.background import to_host
from trainfold.checkpoint.encoding import decode
from trainfold.checkpoint.manifest import (
    DEEPSPEED,
    FORMAT,
    MANIFEST,
    SHARDED,
    parse_tensors,
    rank_files,
    read_verified,
)
from trainfold.checkpoint.root import agreed
from trainfold.core.context import Context
from trainfold.core.cursor import Resume
from trainfold.core.modes import optimizer_modes
from trainfold.core.runstate import (
    RunState,
    StateMismatch,
    capture,
    check_fits,
    put_back,
)
from trainfold.core.state import TrainState
from trainfold.errors import CheckpointError


@attrs.frozen(eq=False)
class Captured:
    """What a format read from the live state for one save (copied to host memory for a background save)."""

    #: the run state the shared and per-process files encode
    run: RunState = attrs.field(repr=False)
    #: the weights whose finiteness the manifest records (this process's part)
    weights: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    #: files the format writes as they are (DeepSpeed's engine files), by name
    files: Mapping[str, bytes] = attrs.field(factory=dict, repr=False)
    #: a sharded checkpoint's tensors, for ``_sharded.write_shards``; None otherwise
    shards: Mapping[str, torch.Tensor] | None = attrs.field(default=None, repr=False)


class Format(Protocol):
    """A checkpoint format: its number in the manifest, what a save captures, how a load reads and puts back."""

    code: int

    def capture(self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool) -> Captured:
        """Read what this process saves (every process calls it; ``copied`` for a background save)."""
        ...

    def load(self, ctx: Context, folder: Path, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """Read, verify and check ``folder``, then put it into ``state``'s live objects; return the saved state."""
        ...


class Gathered:
    """Format 1: the model and optimizer gathered into the main process's files; resumed on any number of replicas."""

    code = FORMAT

    def capture(self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool) -> Captured:
        weights = ctx.accelerator.get_state_dict(state.model)  # every process takes part (sharded engines gather)
        if copied:
            weights = to_host(weights)
        return Captured(attrs.evolve(capture(state, copied=copied, weights={}, rng=rng), weights=weights), weights)

    def load(self, ctx: Context, folder: Path, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """The whole model and optimizer are in the shared files, so a checkpoint of N processes continues on M
        replicas (DDP, one process): every process reads them, and the data position of the first process, in samples."""
        acc = ctx.accelerator
        world = manifest["world_size"]
        elastic = world != acc.num_processes
        if elastic and shards_parameters(acc):
            raise CheckpointError(
                f"{folder} was written by {world} process(es) in the gathered format and this run shards its parameters "
                f"(FSDP) over {acc.num_processes}: a gathered checkpoint is dealt out to replicas (DDP, one process) only. "
                f"Resume it on {world} process(es), or on {acc.num_processes} without FSDP, and save there with "
                "save_checkpoint(..., sharded=True), which resumes under FSDP on any number of processes."
            )
        source = 0 if elastic else acc.process_index  # another number of processes: every process continues from the first one's states
        files = read_verified(folder, manifest, ["state.json", "state.safetensors", "model.safetensors", *rank_files(source)])
        run, resume, saved_steps = decode(folder, files, state, source)
        del files
        if elastic:
            run, resume = _elastic(folder, run, resume, saved_steps, world, acc)
        else:
            _check_accumulation(ctx, folder, saved_steps)
        try:
            check_fits(run, state)
        except StateMismatch as exc:
            raise CheckpointError(f"{folder} {exc}") from None

        # Everything read and checked: now change things.
        return _loaded(put_back(run, state, keep_run=False), resume)


class Sharded:
    """Format 2: every process its own pieces (``_sharded.py``); resumed on any number of processes."""

    code = SHARDED

    def capture(self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool) -> Captured:
        from trainfold.checkpoint.formats import (
            dcp as _sharded,  # torch.distributed.checkpoint: imported by the first sharded save, not with trainfold
        )

        acc = ctx.accelerator
        shards, rest = agreed(ctx, lambda: _sharded.split_state(unwrap(acc, state.model), inner_optimizer(state.optimizer)), "reading the state to save")
        if copied:
            shards = to_host(shards)
        run = capture(state, copied=copied, rng=rng, sharded_optimizer=rest)
        return Captured(run, {k: local(v) for k, v in shards.items() if k.startswith(_sharded.MODEL)}, shards=shards)

    def load(self, ctx: Context, folder: Path, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """Every process reads the pieces of its own layout (a collective)."""
        from trainfold.checkpoint.formats import dcp as _sharded

        acc = ctx.accelerator
        rank = acc.process_index
        model, optimizer = unwrap(acc, state.model), inner_optimizer(state.optimizer)

        world = manifest["world_size"]
        elastic = world != acc.num_processes
        source = 0 if elastic else rank  # another number of processes: every process continues from the first one's states

        def read_and_check() -> tuple[Any, Resume, Any]:
            files = read_verified(folder, manifest, ["state.json", "state.safetensors", _sharded.METADATA, *rank_files(source)])
            run, resume, saved_steps = decode(folder, files, state, source)
            if elastic:
                run, resume = _elastic(folder, run, resume, saved_steps, world, acc)
            else:
                _check_accumulation(ctx, folder, saved_steps)
            metadata = _sharded.parse_metadata(folder, files[_sharded.METADATA], world)
            try:
                check_fits(run, state)
                _sharded.check_layout(metadata, model, optimizer, run.optimizer)
            except ValueError as exc:  # StateMismatch, and check_layout's predicates
                raise CheckpointError(f"{folder} {exc}") from None
            return run, resume, metadata

        run, resume, metadata = agreed(ctx, read_and_check, f"reading {folder}")

        def read_file(name: str) -> Mapping[str, torch.Tensor]:
            return parse_tensors(folder, name, read_verified(folder, manifest, [name])[name])

        tensors = _sharded.load_shards(metadata, read_file, model, optimizer)
        # Everything read and checked, on every process: now change things.
        _sharded.apply(model, optimizer, tensors, run.optimizer)
        return _loaded(put_back(run, state, keep_run=False), resume)


class DeepSpeedFormat:
    """Format 3: DeepSpeed's engine files, taken as bytes (each process its ZeRO partition) and read back safely."""

    code = DEEPSPEED

    def capture(self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool) -> Captured:
        from trainfold.checkpoint.formats import (
            engine_files as _deepspeed,  # imports deepspeed
        )

        _check_at_update(ctx, state)
        files = agreed(ctx, lambda: _deepspeed.capture(state.model), "reading DeepSpeed's engine state")
        run = capture(state, copied=copied, rng=rng, sharded_optimizer={})
        weights = _deepspeed.local_weights(state.model)
        return Captured(run, to_host(weights) if copied else weights, files=files)

    def load(self, ctx: Context, folder: Path, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """Every engine file read, verified and parsed safely, then given to the engine (a collective)."""
        from trainfold.checkpoint.formats import (
            engine_files as _deepspeed,  # imports deepspeed
        )

        acc = ctx.accelerator
        rank = acc.process_index
        if manifest["world_size"] != acc.num_processes:
            raise CheckpointError(
                f"{folder} was written by {manifest['world_size']} processes under DeepSpeed and this run has "
                f"{acc.num_processes}: ZeRO's optimizer partitions cannot be dealt out anew here. Resume it on "
                f"{manifest['world_size']} processes (DeepSpeed's ds_to_universal converts its own checkpoints for another number)."
            )

        # DeepSpeed's loader looks for its files in the folder itself, not in the manifest: a file the manifest does not list
        # (added after the save) is refused here, as every unlisted file is never read in the other formats
        unlisted = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST and p.name not in manifest["files"])
        if unlisted:
            raise CheckpointError(
                f"{folder} holds {unlisted[0]!r}, which its manifest does not list: a file added after the checkpoint was "
                "committed, which DeepSpeed's loader would read. Refused, nothing changed; remove it to load this checkpoint."
            )

        def read_and_check() -> tuple[Any, Resume, Any]:
            engine_names = _deepspeed.files_to_read(manifest, rank)
            files = read_verified(folder, manifest, ["state.json", "state.safetensors", *rank_files(rank), *engine_names])
            run, resume, saved_steps = decode(folder, files, state, rank)
            _check_accumulation(ctx, folder, saved_steps)
            try:
                parsed = _deepspeed.parse({n: files[n] for n in engine_names})
                _deepspeed.check(parsed, state.model, acc.num_processes)
                check_fits(run, state)
            except ValueError as exc:  # StateMismatch, and _deepspeed's predicates
                raise CheckpointError(f"{folder} {exc}") from None
            return run, resume, parsed

        run, resume, parsed = agreed(ctx, read_and_check, f"reading {folder}")
        # Everything read, verified, parsed and checked, on every process: now change things.
        _deepspeed.load(state.model, folder, parsed)
        return _loaded(put_back(run, state, keep_run=False), resume)



def for_save(ctx: Context, sharded: bool) -> Format:
    """The format of a save: DeepSpeed's under DeepSpeed, else sharded or gathered as decided."""
    if is_deepspeed(ctx.accelerator):
        return DeepSpeedFormat()
    return Sharded() if sharded else Gathered()


def for_load(ctx: Context, folder: Path, manifest: Mapping[str, Any]) -> Format:
    """The format of a checkpoint, refused where this run cannot take it (DeepSpeed on one side only).

    Raises:
        CheckpointError: DeepSpeed on one side only.
    """
    code = manifest["format"]
    if (code == DEEPSPEED) != is_deepspeed(ctx.accelerator):
        raise CheckpointError(
            f"{folder} was written by a run under DeepSpeed and this run does not use it: its model and optimizer are "
            "DeepSpeed's engine files. Resume it under the same DeepSpeed config." if code == DEEPSPEED else
            f"{folder} was written by a run without DeepSpeed and this run uses it: resume it without DeepSpeed (then "
            "save there under DeepSpeed to continue with it)."
        )
    formats: dict[int, Format] = {FORMAT: Gathered(), SHARDED: Sharded(), DEEPSPEED: DeepSpeedFormat()}
    return formats[code]


def _check_at_update(ctx: Context, state: TrainState) -> None:
    """Under DeepSpeed, refuse a save inside an accumulation group: the engine's partial gradients are not in its checkpoint."""
    if accumulation_counter(ctx.accelerator) % ctx.gradient_accumulation_steps:
        raise ValueError(
            f"save_checkpoint: under DeepSpeed a checkpoint is taken at an optimizer update, and this state is inside an "
            f"accumulation group (micro-batch {state.micro_step}, {ctx.gradient_accumulation_steps} per update): DeepSpeed "
            "keeps the group's partial gradients in its own buffers, which its checkpoint does not hold. Save after the "
            "update (checkpoint_every, fit and a stop by signal all save there)."
        )


def _loaded(loaded: TrainState, resume: Resume) -> TrainState:
    # A schedule-free optimizer was saved in eval mode (save_checkpoint switches it): back to the mode the run was in.
    modes = optimizer_modes(loaded.optimizer)
    if modes is not None and loaded.model.training:
        modes.train()
    # A stop that ended only the saving invocation (a budget, a signal) is not carried on; a finished run stays stopped.
    return attrs.evolve(loaded, cursor=resume, should_stop=loaded.finished, stop_reason=loaded.stop_reason if loaded.finished else "",
                        final_stop=loaded.final_stop and loaded.finished)


def _check_accumulation(ctx: Context, folder: Path, saved_steps: int) -> None:
    if saved_steps != ctx.gradient_accumulation_steps:
        raise CheckpointError(
            f"{folder} was saved with gradient_accumulation_steps={saved_steps}, this run "
            f"uses {ctx.gradient_accumulation_steps}: the accumulation phase and the updates would not line up. "
            "Resume with the same Accelerator settings."
        )


def _elastic(folder: Path, run: RunState, resume: Resume, saved_steps: int, saved: int, acc: Any) -> tuple[RunState, Resume]:
    """A checkpoint of ``saved`` processes, continued on this run's: checked, at a new accumulation group, by its position in samples.

    The epoch's running train sums were each process's own and cannot be dealt out
    anew: they restart empty, with a warning (the next epochs' train values are exact).
    """
    _check_elastic(folder, run, resume, saved_steps, saved, acc.num_processes)
    run = attrs.evolve(run, accelerate_step=0)  # at an update: a new accumulation group begins
    if run.values.batch_in_epoch > 0:
        warnings.warn(
            f"load_checkpoint: {folder} was saved by {saved} processes in the middle of epoch {run.values.epoch + 1}; this run "
            f"has {acc.num_processes}. The model, optimizer and data position continue exactly, but the epoch's running "
            "train sums were each process's own and cannot be dealt out anew, so they restart empty: this epoch's "
            "train_loss (and train aux values) will not be exact; the next epochs' are.",
            UserWarning,
            stacklevel=4,
        )
        run = attrs.evolve(run, values=attrs.evolve(run.values, sums=run.values.sums.reset(acc.device)))
    return run, attrs.evolve(resume, elastic=True)


def _check_elastic(folder: Path, run: Any, resume: Resume, saved_steps: int, saved: int, now: int) -> None:
    """A checkpoint of ``saved`` processes continues on ``now`` only at an optimizer update, with its position in samples."""
    if run.accelerate_step % saved_steps or run.grads:
        raise CheckpointError(
            f"{folder} was saved by {saved} processes in the middle of an accumulation group (their partial gradients "
            f"cannot be dealt out to {now}): resume it on {saved} processes, or from a checkpoint at an optimizer update "
            "(checkpoint_every saves at updates)."
        )
    if run.values.batch_in_epoch > 0 and resume.samples_done is None:
        raise CheckpointError(
            f"{folder} was saved by {saved} processes in the middle of an epoch over a loader whose position in samples "
            f"is unknown (an iterable dataset): resume it on {saved} processes, or from a checkpoint between epochs."
        )


