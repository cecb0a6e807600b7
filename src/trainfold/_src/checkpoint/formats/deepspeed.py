"""Format 3, DeepSpeed: the engine's own files (each process its ZeRO partition), read back safely (``engine_files.py``)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import Any, Mapping

import torch

from trainfold._src.backend.optim import accumulation_counter
from trainfold._src.base import rng as _rng
from trainfold._src.checkpoint.commit import agreed
from trainfold._src.checkpoint.encoding import decode
from trainfold._src.checkpoint.formats.common import Captured, check_accumulation, loaded, to_host
from trainfold._src.checkpoint.manifest import DEEPSPEED, MANIFEST, is_engine_file, rank_files, read_verified
from trainfold._src.checkpoint.storage.protocol import Staging, Stored
from trainfold._src.core.context import Context
from trainfold._src.core.cursor import Resume
from trainfold._src.core.runstate import FrozenTensor, capture, check_fits, put_back
from trainfold._src.core.state import TrainState
from trainfold.errors import CheckpointError


class DeepSpeedFormat:
    """Format 3: DeepSpeed's engine files, taken as bytes (each process its ZeRO partition) and read back safely."""

    code = DEEPSPEED
    partitioned = True

    def capture(
        self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool, frozen: tuple[FrozenTensor, ...] = ()
    ) -> Captured:
        del frozen  # the engine's files hold every parameter (save.py asks for no fingerprint under DeepSpeed)
        from trainfold._src.checkpoint.formats import engine_files as _deepspeed  # imports deepspeed

        _check_at_update(ctx, state)
        files = agreed(ctx, lambda: _deepspeed.capture(state.model), "reading DeepSpeed's engine state")
        run = capture(state, copied=copied, rng=rng, sharded_optimizer={})
        weights = _deepspeed.local_weights(state.model)
        return Captured(run, to_host(weights) if copied else weights, files=files)

    def write_pieces(
        self, staging: Staging, shards: Mapping[str, torch.Tensor], rank: int, group: Any
    ) -> dict[str, dict[str, Any]]:
        return {}  # the engine's files are captured as bytes and written with the others

    def load(self, ctx: Context, folder: Stored, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """Every engine file read, verified and parsed safely, then given to the engine (a collective)."""
        from trainfold._src.checkpoint.formats import engine_files as _deepspeed  # imports deepspeed

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
        unlisted = sorted(name for name in folder.names() if name != MANIFEST and name not in manifest["files"])
        if unlisted:
            raise CheckpointError(
                f"{folder} holds {unlisted[0]!r}, which its manifest does not list: a file added after the checkpoint was "
                "committed, which DeepSpeed's loader would read. Refused, nothing changed; remove it to load this checkpoint."
            )

        def read_and_check() -> tuple[Any, Resume, Any]:
            engine_names = _deepspeed.files_to_read(manifest, rank)
            files = read_verified(
                folder, manifest, ["state.json", "state.safetensors", *rank_files(rank), *engine_names]
            )
            run, resume, saved_steps = decode(folder, files, state, rank)
            check_accumulation(ctx, folder, saved_steps)
            try:
                parsed = _deepspeed.parse({n: files[n] for n in engine_names})
                _deepspeed.check(parsed, state.model, acc.num_processes)
                check_fits(run, state)
            except ValueError as exc:  # StateMismatch, and _deepspeed's predicates
                raise CheckpointError(f"{folder} {exc}") from None
            return run, resume, parsed

        run, resume, parsed = agreed(ctx, read_and_check, f"reading {folder}")
        # Everything read, verified, parsed and checked, on every process: now change things.
        local = folder.local_folder()
        if local is not None:
            _deepspeed.load(state.model, local, parsed)
        else:  # on a store: DeepSpeed looks for its files' names in a folder (it reads the parsed values, served from memory)
            with tempfile.TemporaryDirectory(prefix="trainfold-deepspeed-") as names_only:
                for name in manifest["files"]:
                    if is_engine_file(name):
                        open(os.path.join(names_only, name), "wb").close()
                _deepspeed.load(state.model, names_only, parsed)
        return loaded(put_back(run, state, keep_run=False), resume)

    def weights(self, folder: Stored, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The fp32 master weights of every ZeRO partition put together (DeepSpeed's ``zero_to_fp32``), from verified, safely parsed files."""
        from trainfold._src.checkpoint.formats import engine_files as _deepspeed

        files = read_verified(folder, manifest, sorted(n for n in manifest["files"] if is_engine_file(n)))
        try:
            return _deepspeed.merged_weights(_deepspeed.parse(files))
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            RuntimeError,
            IndexError,
            OverflowError,
        ) as exc:  # parsed, does not add up
            hint = (
                ""
                if importlib.util.find_spec("deepspeed")
                else (
                    " DeepSpeed is not installed here, and its files hold its record classes, admitted only with it: pip install deepspeed."
                )
            )
            reason = (
                str(exc)
                if isinstance(exc, ValueError)
                else f"has DeepSpeed files that do not fit together ({type(exc).__name__}: {exc}), refused."
            )
            raise CheckpointError(f"{folder} {reason}{hint}") from None


def _check_at_update(ctx: Context, state: TrainState) -> None:
    """Under DeepSpeed, refuse a save inside an accumulation group: the engine's partial gradients are not in its checkpoint."""
    if accumulation_counter(ctx.accelerator) % ctx.gradient_accumulation_steps:
        raise ValueError(
            f"save_checkpoint: under DeepSpeed a checkpoint is taken at an optimizer update, and this state is inside an "
            f"accumulation group (micro-batch {state.micro_step}, {ctx.gradient_accumulation_steps} per update): DeepSpeed "
            "keeps the group's partial gradients in its own buffers, which its checkpoint does not hold. Save after the "
            "update (checkpoint_every, fit and a stop by signal all save there)."
        )
