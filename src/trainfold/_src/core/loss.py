"""What a ``loss_fn`` returns, checked: the call of the loss function and the validation of its output.

Owned here: :func:`compute_loss` (the first stage of every step, evaluation and
prediction) and :func:`split_loss_output`. Only metadata is read (type, shape,
dtype, requires_grad): no host sync.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import torch

from trainfold._src.base.batch import describe_batch
from trainfold._src.base.checks import add_note
from trainfold._src.base.types import Batch, LossFn

_NO_AUX: Mapping[str, torch.Tensor] = MappingProxyType({})


def compute_loss(
    loss_fn: LossFn, model: torch.nn.Module, batch: Batch, *, need_grad: bool = True
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """Call ``loss_fn(model, batch)`` and check what it returned.

    An exception from ``loss_fn`` is re-raised unchanged, with a note that shows
    the batch's structure (types, shapes, dtypes; never the data).
    """
    try:
        out = loss_fn(model, batch)
    except Exception as exc:
        add_note(
            exc,
            f"trainfold: raised by loss_fn, which trainfold calls as loss_fn(model, batch): the model first (here a "
            f"{type(model).__name__}), then a batch of structure {describe_batch(batch)}",
        )
        raise
    return split_loss_output(out, need_grad=need_grad)


def split_loss_output(out: Any, *, need_grad: bool) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """Check what a loss_fn returned and split it into ``(loss, aux)``.

    Only metadata is read (type, shape, dtype, requires_grad): no host sync.

    Raises:
        TypeError: not a tensor or ``(tensor, mapping)``; an integer loss.
        ValueError: a loss that is not 0-d, or that has no gradient when one is needed.
    """
    if isinstance(out, torch.Tensor):
        loss, aux = out, _NO_AUX
    elif isinstance(out, (int, float)):
        raise TypeError(
            f"loss_fn returned a loss that is a {type(out).__name__}, not a tensor: return the torch "
            "tensor itself (not loss.item() or a Python number), so it can be backpropagated."
        )
    elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        loss, aux = out
    else:
        raise TypeError(
            "loss_fn must return a 0-d loss tensor or a (loss, aux) pair with aux a mapping of "
            f"names to 0-d tensors; it returned a {_describe_value(out)}."
        )
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn returned a loss that is a {type(loss).__name__}, not a tensor: return the "
            "torch tensor itself (not loss.item() or a Python number), so it can be backpropagated."
        )
    if loss.ndim != 0:
        raise ValueError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)}; it must be a 0-d tensor, the mean "
            "over the batch: reduce it (loss.mean()) or use reduction='mean' in the loss function."
        )
    # a tensor that requires grad is floating or complex: the common case reads one flag
    if not (need_grad and loss.requires_grad):
        if not (loss.dtype.is_floating_point or loss.dtype.is_complex):
            raise TypeError(
                f"loss_fn returned a loss of dtype {loss.dtype}; an integer tensor has no gradient: "
                "compute the loss in floating point (for example .float() the predictions, not the loss)."
            )
        if need_grad:
            raise ValueError(
                "loss_fn returned a loss with no gradient (requires_grad=False): it was computed under "
                "torch.no_grad(), detached, or from a model with no trainable parameters. Compute it "
                "from model(...) inside loss_fn."
            )
    for name, value in aux.items():
        if not isinstance(value, torch.Tensor) or value.ndim != 0:
            raise TypeError(
                f"loss_fn returned aux[{name!r}] as a {_describe_value(value)}; aux values must be "
                "0-d tensors (batch means), kept on the device. Use .mean() for per-sample values."
            )
    return loss, aux


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)} items ({describe_batch(value)})"
    return type(value).__name__
