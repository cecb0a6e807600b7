"""The types trainfold is built from, named once, each with its contract.

Every public function is typed in terms of these names. They are aliases and
protocols, and :func:`read_only`, the converter of frozen classes' mapping
fields; importing this module does nothing.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Union

import torch

if TYPE_CHECKING:
    pass


def read_only(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A read-only copy of ``mapping`` (empty for None): what a frozen class keeps of a mapping it is given."""
    return MappingProxyType(dict(mapping or {}))


Batch = Any
"""A batch is whatever the loader yields: a tensor, or a tuple, list or mapping of tensors (nested).
trainfold never looks inside one except to count its samples (the first dimension of its first
tensor) and to describe it in errors.
"""


LossOutput = Union[torch.Tensor, "tuple[torch.Tensor, Mapping[str, torch.Tensor]]"]
"""What a loss function returns: a 0-d floating tensor, or that and a mapping of named 0-d tensors
(batch means, like the loss) to average alongside it.
"""


class LossFn(Protocol):
    """``loss_fn(model, batch) -> loss | (loss, aux)``.

    ``loss`` is the mean over the batch's samples, a 0-d floating tensor with a
    gradient; ``aux`` maps names to 0-d tensors that are also batch means
    (accuracy, a second loss term). trainfold averages both over an epoch,
    weighting by samples in ``evaluate``. The function must not step the
    optimizer or call ``backward``: the step does that.

    Examples:
        >>> def loss_fn(model, batch):
        ...     x, y = batch
        ...     logits = model(x)
        ...     accuracy = (logits.argmax(-1) == y).float().mean()
        ...     return torch.nn.functional.cross_entropy(logits, y), {"accuracy": accuracy}
        >>> model = torch.nn.Linear(3, 2)
        >>> loss, aux = loss_fn(model, (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)))
        >>> loss.ndim, sorted(aux)
        (0, ['accuracy'])
    """

    def __call__(self, model: torch.nn.Module, batch: Batch, /) -> LossOutput: ...
