"""Format 1, gathered: the model in the main process's ``model.safetensors``, the optimizer in the shared ``state.*`` files.

Every process reads the whole model and optimizer back, so a checkpoint of N
processes resumes on M replicas (DDP, one process); into FSDP's shards it is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from trainfold._src.backend.engine import shards_parameters, unwrap
from trainfold._src.backend.optim import inner_optimizer
from trainfold._src.base import rng as _rng
from trainfold._src.checkpoint.content import parse_tensors
from trainfold._src.checkpoint.encoding import decode
from trainfold._src.checkpoint.formats.common import (
    Captured,
    adopt_weights,
    check_accumulation,
    check_adapters,
    elastic_resume,
    live_fingerprint,
    loaded,
    parameters_of,
    release_copied,
    saved_elsewhere,
    to_host,
    with_peers,
    without,
)
from trainfold._src.checkpoint.manifest import FORMAT, rank_files, read_verified
from trainfold._src.checkpoint.storage.protocol import Staging, Stored
from trainfold._src.core.context import Context
from trainfold._src.core.runstate import FrozenTensor, StateMismatch, capture, check_fits, put_back
from trainfold._src.core.state import TrainState
from trainfold.errors import CheckpointError


class Gathered:
    """Format 1: the model and optimizer gathered into the main process's files; resumed on any number of processes."""

    code = FORMAT
    partitioned = False

    def capture(
        self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool, frozen: tuple[FrozenTensor, ...] = ()
    ) -> Captured:
        weights = ctx.accelerator.get_state_dict(state.model)  # every process takes part (sharded engines gather)
        weights = without(weights, frozen)
        if copied:
            weights = to_host(weights)
        run = attrs.evolve(capture(state, copied=copied, weights={}, rng=rng), weights=weights, frozen=frozen)
        return Captured(run, parameters_of(weights, unwrap(ctx.accelerator, state.model)))

    def write_pieces(
        self, staging: Staging, shards: Mapping[str, torch.Tensor], rank: int, group: Any
    ) -> dict[str, dict[str, Any]]:
        return {}  # every tensor is in the shared files

    def load(self, ctx: Context, folder: Stored, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """The whole model and optimizer are in the shared files, so a checkpoint of N processes continues on M: every
        process reads them, and the data position of the first process, in samples. Replicas (DDP, one process) take
        them whole; under FSDP they are dealt out into this run's shards."""
        acc = ctx.accelerator
        elastic = saved_elsewhere(manifest, acc)
        into_shards = shards_parameters(acc)
        source = (
            0 if elastic else acc.process_index
        )  # another number of processes: every process continues from the first one's states
        live_frozen = live_fingerprint(
            ctx, state
        )  # before anything is read: every process hashes (a sharded base is gathered)
        files = read_verified(
            folder, manifest, ["state.json", "state.safetensors", "model.safetensors", *rank_files(source)]
        )
        run, resume, saved_steps = decode(folder, files, state, source)
        del files
        if elastic:
            run, resume = elastic_resume(folder, run, resume, saved_steps, manifest, acc)
        else:
            check_accumulation(ctx, folder, saved_steps)
        resume = with_peers(folder, manifest, resume, elastic)
        if into_shards and run.grads:
            raise CheckpointError(
                f"{folder} was saved in the middle of an accumulation group, and its partial gradients are whole tensors this "
                f"run would have to shard (FSDP over {acc.num_processes}): resume it without FSDP, or from a checkpoint at an "
                "optimizer update (checkpoint_every saves at updates)."
            )
        check_adapters(folder, run, state, live_frozen)  # first: other adapters are named as such, not as another model
        try:
            check_fits(run, state)
        except StateMismatch as exc:
            raise CheckpointError(f"{folder} {exc}") from None

        # Everything read and checked: now change things.
        model, optimizer = unwrap(acc, state.model), inner_optimizer(state.optimizer)
        if into_shards:
            from trainfold._src.checkpoint.formats import dcp

            dcp.deal_out(model, optimizer, run.weights, run.optimizer, strict=not run.frozen)
        else:
            adopt_weights(model, run.weights)  # the verified buffers become the weights: nothing is copied into them
        state = put_back(run, state, keep_run=False, model_and_optimizer=not into_shards)
        release_copied(run.weights, model, optimizer)
        return loaded(state, resume)

    def weights(self, folder: Stored, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The model's ``model.safetensors``, verified, as tensors of their own."""
        data = read_verified(folder, manifest, ["model.safetensors"])["model.safetensors"]
        return {k: v.clone() for k, v in parse_tensors(folder, "model.safetensors", data).items()}
