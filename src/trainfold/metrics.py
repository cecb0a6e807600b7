"""On-device running sums, their one reduction per epoch, and the checks on what a loss_fn returns."""

from __future__ import annotations

import zlib
from types import MappingProxyType
from typing import Any, Mapping

import torch
from accelerate import Accelerator

from ._guard import NONFINITE
from ._types import Batch

_NO_AUX: Mapping[str, torch.Tensor] = MappingProxyType({})


def describe_batch(batch: Batch, _depth: int = 0) -> str:
    """The structure of a batch: container types, tensor shapes and dtypes, never the data.

    Example:
        >>> describe_batch((torch.zeros(2, 3), {"y": torch.zeros(2, dtype=torch.long)}))
        'tuple(Tensor[2, 3] float32, dict(y=Tensor[2] int64))'
    """
    if _depth > 4:
        return "..."
    if isinstance(batch, torch.Tensor):
        shape = ", ".join(str(s) for s in batch.shape)
        return f"Tensor[{shape}] {str(batch.dtype).removeprefix('torch.')}"
    if isinstance(batch, Mapping):
        items = list(batch.items())
        inner = ", ".join(f"{k}={describe_batch(v, _depth + 1)}" for k, v in items[:8])
        more = ", ..." if len(items) > 8 else ""
        return f"{type(batch).__name__}({inner}{more})"
    if isinstance(batch, (list, tuple)):
        inner = ", ".join(describe_batch(v, _depth + 1) for v in batch[:8])
        more = f", ... ({len(batch)} items)" if len(batch) > 8 else ""
        return f"{type(batch).__name__}({inner}{more})"
    return type(batch).__name__


def batch_size(batch: Batch) -> int:
    """The number of samples in a batch: the first dimension of its first tensor.

    Raises:
        TypeError: the batch holds no tensor with a first dimension.
    """
    if isinstance(batch, torch.Tensor) and batch.ndim > 0:
        return int(batch.shape[0])
    children = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for child in children:
        try:
            return batch_size(child)
        except TypeError:
            continue
    raise TypeError(
        f"cannot count the samples of a batch of structure {describe_batch(batch)}: "
        "it holds no tensor with a batch dimension. Make the loader yield tensors "
        "(a tuple, list or dict of them), with the samples along the first dimension."
    )


def slice_batch(batch: Batch, n: int) -> Batch:
    """The first ``n`` samples of a batch (tensors with a first dimension are sliced)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n] if batch.ndim > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, n) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, n) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, n) for v in batch)
    return batch


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
    if not (loss.dtype.is_floating_point or loss.dtype.is_complex):
        raise TypeError(
            f"loss_fn returned a loss of dtype {loss.dtype}; an integer tensor has no gradient: "
            "compute the loss in floating point (for example .float() the predictions, not the loss)."
        )
    if need_grad and not loss.requires_grad:
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


def add_to_sums(
    sums: Mapping[str, torch.Tensor], aux: Mapping[str, torch.Tensor], weight: float = 1.0
) -> Mapping[str, torch.Tensor]:
    """Add ``aux`` (times ``weight``) to the running ``sums``, on the device; returns new sums.

    The first batch of an epoch fixes the names; a batch with other names is an error.
    """
    if not aux:
        if sums:
            raise ValueError(_aux_names_changed(sums, aux))
        return sums
    if not sums:
        return MappingProxyType({k: weighted(v, weight) for k, v in aux.items()})
    if aux.keys() != sums.keys():
        raise ValueError(_aux_names_changed(sums, aux))
    if weight == 1.0:
        return MappingProxyType({k: plus(sums[k], v) for k, v in aux.items()})
    return MappingProxyType({k: sums[k] + weighted(v, weight) for k, v in aux.items()})


#: dtypes that a float32 sum adds as float32, converting them inside the addition kernel
_PROMOTED_TO_FLOAT32 = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                  torch.float16, torch.bfloat16, torch.float32})


def plus(total: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``total + value.detach().float()`` for a float32 ``total``, in one kernel where type promotion allows.

    The addition converts ``value`` to float32 itself (the same numbers as
    ``.float()`` first); only a float64 or complex value is converted apart.
    """
    if value.requires_grad:
        value = value.detach()
    return total + (value if value.dtype in _PROMOTED_TO_FLOAT32 else value.float())


def weighted(value: torch.Tensor, weight: float) -> torch.Tensor:
    value = as_float32(value)
    if weight == 0:
        return torch.zeros_like(value)  # not value * 0, which is nan for an infinite value
    return value if weight == 1.0 else value * weight


def as_float32(value: torch.Tensor) -> torch.Tensor:
    """``value.detach().float()``, skipping each call that has nothing to do (this runs per micro-batch)."""
    if value.requires_grad:
        value = value.detach()
    return value if value.dtype is torch.float32 else value.float()


def _aux_names_changed(sums: Mapping[str, Any], aux: Mapping[str, Any]) -> str:
    return (
        f"loss_fn returned aux names {sorted(aux)} but earlier batches of this epoch returned "
        f"{sorted(sums)}: return the same names for every batch (use a zero tensor for a "
        "term that is absent)."
    )


def reduce_means(
    accelerator: Accelerator, sums: Mapping[str, torch.Tensor], count: torch.Tensor | int
) -> dict[str, float]:
    """Sum ``sums`` and ``count`` over processes and return the means as Python floats.

    One stacked tensor, one all-reduce, one host transfer: call this once per
    epoch or log interval, never per step.
    """
    names = list(sums)
    local = torch.stack([sums[n].float() for n in names] + [torch.as_tensor(count, dtype=torch.float32, device=accelerator.device)])
    if accelerator.num_processes > 1:
        _check_same_names(accelerator, names)
        local = accelerator.reduce(local, reduction="sum")
    values = local.tolist()  # sync: once per epoch / log interval
    n = values[-1]
    return {name: (v / n if n else float("nan")) for name, v in zip(names, values)}


def _check_same_names(accelerator: Accelerator, names: list[str]) -> None:
    """Refuse to all-reduce sums that differ between processes: gloo and NCCL would hang or mix them."""
    key = torch.tensor([len(names), zlib.crc32(",".join(names).encode())], dtype=torch.int64, device=accelerator.device)
    keys = accelerator.gather(key).view(-1, 2).tolist()  # sync: once per epoch / log interval
    if any(k != keys[0] for k in keys):
        raise RuntimeError(
            f"process {accelerator.process_index} has metrics {names}, but not every process has the "
            "same names: the loss_fn must return the same aux names on every process and batch."
        )


def finite_loss_mean(means: dict[str, float], nonfinite: str = NONFINITE) -> dict[str, float]:
    """Under ``nan_guard`` a non-finite loss adds 0 to the sum: rescale the mean to the finite batches."""
    if nonfinite in means and "loss" in means:
        finite_share = 1.0 - means[nonfinite]
        means = {**means, "loss": means["loss"] / finite_share if finite_share > 0 else float("nan")}
    return means
