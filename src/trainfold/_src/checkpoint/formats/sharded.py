"""Format 2, sharded: every process writes its own pieces of the model and optimizer through DCP (``dcp.py``).

A checkpoint of N processes resumes on any number M, resharded into this run's layout.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from trainfold._src.backend.engine import local, unwrap
from trainfold._src.backend.optim import inner_optimizer
from trainfold._src.base import rng as _rng
from trainfold._src.checkpoint.commit import agreed
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
from trainfold._src.checkpoint.manifest import SHARDED, rank_files, read_verified
from trainfold._src.checkpoint.storage.protocol import Staging, Stored
from trainfold._src.core.context import Context
from trainfold._src.core.cursor import Resume
from trainfold._src.core.runstate import FrozenTensor, capture, check_fits, put_back
from trainfold._src.core.state import TrainState
from trainfold.errors import CheckpointError


class Sharded:
    """Format 2: every process its own pieces (``dcp.py``); resumed on any number of processes."""

    code = SHARDED
    partitioned = True

    def capture(
        self, ctx: Context, state: TrainState, rng: _rng.RngStates, copied: bool, frozen: tuple[FrozenTensor, ...] = ()
    ) -> Captured:
        from trainfold._src.checkpoint.formats import (
            dcp,  # torch.distributed.checkpoint: imported by the first sharded save, not with trainfold
        )

        acc = ctx.accelerator
        shards, rest = agreed(
            ctx,
            lambda: dcp.split_state(unwrap(acc, state.model), inner_optimizer(state.optimizer)),
            "reading the state to save",
        )
        model = unwrap(acc, state.model)
        buffers = [dcp.MODEL + name for name, _ in model.named_buffers()]
        shards = dcp.own_share(without(shards, frozen, prefix=dcp.MODEL), acc.process_index, acc.num_processes, buffers)
        if copied:
            shards = to_host(shards)
        run = attrs.evolve(capture(state, copied=copied, rng=rng, sharded_optimizer=rest), frozen=frozen)
        weights = {k: local(v) for k, v in shards.items() if k.startswith(dcp.MODEL)}
        return Captured(run, parameters_of(weights, model, prefix=dcp.MODEL), shards=shards)

    def write_pieces(
        self, staging: Staging, shards: Mapping[str, torch.Tensor], rank: int, group: Any
    ) -> dict[str, dict[str, Any]]:
        from trainfold._src.checkpoint.formats import dcp

        return dcp.write_shards(staging, shards, rank, group)

    def load(self, ctx: Context, folder: Stored, manifest: Mapping[str, Any], state: TrainState) -> TrainState:
        """Every process reads the pieces of its own layout (a collective)."""
        from trainfold._src.checkpoint.formats import dcp, dcp_metadata

        acc = ctx.accelerator
        rank = acc.process_index
        model, optimizer = unwrap(acc, state.model), inner_optimizer(state.optimizer)

        world = manifest["world_size"]
        elastic = saved_elsewhere(manifest, acc)
        source = (
            0 if elastic else rank
        )  # another number of processes: every process continues from the first one's states
        live_frozen = live_fingerprint(
            ctx, state
        )  # before anything is read: every process hashes (a sharded base is gathered)

        def read_and_check() -> tuple[Any, Resume, Any]:
            files = read_verified(
                folder, manifest, ["state.json", "state.safetensors", dcp_metadata.METADATA, *rank_files(source)]
            )
            run, resume, saved_steps = decode(folder, files, state, source)
            if elastic:
                run, resume = elastic_resume(folder, run, resume, saved_steps, manifest, acc)
            else:
                check_accumulation(ctx, folder, saved_steps)
            resume = with_peers(folder, manifest, resume, elastic)
            metadata = dcp_metadata.parse_metadata(folder, files[dcp_metadata.METADATA], world)
            frozen = frozenset(f.name for f in run.frozen)
            check_adapters(
                folder, run, state, live_frozen
            )  # first: other adapters are named as such, not as another model
            try:
                check_fits(run, state)
                dcp.check_layout(metadata, model, optimizer, run.optimizer, frozen)
            except ValueError as exc:  # StateMismatch, and check_layout's predicates
                raise CheckpointError(f"{folder} {exc}") from None
            return run, resume, metadata

        run, resume, metadata = agreed(ctx, read_and_check, f"reading {folder}")

        def read_file(name: str) -> Mapping[str, torch.Tensor]:
            return parse_tensors(folder, name, read_verified(folder, manifest, [name])[name])

        frozen = frozenset(f.name for f in run.frozen)
        tensors = dcp.load_shards(metadata, read_file, model, optimizer, frozen)
        # Everything read and checked, on every process: now change things.
        adopt_weights(model, {k[len(dcp.MODEL) :]: v for k, v in tensors.items() if k.startswith(dcp.MODEL)})
        dcp.apply(model, optimizer, tensors, run.optimizer, strict=not frozen)
        release_copied(tensors, model, optimizer)
        return loaded(put_back(run, state, keep_run=False), resume)

    def weights(self, folder: Stored, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The pieces of the model put together by the offsets ``tensors.json`` records (no process group is made)."""
        from trainfold._src.checkpoint.formats import dcp, dcp_metadata

        files = read_verified(folder, manifest, [dcp_metadata.METADATA])
        metadata = dcp_metadata.parse_metadata(folder, files[dcp_metadata.METADATA], manifest["world_size"])
        read: dict[str, Mapping[str, torch.Tensor]] = {}
        out: dict[str, torch.Tensor] = {}
        for index, (file, key) in metadata.storage_data.items():
            if not index.fqn.startswith(dcp.MODEL):
                continue
            md = metadata.state_dict_metadata[index.fqn]
            whole = out.get(index.fqn)
            if whole is None:
                whole = out[index.fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)  # type: ignore[union-attr]
            if file not in read:
                read[file] = parse_tensors(folder, file, read_verified(folder, manifest, [file])[file])
            try:  # exactly the declared chunk, as a load reads it: the chunks tile the tensor, so every element is written
                piece = dcp_metadata.check_piece(metadata, index, file, read[file].get(key))
            except CheckpointError as exc:
                raise CheckpointError(f"{folder}: {exc}") from None
            offsets = tuple(index.offset or ())
            whole[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))].copy_(piece)
        return {k[len(dcp.MODEL) :]: v for k, v in out.items()}
