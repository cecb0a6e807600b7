"""Batches as trainfold sees them: their structure (for errors), their sample count, and a slice of them.

trainfold never looks inside a batch otherwise. Owned here: :func:`describe_batch`,
:func:`batch_size`, :func:`slice_batch`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, cast

import torch

from trainfold._src.base.types import Batch


def describe_batch(batch: Batch, _depth: int = 0) -> str:
    """The structure of a batch: container types, tensor shapes and dtypes, never the data.

    Examples:
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
        return cast(Any, type(batch))({k: slice_batch(v, n) for k, v in batch.items()})  # its own mapping type
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(slice_batch(v, n) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, n) for v in batch)
    return batch


def like(template: Batch, value: Batch) -> Batch:
    """``value`` rebuilt with ``template``'s container types (namedtuples, dataclasses, ``Mapping`` subclasses).

    A checkpoint keeps a batch's values and plain structure; a resumed run gives
    the batch it read ahead its original types back from a batch of the same
    loader (the same ``collate_fn``), so a ``BatchEncoding`` stays a
    ``BatchEncoding`` and a namedtuple a namedtuple.

    Examples:
        >>> from collections import namedtuple
        >>> Pair = namedtuple("Pair", "x y")
        >>> like(Pair(torch.zeros(1), torch.zeros(1)), (torch.ones(1), torch.ones(1))).x
        tensor([1.])
    """
    if isinstance(template, tuple) and hasattr(template, "_fields") and isinstance(value, (tuple, list)):
        return type(template)(*(like(t, v) for t, v in zip(template, value)))
    if isinstance(template, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(template)(like(t, v) for t, v in zip(template, value))
    if dataclasses.is_dataclass(template) and not isinstance(template, type) and isinstance(value, Mapping):
        return dataclasses.replace(template, **{k: like(getattr(template, k), v) for k, v in value.items()})
    if isinstance(template, Mapping) and isinstance(value, Mapping):
        items = {k: like(template[k], v) if k in template else v for k, v in value.items()}
        if type(template) is dict:
            return items
        try:
            return cast(Any, type(template))(items)  # its own mapping type
        except TypeError:
            return items
    return value
