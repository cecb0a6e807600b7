"""A background save's host copy, held to a budget: how many bytes it would copy, and whether every process may.

A background save copies this process's part of the state to host memory and
returns; a background thread writes the copy. That copy is the state once, on
top of the live one. ``save_checkpoint(..., async_save=True, staging_budget=N)``
bounds it: where a process would copy more than ``N`` bytes, every process saves
this checkpoint blocking instead, from the live tensors, with no copy (the
processes agree, since a save's writes are collectives). Counted before anything
is copied: the model's tensors (this process's shards), its gradients, the
optimizer's state and the tensors a step transformer keeps (an EMA's average).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import attrs
import torch

from trainfold._src.backend.engine import local, unwrap
from trainfold._src.backend.optim import inner_optimizer
from trainfold._src.core.context import Context
from trainfold._src.core.runstate import values_of
from trainfold._src.core.state import TrainState
from trainfold._src.distributed.control import max_over_processes

logger = logging.getLogger("trainfold")


def bytes_to_copy(ctx: Context, state: TrainState) -> int:
    """The bytes a background save of ``state`` copies to host memory on this process (each storage counted once)."""
    model = unwrap(ctx.accelerator, state.model)
    tensors: list[torch.Tensor] = [local(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += list(_tensors_in(inner_optimizer(state.optimizer).state))
    tensors += list(_tensors_in(values_of(state)))
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if t.numel() else (id(t), 0)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def within_budget(ctx: Context, state: TrainState, budget: int) -> bool:
    """Whether every process's copy fits its ``budget`` (a collective on several processes: they all decide alike, even
    with budgets of their own); said once where one does not."""
    over = bytes_to_copy(ctx, state) - budget
    most = over if ctx.accelerator.num_processes == 1 else max_over_processes(ctx.runtime.control, over)
    if most <= 0:
        return True
    if ctx.runtime.warn_once("staging budget") and ctx.is_main_process:
        logger.warning(
            "save_checkpoint: a background save would copy %.1f MiB more of the state to host memory than its "
            "staging_budget allows on a process, so this save (and any other over the budget) is written before it "
            "returns, from the live tensors, with no copy. Raise staging_budget to save in the background. Said once.",
            most / 2**20,
        )
    return False


def _tensors_in(value: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor ``value`` holds: in mappings, sequences, attrs records and modules (their parameters and buffers)."""
    seen = set() if seen is None else seen
    if id(value) in seen or value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield local(value)
    elif isinstance(value, torch.nn.Module):
        yield from (local(t) for t in value.state_dict().values() if isinstance(t, torch.Tensor))
    elif isinstance(value, dict) or hasattr(value, "items"):
        for v in value.values():
            yield from _tensors_in(v, seen)
    elif isinstance(value, (tuple, list, set, frozenset)):
        for v in value:
            yield from _tensors_in(v, seen)
    elif attrs.has(type(value)):
        for field in attrs.fields(type(value)):
            yield from _tensors_in(getattr(value, field.name), seen)
