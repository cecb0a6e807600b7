"""The types of what users compose, named once with their contracts: steps, step transformers, epoch functions.

Aliases and protocols over :class:`~trainfold.TrainState`; importing this module does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from trainfold._src.core.state import TrainState
from trainfold._src.base.types import Batch


class Step(Protocol):
    """``step(state, batch) -> state``: consume one batch.

    Returns a new :class:`~trainfold.TrainState`; the old one's counters and
    records are never changed. The model and optimizer behind both states are
    the same objects, updated in place (see the guide "What a step does", The purity contract).

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> inner = make_step(ctx, loss_fn)
        >>> def counting(state, batch):  # a Step: (state, batch) -> a new state, here make_step's and a count
        ...     new = inner(state, batch)
        ...     return new.with_extra("batches", new.extras.get("batches", 0) + 1)
        >>> run_epoch(ctx, counting, loader, state).extras["batches"]
        4
    """

    def __call__(self, state: TrainState, batch: Batch, /) -> TrainState: ...


StepTransformer = Callable[[Step], Step]
"""``transformer(step) -> step``: wraps a step to add behaviour (logging, a NaN guard, EMA, a step
limit). Its own state lives in ``state.extras[name]``.
"""


EpochFn = Callable[["TrainState"], "TrainState"]
"""``epoch_fn(state) -> state``: one unit of the outer loop (an epoch, an evaluation, early stopping, a
checkpoint). Must return a TrainState.
"""


StatePredicate = Callable[["TrainState"], bool]
"""``predicate(state) -> bool``, for ``until`` and ``every``."""
