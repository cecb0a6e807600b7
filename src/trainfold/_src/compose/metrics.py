"""``evaluate_metrics``: metric objects (torchmetrics, Hugging Face ``evaluate``) fed a model's outputs over a loader,
gathered exactly from every process, and what they compute recorded.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, overload

import attrs
import torch
from toolz import curry

from trainfold._src.backend.mesh import data_layout, gather_for_metrics
from trainfold._src.base.batch import batch_size, describe_batch
from trainfold._src.base.checks import add_note
from trainfold._src.base.types import Batch
from trainfold._src.compose.loader_checks import check_every_sample, check_per_sample, checked, empty_loader
from trainfold._src.core.context import Context
from trainfold._src.core.modes import eval_mode
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import EpochFn
from trainfold._src.distributed.control import explaining_timeouts


@overload
def evaluate_metrics(
    ctx: Context,
    metrics: Mapping[str, Any],
    fn: Callable[[torch.nn.Module, Batch], Any],
    loader: Iterable[Batch],
    *,
    prefix: str = ...,
) -> EpochFn: ...


@overload
def evaluate_metrics(
    ctx: Context,
    metrics: Mapping[str, Any],
    fn: Callable[[torch.nn.Module, Batch], Any],
    loader: Iterable[Batch],
    state: TrainState,
    *,
    prefix: str = ...,
) -> TrainState: ...


@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def evaluate_metrics(
    ctx: Context,
    metrics: Mapping[str, Any],
    fn: Callable[[torch.nn.Module, Batch], Any],
    loader: Iterable[Batch],
    state: TrainState,
    *,
    prefix: str = "eval",
) -> TrainState:
    """Metrics that are not batch means (F1, AUROC, BLEU...): update metric objects over ``loader`` and record their values.

    A metric is a torchmetrics ``Metric``, any object with ``update(...)``,
    ``compute()`` and ``reset()``, or a Hugging Face ``evaluate`` metric (what
    Accelerate's examples use: ``add_batch(predictions=..., references=...)`` and
    ``compute()``, which resets it). For each batch ``fn(model, batch)`` returns
    the arguments of ``update``: a tuple (``(preds, target)``) or one tensor.
    They are gathered from every process with ``gather_for_metrics`` (the
    padding of the last round dropped), and every process updates its metrics
    with all of them: each process computes each metric over every sample of the
    dataset exactly once, and a torchmetrics metric's own sync is turned off for
    the ``compute`` (its inputs are already everyone's). Each value is recorded
    in the history as ``<prefix>_<name>`` (a float), or, when ``compute`` returns a
    dict (``evaluate``'s ``{"accuracy": ..., "f1": ...}``, a ``MetricCollection``), one
    record per key, ``<prefix>_<key>``; then the metric is reset.
    In eval mode under ``torch.no_grad()``; a state stopped in the middle of an
    epoch is passed through, as by :func:`~trainfold.evaluate`.

    Args:
        ctx: the run's Context.
        metrics: the metric objects, by name.
        fn: ``fn(model, batch)`` returning the arguments of ``update``: tensors whose first
            dimension is the batch's samples (per-token outputs as ``(batch, tokens)``, not
            flattened), or non-tensor values.
        loader: a prepared loader.
        state: the state whose model is evaluated.
        prefix: the records' prefix.

    Returns:
        The state with the values appended to ``state.history``.

    Raises:
        TypeError: a metric without ``update``, ``compute`` and ``reset``, or one whose
            ``compute`` returns more than one number.
        ValueError: an output tensor whose first dimension is not the batch's samples; a
            loader that drops samples (``drop_last=True``).

    Examples:
        >>> from trainfold import testing
        >>> class MaxError:  # any object with update, compute and reset
        ...     def __init__(self): self.worst = 0.0
        ...     def update(self, preds, target): self.worst = max(self.worst, (preds - target).abs().max().item())
        ...     def compute(self): return self.worst
        ...     def reset(self): self.worst = 0.0
        >>> ctx, state, loader, _ = testing.tiny_setup(seed=0)
        >>> state = evaluate_metrics(ctx, {"max_error": MaxError()}, lambda m, b: (m(b[0]), b[1]), loader, state)
        >>> round(state.metrics["eval_max_error"], 4)
        3.5974
    """
    state = checked("evaluate_metrics(ctx, metrics, fn, loader, state)", ctx, "fn", fn, loader, state)
    for name, metric in metrics.items():
        if not (_has(metric, "update", "compute", "reset") or _has(metric, "add_batch", "compute")):
            raise TypeError(
                f"evaluate_metrics: metric {name!r} is a {type(metric).__name__}, which has neither update, compute and reset "
                "(torchmetrics) nor add_batch and compute (Hugging Face evaluate)."
            )
    check_every_sample("evaluate_metrics", loader)
    if state.interrupted:
        return state
    acc = ctx.accelerator
    layout = data_layout(acc)
    batches = 0
    with explaining_timeouts(ctx.accelerator.num_processes), eval_mode(state.model, state.optimizer):
        for batch in loader:
            batches += 1
            try:
                args = fn(state.model, batch)
            except Exception as exc:
                add_note(
                    exc, f"trainfold: raised by evaluate_metrics' fn on a batch of structure {describe_batch(batch)}"
                )
                raise
            args = args if isinstance(args, tuple) else (args,)
            check_per_sample("evaluate_metrics", args, batch_size(batch), batch)
            args = gather_for_metrics(acc, layout, args)
            for name, metric in metrics.items():
                _feed(name, metric, args)
    if batches == 0:
        raise empty_loader("evaluate_metrics", loader)
    values: dict[str, float] = {}
    for name, metric in metrics.items():
        computed = _computed(name, metric)
        named_values = (
            {f"{prefix}_{name}": computed}
            if isinstance(computed, float)
            else {f"{prefix}_{k}": v for k, v in computed.items()}
        )
        clash = sorted(values.keys() & named_values.keys())
        if clash:
            raise ValueError(
                f"evaluate_metrics: two metrics record {clash[0]!r}; give them other names (a dict result's keys name its records)."
            )
        values.update(named_values)
    return attrs.evolve(state, history=state.history.add(epoch=state.epoch, step=state.step, values=values))


def _has(metric: Any, *methods: str) -> bool:
    return all(callable(getattr(metric, m, None)) for m in methods)


def _feed(name: str, metric: Any, args: tuple[Any, ...]) -> None:
    """``metric.update(*args)`` (torchmetrics and the like), or Hugging Face evaluate's ``add_batch(predictions=, references=)``."""
    if _has(metric, "update"):
        metric.update(*args)
        return
    if len(args) != 2:
        raise TypeError(
            f"evaluate_metrics: metric {name!r} takes add_batch(predictions=..., references=...): fn must return (predictions, references), not {len(args)} values."
        )
    metric.add_batch(predictions=args[0], references=args[1])


def _computed(name: str, metric: Any) -> float | dict[str, float]:
    """``metric.compute()`` as a float (or a dict of them, by name), without a torchmetrics metric syncing inputs every process already holds; then reset.

    torchmetrics decides whether ``compute`` syncs from ``_to_sync``, set from
    ``sync_on_compute`` when the metric is built and after each ``forward``
    (``update`` alone leaves it): both are turned off for the call and put back.
    A test counts the samples a metric saw on 2 processes, so a torchmetrics that
    decides otherwise fails it (100 samples instead of 50) rather than passing silently.
    """
    saved = {
        a: getattr(metric, a) for a in ("sync_on_compute", "_to_sync") if isinstance(getattr(metric, a, None), bool)
    }
    for attribute in saved:
        setattr(metric, attribute, False)
    try:
        value = metric.compute()
    finally:
        for attribute, flag in saved.items():
            setattr(metric, attribute, flag)
    if _has(metric, "reset"):  # Hugging Face evaluate's compute() empties the metric itself
        metric.reset()
    if isinstance(value, Mapping):  # Hugging Face evaluate, a torchmetrics MetricCollection: one record per key
        return {str(k): _number(f"{name!r}[{k!r}]", v) for k, v in value.items()}
    return _number(repr(name), value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"evaluate_metrics: metric {name} computed a tensor of shape {tuple(value.shape)}; the history holds numbers (average it, e.g. average='macro')."
            )
        return float(value)  # sync: once per metric per evaluation
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"evaluate_metrics: metric {name} computed a {type(value).__name__}, not a number.")
    return float(value)  # sync: none: a Python number
