"""What a run is at one moment, as one value: the single description that snapshots and checkpoints share.

Owned here: :class:`RunState` and its three operations, :func:`capture`,
:func:`check_fits` and :func:`put_back`. ``snapshot``/``restore`` keep a
RunState in memory; ``save_checkpoint``/``load_checkpoint`` write one to files
and read it back. A part added here is snapshotted and checkpointed alike.
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any, Callable, Mapping

import attrs
import torch

from trainfold._src.backend.engine import like_param, local, unwrap
from trainfold._src.backend.optim import (
    accumulation_counter,
    inner_optimizer,
    loss_scaler,
    plain_lr,
    set_accumulation_counter,
)
from trainfold._src.base import rng as _rng
from trainfold._src.core.state import TrainState


class StateMismatch(ValueError):
    """A saved run state that does not fit the live model, optimizer or scheduler.

    Its text is a predicate about the saved state ("is from another model: ..."), to follow its name.
    """


@attrs.frozen
class FrozenTensor:
    """What a checkpoint records of a frozen parameter instead of its values: enough to tell its base from another."""

    #: the parameter's name in the model's state dict
    name: str
    #: its whole shape (gathered from its shards)
    shape: tuple[int, ...]
    #: its dtype, as torch names it without the module (``float32``, ``bfloat16``)
    dtype: str
    #: the XXH3-128 digest of its bytes (the whole tensor, C order), as 32 hex digits
    digest: str


@attrs.frozen(eq=False)
class RunState:
    """Everything a run needs to continue from one moment.

    Attributes:
        values: the TrainState's values (counters, history, running sums,
            ``extras``) with no live handle and no cursor.
        weights: the model's state dict (parameters and buffers).
        grads: the gradients accumulated so far (mid-accumulation), by parameter name.
        optimizer: the torch optimizer's state dict.
        scheduler: the scheduler's state dict, or None.
        scaler: Accelerate's fp16 loss scaler's state dict, or None.
        accelerate_step: Accelerate's micro-batch counter (the accumulation phase).
        rng: the random states (global ones; and the loader's generators, for checkpoints).
        sharded: the model's and optimizer's tensors are not here: a sharded checkpoint
            reads and writes them through ``checkpoint/formats/dcp.py``; ``weights`` is empty and
            ``optimizer`` holds the optimizer's other values (learning rates...).
        frozen: the frozen parameters an adapter checkpoint records by fingerprint
            (``checkpoint/frozen.py``) instead of holding them: ``weights`` lacks them. Empty: every
            parameter is in ``weights`` (or, sharded, in the checkpoint's pieces).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, *_ = testing.tiny_setup(seed=0)
        >>> snap = snapshot(state)
        >>> sorted(snap.weights), snap.values.step, snap.scheduler is None
        (['bias', 'weight'], 0, True)
    """

    values: TrainState = attrs.field(repr=False)
    weights: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    grads: Mapping[str, torch.Tensor] = attrs.field(repr=False)
    optimizer: Any = attrs.field(repr=False)
    scheduler: Any = attrs.field(repr=False)
    scaler: Any = attrs.field(repr=False)
    accelerate_step: int
    rng: _rng.RngStates = attrs.field(repr=False)
    sharded: bool = False
    frozen: tuple[FrozenTensor, ...] = ()

    @property
    def step(self) -> int:
        return self.values.step

    @property
    def epoch(self) -> int:
        return self.values.epoch


def detach(value: Any, keep: Mapping[int, Any] | None = None) -> Any:
    """A copy of a state value that shares no tensor with it (tensors cloned, modules deep-copied), but the objects
    ``keep`` holds by ``id``: the model's frozen parameters, which an EMA's average shares with the model and nothing
    trains (a copy of the average then keeps the base rather than copying it).

    Handles what a TrainState holds: tensors, modules, read-only and plain
    mappings, tuples, lists, attrs records (trainfold's and yours) and plain
    immutable values; anything else is deep-copied.
    """
    kept: Mapping[int, Any] = keep or {}
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.nn.Module):
        return copy.deepcopy(value, dict(kept))
    if isinstance(value, MappingProxyType):
        return MappingProxyType({k: detach(v, kept) for k, v in value.items()})
    if isinstance(value, dict):
        return {k: detach(v, kept) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(detach(v, kept) for v in value)
    if attrs.has(type(value)):
        return attrs.evolve(
            value, **{f.alias: detach(getattr(value, f.name), kept) for f in attrs.fields(type(value)) if f.init}
        )
    return copy.deepcopy(value)


def frozen_objects(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """``model``'s frozen parameters by ``id``: what :func:`detach` keeps rather than copies."""
    return {id(p): p for p in model.parameters() if not p.requires_grad}


#: What a TrainState's values have instead of live objects (a value, not a handle to the run).
NO_HANDLES: dict[str, Any] = {"model": None, "optimizer": None, "scheduler": None, "accelerator": None, "cursor": None}


def values_of(state: TrainState) -> TrainState:
    """The state's values: the same TrainState with no handle and no cursor (nothing copied)."""
    return attrs.evolve(state, **NO_HANDLES)


def capture(
    state: TrainState,
    *,
    copied: bool = True,
    weights: Mapping[str, torch.Tensor] | None = None,
    rng: _rng.RngStates | None = None,
    sharded_optimizer: Mapping[str, Any] | None = None,
) -> RunState:
    """The run state of ``state``.

    Args:
        state: the live state.
        copied: copy every tensor and state dict (a snapshot); False only reads
            them (a checkpoint writes them to files right away).
        weights: the model's weights if already gathered (a sharded engine gathers
            them on every process: ``accelerator.get_state_dict``).
        rng: the random states if already captured (a checkpoint takes them first).
        sharded_optimizer: for a sharded checkpoint, the optimizer's values other than
            tensors (``_sharded.split_state``); the weights are then not captured.
    """
    acc = state.accelerator
    model = unwrap(acc, state.model)
    scaler = loss_scaler(acc)
    frozen = frozen_objects(model)
    keep: Callable[[Any], Any] = (lambda v: detach(v, frozen)) if copied else (lambda v: v)
    sharded = sharded_optimizer is not None
    if weights is None:
        weights = {} if sharded else model.state_dict()
    return RunState(
        values=keep(values_of(state)),
        weights={k: keep(v) for k, v in weights.items()},
        grads={n: keep(local(p.grad)) for n, p in model.named_parameters() if p.grad is not None},
        optimizer=dict(sharded_optimizer)
        if sharded_optimizer is not None
        else keep(plain_lr(inner_optimizer(state.optimizer).state_dict())),
        scheduler=None if state.scheduler is None else keep(plain_lr(state.scheduler.state_dict())),
        scaler=None if scaler is None else keep(scaler.state_dict()),
        accelerate_step=accumulation_counter(acc),
        rng=_rng.capture() if rng is None else rng,
        sharded=sharded,
    )


def check_fits(run: RunState, state: TrainState) -> None:
    """Raise unless ``run`` can be put into ``state``'s model, optimizer and scheduler.

    Raises:
        StateMismatch: other parameter names or shapes, another optimizer layout,
            or a scheduler on one side only.
    """
    # First: a scheduler on one side only also changes the optimizer's parameter groups (initial_lr), the symptom
    if (run.scheduler is None) != (state.scheduler is None):
        has = "has no" if run.scheduler is None else "has a"
        live_has = "has one" if state.scheduler is not None else "has none"
        raise StateMismatch(
            f"{has} scheduler but the state {live_has}: build the state with the scheduler the run had."
        )
    if not run.sharded:  # a sharded checkpoint's model and optimizer: _sharded.check_layout
        _check_model(unwrap(state.accelerator, state.model), run.weights, frozenset(f.name for f in run.frozen))
        optimizer = inner_optimizer(state.optimizer)
        _check_optimizer(optimizer, run.optimizer)
        for saved, live in zip(run.optimizer["param_groups"], optimizer.state_dict()["param_groups"]):
            _check_like(saved, live, "optimizer parameter group")
    if state.scheduler is not None:
        _check_like(run.scheduler, state.scheduler.state_dict(), "scheduler state")
    scaler = loss_scaler(state.accelerator)
    if scaler is not None and run.scaler is not None:
        _check_like(run.scaler, scaler.state_dict(), "loss scaler state")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.ndim == 0):
        return "number"  # (a compiled update's learning rate is a 0-d tensor, the checkpoint's a float)
    if isinstance(value, (list, tuple)):
        return "sequence"
    return type(value).__name__


def _check_like(saved: Any, live: Mapping[str, Any], what: str) -> None:
    """A saved state dict must have the live one's keys, each of the same kind (``load_state_dict`` would take anything).

    Raises:
        StateMismatch: another key set, or a value of another kind (a string for a number...).
    """
    if not isinstance(saved, Mapping) or set(saved) != set(live):
        keys = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        raise StateMismatch(f"does not fit: its {what} has keys {keys}, this run's has {sorted(map(str, live))}.")
    for key, value in live.items():
        if value is not None and saved[key] is not None and _kind(saved[key]) != _kind(value):
            raise StateMismatch(
                f"does not fit: its {what} {key!r} is a {_kind(saved[key])}, this run's a {_kind(value)}."
            )


def _same(value: Any) -> Any:
    return value


def put_back(
    run: RunState, state: TrainState, *, keep_run: bool = True, model_and_optimizer: bool = True
) -> TrainState:
    """Put ``run`` into ``state``'s live objects (in place) and return its values with ``state``'s handles.

    The weights, gradients, optimizer, scheduler and scaler states, Accelerate's
    counter and the global random states become ``run``'s: copies with
    ``keep_run`` (a snapshot can be put back again), ``run``'s own objects
    without (a run state just read from a checkpoint, used once). Call
    :func:`check_fits` first: this changes things as it goes. ``model_and_optimizer=False``:
    the caller put the weights and optimizer state back itself (dealt out into FSDP's shards).
    """
    own: Callable[[Any], Any] = copy.deepcopy if keep_run else _same
    acc = state.accelerator
    model = unwrap(acc, state.model)
    if not run.sharded and model_and_optimizer:  # a sharded checkpoint's are put back by its format (formats/dcp.py)
        model.load_state_dict(
            run.weights, strict=not run.frozen
        )  # an adapter checkpoint's frozen tensors: checked, kept
        inner_optimizer(state.optimizer).load_state_dict(own(run.optimizer))
    for name, p in model.named_parameters():
        grad = run.grads.get(name)
        p.grad = None if grad is None else like_param(grad, p)
    if state.scheduler is not None and run.scheduler is not None:
        state.scheduler.load_state_dict(own(run.scheduler))
    scaler = loss_scaler(acc)
    if scaler is not None and run.scaler is not None:
        scaler.load_state_dict(own(run.scaler))
    set_accumulation_counter(acc, run.accelerate_step)
    _rng.restore(attrs.evolve(run.rng, generators=()))  # a loader's generators: run_epoch restores them
    values = detach(run.values, frozen_objects(model)) if keep_run else run.values
    return attrs.evolve(
        values, model=state.model, optimizer=state.optimizer, scheduler=state.scheduler, accelerator=acc, cursor=None
    )


def _check_model(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor], frozen: frozenset[str] = frozenset()
) -> None:
    """The checkpoint's weights, and the frozen parameters it records by fingerprint, must be this model's tensors."""
    current = model.state_dict()
    for name, tensor in current.items():
        if name in frozen:
            continue
        if name not in weights:
            raise StateMismatch(f"is from another model: it has no parameter {name!r} (shape {tuple(tensor.shape)}).")
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise StateMismatch(
                f"is from another model: parameter {name!r} has shape {tuple(weights[name].shape)} in the "
                f"checkpoint and {tuple(tensor.shape)} in this model."
            )
    extra = sorted((set(weights) | frozen) - set(current))
    if extra:
        raise StateMismatch(f"is from another model: it has parameters this model lacks, first {extra[0]!r}.")


def _check_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(groups) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)
    ):
        raise StateMismatch(
            "does not fit this optimizer: the optimizer layout differs: the checkpoint has parameter groups of sizes "
            f"{[len(s['params']) for s in saved_groups]}, this optimizer {[len(g['params']) for g in groups]}."
        )
    params = [p for g in groups for p in g["params"]]
    ids = [i for s in saved_groups for i in s["params"]]
    by_id = dict(zip(ids, params))
    for pid, entry in saved["state"].items():
        param = by_id.get(pid)
        for key, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.ndim > 0
                and param is not None
                and tuple(value.shape) != tuple(param.shape)
            ):
                raise StateMismatch(
                    f"does not fit this optimizer: the optimizer state {key!r} of parameter {ids.index(pid)} has shape "
                    f"{tuple(value.shape)} but the parameter has {tuple(param.shape)}: another optimizer layout."
                )
