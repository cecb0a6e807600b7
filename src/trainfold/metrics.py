"""On-device running sums, their one reduction per epoch, and the checks on what a loss_fn returns."""

from __future__ import annotations

import zlib
from types import MappingProxyType
from typing import Any, Iterable, Mapping

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


#: A micro-batch's ``(loss, aux)``, detached, waiting in ``TrainState.unsummed`` to be summed.
Entry = tuple[torch.Tensor, Mapping[str, torch.Tensor]]

#: How many micro-batches a state holds before a step adds them to its sums.
FOLD_EVERY = 64


def detached(loss: torch.Tensor, aux: Mapping[str, torch.Tensor]) -> Entry:
    """``(loss, aux)`` without their autograd graphs, which an entry must not keep alive (activations)."""
    if loss.requires_grad:
        loss = loss.detach()
    if any(v.requires_grad for v in aux.values()):
        aux = MappingProxyType({k: v.detach() for k, v in aux.items()})
    return loss, aux


def check_same_names(sums: Mapping[str, torch.Tensor], unsummed: tuple[Entry, ...], aux: Mapping[str, Any]) -> None:
    """Raise if a micro-batch's aux names differ from the epoch's earlier ones (a dict-keys comparison)."""
    if unsummed:
        earlier = unsummed[-1][1].keys()
    elif sums:
        earlier = sums.keys() - {NONFINITE} if NONFINITE in sums else sums.keys()
    else:
        return
    if aux.keys() != earlier:
        raise ValueError(_aux_names_changed(earlier, aux))


def fold(
    loss_sum: torch.Tensor | None,
    aux_sums: Mapping[str, torch.Tensor],
    unsummed: tuple[Entry, ...],
    *,
    mask_nonfinite: bool,
) -> tuple[torch.Tensor | None, Mapping[str, torch.Tensor]]:
    """Add the micro-batches waiting in ``unsummed`` to the running sums: one stack and one sum per name.

    Sums are float32 whatever the values' dtypes (bool, int, half, double). With
    ``mask_nonfinite`` (under ``nan_guard``), a non-finite loss adds 0 to the loss
    sum and 1 to ``aux_sums["nonfinite"]``. No host sync.
    """
    if not unsummed:
        return loss_sum, aux_sums
    losses = torch.stack([loss for loss, _ in unsummed])
    new: dict[str, torch.Tensor] = {}
    if mask_nonfinite:
        masked = losses.nan_to_num(0.0, 0.0, 0.0)  # nan, +inf, -inf
        new[NONFINITE] = losses.ne(masked).sum(dtype=torch.float32)
        losses = masked
    total = losses.sum(dtype=torch.float32)
    loss_sum = total if loss_sum is None else loss_sum + total
    for name in unsummed[0][1]:
        new[name] = torch.stack([aux[name] for _, aux in unsummed]).sum(dtype=torch.float32)
    # the names were checked per micro-batch (check_same_names); "nonfinite" is there only under nan_guard
    merged = dict(aux_sums)
    for name, value in new.items():
        merged[name] = merged[name] + value if name in merged else value
    return loss_sum, MappingProxyType(merged)


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
    return MappingProxyType({k: sums[k] + weighted(v, weight) for k, v in aux.items()})


def weighted(value: torch.Tensor, weight: float) -> torch.Tensor:
    value = as_float32(value)
    if weight == 0:
        return torch.zeros_like(value)  # not value * 0, which is nan for an infinite value
    return value if weight == 1.0 else value * weight


def as_float32(value: torch.Tensor) -> torch.Tensor:
    """``value.detach().float()``, skipping each call that has nothing to do (this runs per batch)."""
    if value.requires_grad:
        value = value.detach()
    return value if value.dtype is torch.float32 else value.float()


def _aux_names_changed(earlier: Iterable[str], aux: Iterable[str]) -> str:
    return (
        f"loss_fn returned aux names {sorted(aux)} but earlier batches of this epoch returned "
        f"{sorted(earlier)}: return the same names for every batch (use a zero tensor for a "
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
