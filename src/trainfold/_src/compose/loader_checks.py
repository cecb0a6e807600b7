"""What every loop over a loader (``run_epoch``, ``evaluate``, ``predict``, ``evaluate_metrics``) checks alike: its
arguments, a loader that yields nothing, a loader each process reads whole.
"""

from __future__ import annotations

from typing import Any

import torch

from trainfold._src.backend.loaders import dropped_samples
from trainfold._src.base.batch import describe_batch
from trainfold._src.base.checks import length_or_none
from trainfold._src.core.checks import expect_args, expect_owned, expect_shared_out, expect_state
from trainfold._src.core.state import TrainState


def empty_loader(where: str, loader: Any) -> ValueError:
    return ValueError(
        f"{where}: the loader yielded no batches ({type(loader).__name__} over a dataset of "
        f"{_len_or_unknown(getattr(loader, 'dataset', None))} samples). Check the dataset is not empty "
        "and that batch_size is not larger than the dataset with drop_last=True."
    )


def _len_or_unknown(x: Any) -> str:
    n = length_or_none(x)
    return "an unknown number of" if n is None else str(n)


def checked(signature: str, ctx: Any, fn_name: str, fn: Any, loader: Any, state: Any) -> TrainState:
    """What every loop over a loader checks first, once per call: the arguments' places, the state and
    its Context, a loader each process reads its share of, and Accelerate's settings unchanged."""
    where = signature.split("(", 1)[0]
    expect_args(where, signature, ctx, fn_name, fn, loader)
    checked = expect_owned(where, ctx, expect_state(where, state))
    expect_shared_out(where, ctx, loader)
    ctx.check()
    if checked.model is not None and ctx.runtime.is_released(checked.model):
        raise ValueError(
            f"{where}: this state's objects were given back with ctx.release(state): the Accelerator no longer knows its model "
            "and optimizer. Train a new state (TrainState.create), or load a checkpoint of this one into a new state."
        )
    return checked


def check_every_sample(where: str, loader: Any) -> None:
    """Refuse a loader that drops samples (``drop_last=True``): evaluating promises every sample exactly once."""
    dropped = dropped_samples(loader)
    if dropped:
        total = length_or_none(getattr(getattr(loader, "base_dataloader", loader), "dataset", None))
        raise ValueError(
            f"{where}: the loader drops the last {dropped} of {total} samples every epoch (drop_last=True), so the result would "
            f"not be over the whole dataset. Build the evaluation loader with drop_last=False: trainfold counts each sample "
            "once whatever the last batch's size (Accelerate's padding included)."
        )


def check_per_sample(name: str, args: tuple[Any, ...], samples: int, batch: Any) -> None:
    """Refuse outputs whose first dimension is not the batch's samples: the padding of the last round is dropped by sample."""
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor) and (value.ndim == 0 or value.shape[0] != samples):
            shape = tuple(value.shape)
            raise ValueError(
                f"{name}: fn returned, as argument {i} of update, a tensor of shape {shape} for a batch of {samples} samples "
                f"({describe_batch(batch)}): each output must have the batch's samples as its first dimension, so that the "
                "padding Accelerate adds to the last round is dropped by sample (a flattened (batch*tokens,) tensor would be cut "
                "to the sample count). Return per-sample tensors, such as (batch, tokens) predictions and targets, and flatten "
                "or mask them inside the metric."
            )
