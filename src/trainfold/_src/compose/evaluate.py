"""``evaluate``: the loss function (and its aux values) over a loader, exact over every process, as history records.

Every sample counts once, weighted by its batch's real samples (the padding
Accelerate adds to the last batch on several processes is left out); with
``normalize="tokens"``, by tokens. Run in eval mode, no gradients.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, overload

import attrs
import torch
from toolz import curry

from trainfold._src.backend.loaders import real_samples_in_batch
from trainfold._src.backend.mesh import data_layout
from trainfold._src.base.batch import batch_size, slice_batch
from trainfold._src.base.running_sums import RunningSums, weighted
from trainfold._src.base.types import Batch, LossFn
from trainfold._src.compose.loader_checks import check_every_sample, checked, empty_loader
from trainfold._src.core.context import Context
from trainfold._src.core.loss import compute_loss
from trainfold._src.core.modes import eval_mode
from trainfold._src.core.state import TrainState
from trainfold._src.core.step import normalize_mode
from trainfold._src.core.tokens import LOSS_WEIGHT, TOKENS
from trainfold._src.core.types import EpochFn
from trainfold._src.distributed.control import explaining_timeouts
from trainfold._src.distributed.interrupt import signal_name


@overload
def evaluate(
    ctx: Context,
    loss_fn: LossFn,
    loader: Iterable[Batch],
    *,
    prefix: str = ...,
    model: torch.nn.Module | Callable[[TrainState], torch.nn.Module] | None = ...,
    max_batches: int | None = ...,
    normalize: str = ...,
) -> EpochFn: ...


@overload
def evaluate(
    ctx: Context,
    loss_fn: LossFn,
    loader: Iterable[Batch],
    state: TrainState,
    *,
    prefix: str = ...,
    model: torch.nn.Module | Callable[[TrainState], torch.nn.Module] | None = ...,
    max_batches: int | None = ...,
    normalize: str = ...,
) -> TrainState: ...


@curry  # type: ignore[untyped-decorator]  # toolz ships no type hints
def evaluate(
    ctx: Context,
    loss_fn: LossFn,
    loader: Iterable[Batch],
    state: TrainState,
    *,
    prefix: str = "eval",
    model: torch.nn.Module | Callable[[TrainState], torch.nn.Module] | None = None,
    max_batches: int | None = None,
    normalize: str = "mean",
) -> TrainState:
    """Evaluate: the exact mean loss and aux metrics over every sample of ``loader``.

    Per batch, in eval mode under ``torch.no_grad()`` (the model's training
    mode is restored after; an optimizer with modes, schedule-free's, is put in
    eval mode too when ``state.model`` is evaluated, and back):

        n = real samples in the batch (padding of the last round excluded)
        loss, aux = loss_fn(model, batch[:n])
        sums += n * (loss, aux)                # on the device, in float64
        count += n
    then one reduction over processes: ``{prefix}_loss = sum / count``.

    A state from a ``run_epoch`` that stopped mid-epoch (``state.interrupted``)
    is passed through unevaluated. A signal that arrives during the evaluation
    (SIGINT, SIGTERM: the Context's) lets it finish and returns the state
    stopped, on every process.

    Every sample is counted once, however the last batch falls: under
    Accelerate's ``even_batches`` padding, each process drops its padded
    samples before calling ``loss_fn`` (a process whose whole last batch is
    padding still runs the model, so collective forwards stay matched, and
    weights it 0). The loss and aux values must be batch means.

    Args:
        ctx: the run's Context.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)`` (batch means).
        loader: a loader prepared with ``ctx.prepare_loaders`` (use ``shuffle=False``).
        state: the state to record into.
        prefix: the names' prefix: ``{prefix}_loss``, ``{prefix}_{aux name}``.
        model: evaluate this model instead of ``state.model``, or a function of the
            state that returns one (``model=ema_model`` for the :func:`~trainfold.ema` average).
        max_batches: stop after this many batches.
        normalize: ``"mean"`` (the default): the loss and aux values are batch means,
            weighted by samples. ``"tokens"``: the loss function is the one of
            ``make_step(normalize="tokens")``, returning the *sum* of the token losses and
            ``aux["tokens"]``; ``{prefix}_loss`` is then all token losses over all real
            tokens of the dataset (``exp`` of it is the perplexity).

    Returns:
        The state with the metrics appended to ``state.history`` (at the
        current epoch and step); nothing else changes.

    Raises:
        ValueError: the loader yields no batches or drops samples (``drop_last=True``); the state's
            objects were released; the loss is not a scalar (named).
        TypeError: an argument in another's place (a loader where the loss function goes...), or ``state`` is not a TrainState.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> state = evaluate(ctx, loss_fn, loader, state)
        >>> round(state.metrics["eval_loss"], 4)
        3.4648
    """
    state = checked("evaluate(ctx, loss_fn, loader, state)", ctx, "loss_fn", loss_fn, loader, state)
    check_every_sample("evaluate", loader)
    if state.interrupted:
        return state  # composed after a run_epoch that stopped mid-epoch: no epoch to evaluate
    by_tokens = normalize_mode(normalize, "evaluate") == "tokens"
    net = state.model if model is None else model if isinstance(model, torch.nn.Module) else model(state)
    acc = ctx.accelerator
    layout = data_layout(acc)
    precision = torch.float32 if acc.device.type == "mps" else torch.float64  # MPS has no float64
    sums = RunningSums.zero(acc.device, dtype=precision)
    count = 0
    batches = 0
    interrupt = ctx.runtime.interrupt
    with (
        explaining_timeouts(ctx.accelerator.num_processes),
        eval_mode(net, state.optimizer if net is state.model else None),
        ctx.runtime.in_phase("evaluation"),
    ):
        for batch in loader:
            batches += 1
            n = batch_size(batch)
            real = real_samples_in_batch(acc, layout, n)
            loss, aux = compute_loss(loss_fn, net, slice_batch(batch, real) if 0 < real < n else batch, need_grad=False)
            # A batch of padding only (real == 0) still ran the model, so collective forwards stay
            # matched, and adds zeros under the same names, so every process reduces the same shape.
            # A tensor-parallel group's processes add the same sums and counts: the means are the same ratios.
            recorded = {
                k: weighted(v, real, precision) for k, v in aux.items() if not (by_tokens and k == TOKENS)
            }  # a count: the loss's weight
            if by_tokens:  # the loss is a sum over the batch's tokens: a per-token mean weighted by them
                tokens = weighted(_tokens_of(aux), 1 if real else 0, precision)
                loss, recorded[LOSS_WEIGHT] = weighted(loss, 1 if real else 0, precision) / tokens.clamp(min=1), tokens
            else:
                loss = weighted(loss, real, precision)
            sums = sums.add(loss, recorded)
            count += real
            if batches == max_batches:
                break
    if batches == 0:
        raise empty_loader("evaluate", loader)
    values = {f"{prefix}_{k}": v for k, v in sums.means(acc, count).items()}
    state = attrs.evolve(state, history=state.history.add(epoch=state.epoch, step=state.step, values=values))
    signum = interrupt.agree_now()  # a signal during the evaluation: the run stops after it, on every process
    if signum:
        interrupt.clear()
        return state.with_stop(f"signal {signal_name(signum)}")
    return state


def _tokens_of(aux: Mapping[str, torch.Tensor]) -> torch.Tensor:
    tokens = aux.get(TOKENS)
    if tokens is None:
        raise ValueError(
            "evaluate(normalize='tokens') needs loss_fn to return (summed_loss, {'tokens': n}) with n the number of "
            "real (non-padding) tokens of the batch, as make_step(normalize='tokens') does."
        )
    return tokens
