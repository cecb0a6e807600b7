"""The types of what users compose, named once with their contracts: steps, step transformers, epoch functions.

Aliases and protocols over :class:`~trainfold.TrainState`; importing this module does nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from trainfold.core.state import TrainState
from trainfold.base.types import Batch


class Step(Protocol):
    """``step(state, batch) -> state``: consume one batch.

    Returns a new :class:`~trainfold.TrainState`; the old one's counters and
    records are never changed. The model and optimizer behind both states are
    the same objects, updated in place (see the README's purity contract).
    """

    def __call__(self, state: TrainState, batch: Batch, /) -> TrainState: ...


#: ``transformer(step) -> step``: wraps a step to add behaviour (logging, a NaN
#: guard, EMA, a step limit). Its own state lives in ``state.extras[name]``.
StepTransformer = Callable[[Step], Step]


#: ``epoch_fn(state) -> state``: one unit of the outer loop (an epoch, an
#: evaluation, early stopping, a checkpoint). Must return a TrainState.
EpochFn = Callable[["TrainState"], "TrainState"]


#: ``predicate(state) -> bool``, for ``until`` and ``every``.
StatePredicate = Callable[["TrainState"], bool]
