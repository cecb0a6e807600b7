"""``predict``: a model's outputs over a loader, gathered exactly from every process, in the loader's order,
without the padding of the last batch (``evaluate_metrics``, in ``metrics.py``, feeds them to metric objects).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, cast, overload

import torch
from toolz import curry

from trainfold._src.backend.mesh import data_layout, gather_for_metrics
from trainfold._src.base.batch import describe_batch
from trainfold._src.base.checks import add_note
from trainfold._src.base.types import Batch
from trainfold._src.compose.loader_checks import check_every_sample, checked, empty_loader
from trainfold._src.core.context import Context
from trainfold._src.core.modes import eval_mode
from trainfold._src.core.state import TrainState


@overload
def predict(
    ctx: Context, fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch]
) -> Callable[[TrainState], Any]: ...


@overload
def predict(
    ctx: Context, fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch], state: TrainState
) -> Any: ...


@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def predict(
    ctx: Context, fn: Callable[[torch.nn.Module, Batch], Any], loader: Iterable[Batch], state: TrainState
) -> Any:
    """Run ``fn(model, batch)`` over ``loader`` and return the outputs for every sample, in order.

    In eval mode under ``torch.no_grad()``. Outputs are gathered from every
    process with ``accelerator.gather_for_metrics`` (the padding of the last
    round dropped) and concatenated along the first dimension, so on every
    process the result has exactly one row per sample of the dataset, in the
    loader's order (use ``shuffle=False``).

    Args:
        ctx: the run's Context.
        fn: ``fn(model, batch)`` returning a tensor with a leading batch dimension,
            or a tuple/list/dict of such tensors.
        loader: a prepared loader.
        state: the state whose model predicts.

    Returns:
        The concatenated outputs, of the structure ``fn`` returns (on the device).

    Raises:
        ValueError: the loader yields no batches or drops samples (``drop_last=True``); the state's objects were released.
        TypeError: an argument in another's place, or ``state`` is not a TrainState.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, _ = testing.tiny_setup(seed=0)
        >>> predict(ctx, lambda m, b: m(b[0]), loader, state).shape
        torch.Size([16, 1])
    """
    state = checked("predict(ctx, fn, loader, state)", ctx, "fn", fn, loader, state)
    check_every_sample("predict", loader)
    acc = ctx.accelerator
    layout = data_layout(acc)
    outputs = []
    with eval_mode(state.model, state.optimizer):
        for batch in loader:
            try:
                out = fn(state.model, batch)
            except Exception as exc:
                add_note(exc, f"trainfold: raised by predict's fn on a batch of structure {describe_batch(batch)}")
                raise
            outputs.append(gather_for_metrics(acc, layout, out))
    if not outputs:
        raise empty_loader("predict", loader)
    return _concat(outputs)


def _concat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([p.reshape(1) if p.ndim == 0 else p for p in parts])
    if isinstance(first, Mapping):
        return cast(Any, type(first))({k: _concat([p[k] for p in parts]) for k in first})  # its own mapping type
    if isinstance(first, (list, tuple)):
        return type(first)(_concat(list(items)) for items in zip(*parts))
    raise TypeError(
        f"predict's fn must return tensors (or a tuple/list/dict of them); it returned a {type(first).__name__}."
    )
