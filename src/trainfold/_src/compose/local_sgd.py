"""Local SGD: each process trains on its own for a number of updates, then the processes average their parameters.

Owned here: the step transformer :func:`local_sgd`, the epoch function
:func:`average_parameters` and their record :class:`LocalSgdState` in
``state.extras["local_sgd"]``. Accelerate's ``LocalSGD`` does the same by hand:
``model.no_sync()`` around the whole loop and ``local_sgd.step()`` after each
optimizer step.
"""

from __future__ import annotations

from typing import Any, overload

import attrs
import torch
from toolz import curry

from trainfold._src.backend.engine import engine_name, grads_whole_in_params, is_deepspeed
from trainfold._src.base.checks import name_of, named, positive_int
from trainfold._src.base.records import register_record
from trainfold._src.base.types import Batch
from trainfold._src.core.checks import expect_owned, expect_state
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import EpochFn, Step, StepTransformer

NAME = "local_sgd"


@register_record
@attrs.frozen
class LocalSgdState:
    """``state.extras["local_sgd"]``: the updates since the processes last averaged their parameters, and how often they did.

    While ``since > 0`` the processes' parameters differ (``replicas_differ``):
    a checkpoint then refuses to save (it holds one copy of the model).
    """

    every: int
    since: int = 0
    averages: int = 0

    @property
    def replicas_differ(self) -> bool:
        return self.since > 0


def local_sgd(ctx: Context, every: int) -> StepTransformer:
    """Local SGD: no gradient synchronisation between processes; their parameters are averaged every ``every`` updates.

    Each step runs under DDP's ``no_sync()``, so each process updates its own
    replica with its own gradients; after every ``every``-th optimizer update the
    parameters are averaged over processes (``accelerator.reduce(p, "mean")``
    per parameter, Accelerate's ``LocalSGD`` arithmetic). Also when the run stops
    (``max_steps``, ``stop_when``, a signal agreed at this step), so that what a
    final checkpoint saves is one model. Compose :func:`average_parameters` after
    ``run_epoch`` to average at each epoch's end as well (what leaving Accelerate's
    ``with LocalSGD(...)`` block does). On one process it only counts.

    The count is kept in ``state.extras["local_sgd"]`` (:class:`LocalSgdState`), so
    a checkpoint holds it. A checkpoint is refused while the replicas differ (it
    holds one model): save where they were just averaged, at an epoch's end
    (``save_checkpoint`` composed after ``average_parameters``) or at a stop. The
    optimizer's state is not averaged (nor is it by Accelerate): with momentum or
    Adam each process's moments differ, and a checkpoint holds one process's for each
    parameter (a gathered checkpoint process 0's; a sharded one, the default on several
    processes, those of the process each tensor is dealt to), so a resumed run continues
    with those moments on every process. With a
    stateless optimizer a run resumed from an epoch's end continues exactly; one
    stopped mid-interval was averaged there, which the uninterrupted run was not.

    Accelerate's example calls ``local_sgd.step()`` on every batch, so under
    gradient accumulation it can average inside an accumulation group; this
    counts optimizer updates. Equal without accumulation (tested on 2 processes).

    Args:
        ctx: the run's Context.
        every: average the parameters after every ``every``-th optimizer update (a positive int).

    Returns:
        A step transformer.

    Raises:
        ValueError: ``every`` is not a positive int; under FSDP, DeepSpeed or
            Megatron-LM, whose parameters are not whole replicas.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = run_epoch(ctx, local_sgd(ctx, 2)(make_step(ctx, loss_fn)), loader, state)
        >>> state.extras["local_sgd"]
        LocalSgdState(every=2, since=0, averages=2)
    """
    positive_int("local_sgd", every)
    accelerator = ctx.accelerator
    if is_deepspeed(accelerator) or not grads_whole_in_params(accelerator):
        raise ValueError(
            f"local_sgd averages whole parameter replicas; under {engine_name(accelerator)} each process holds "
            "shards (or the engine holds them): use DDP (several processes without FSDP or DeepSpeed)."
        )
    several = accelerator.num_processes > 1
    interrupt = ctx.runtime.interrupt
    fresh = LocalSgdState(every)

    def transform(step: Step) -> Step:
        def local(state: TrainState, batch: Batch) -> TrainState:
            record: LocalSgdState = state.extras.get(NAME, fresh)
            no_sync = getattr(state.model, "no_sync", None) if several else None
            if no_sync is not None:
                with no_sync():  # DDP: no gradient all-reduce, whatever accumulation decides
                    new = step(state, batch)
            else:
                new = step(state, batch)
            if new.step == state.step:  # no update
                return new if NAME in new.extras else new.with_extra(NAME, record)
            since = record.since + 1
            # a signal agreed at this micro-batch (run_epoch then stops here: the same answer)
            stopping = (new.should_stop and not state.should_stop) or (
                several
                and new.micro_step >= interrupt.next_check
                and interrupt.check(new.micro_step, accelerator.sync_gradients, new.step) != 0
            )
            if since < every and not stopping:
                return new.with_extra(NAME, LocalSgdState(every, since, record.averages))
            if several:
                _average(accelerator, new.model)
            return new.with_extra(NAME, LocalSgdState(every, 0, record.averages + 1))

        return named(local, f"local_sgd({every})({name_of(step)})")

    return transform


@torch.no_grad()
def _average(accelerator: Any, model: torch.nn.Module) -> None:
    """Every parameter replaced by its mean over processes, as Accelerate's ``LocalSGD._sync_and_avg_model_params`` does."""
    with accelerator.autocast():
        for param in model.parameters():
            param.data = accelerator.reduce(param.data, reduction="mean")


@overload
def average_parameters(ctx: Context) -> EpochFn: ...
@overload
def average_parameters(ctx: Context, state: TrainState) -> TrainState: ...
@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def average_parameters(ctx: Context, state: TrainState) -> TrainState:
    """Average the parameters over processes now if :func:`local_sgd` left them different (an epoch function).

    Compose it after ``run_epoch``: ``compose(evaluate(...), average_parameters(ctx),
    run_epoch(ctx, local_sgd(ctx, 8)(step), train_dl))``, so every epoch ends with
    one model, as leaving Accelerate's ``with LocalSGD(...)`` block does. A state
    whose replicas are already equal is returned unchanged.

    Args:
        ctx: the run's Context.
        state: the state whose model's replicas to average (curried: ``average_parameters(ctx)`` is an epoch function).

    Returns:
        ``state`` with ``extras["local_sgd"]`` counting the average (unchanged where the replicas were equal).

    Raises:
        TypeError: ``state`` is not a TrainState.
        ValueError: ``state`` was made with another Context.

    Examples:
        >>> from toolz import compose
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> epoch = compose(average_parameters(ctx), run_epoch(ctx, local_sgd(ctx, 3)(make_step(ctx, loss_fn)), loader))
        >>> epoch(state).step
        4
    """
    state = expect_owned("average_parameters", ctx, expect_state("average_parameters", state))
    record: LocalSgdState | None = state.extras.get(NAME)
    if record is None or not record.replicas_differ:
        return state
    if ctx.accelerator.num_processes > 1:
        _average(ctx.accelerator, state.model)
    return state.with_extra(NAME, LocalSgdState(record.every, 0, record.averages + 1))
