"""Token-count-correct gradient accumulation: the stage behind ``make_step(normalize="tokens")``.

Owned here: :func:`normalize_tokens` and its running count of the accumulation
group's tokens, ``state.extras["tokens"]`` (a 0-d tensor on the device).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

import attrs
import torch

from trainfold._src.backend.engine import owns_clipping
from trainfold._src.base.running_sums import WEIGHT
from trainfold._src.core.stages import MicroBatch, Stage

if TYPE_CHECKING:
    from trainfold._src.core.context import Context

#: The aux name a loss function reports its real tokens under, and the extras name of the group's count.
TOKENS = "tokens"
#: The aux name that weights the recorded loss by the batch's tokens.
LOSS_WEIGHT = "loss" + WEIGHT


@attrs.frozen
class _NormalizeTokens:
    def bind(self, ctx: Context) -> Stage:
        accelerator = ctx.accelerator
        if owns_clipping(accelerator):
            raise ValueError("normalize='tokens' is not supported under DeepSpeed, which scales gradients itself.")
        factor = float(ctx.gradient_accumulation_steps * accelerator.num_processes)  # sync: none: host ints
        several = accelerator.num_processes > 1

        def count(mb: MicroBatch) -> None:
            tokens = mb.aux.get(TOKENS) if hasattr(mb.aux, "get") else None
            if tokens is None:
                raise ValueError(
                    "make_step(normalize='tokens') needs loss_fn to return (summed_loss, {'tokens': n}) with n the "
                    "number of real (non-padding) tokens of the batch, e.g. (labels != -100).sum()."
                )
            group = mb.extras.get(TOKENS)
            tokens = tokens.detach().float()  # sync: none: a cast on the device
            mb.extras = MappingProxyType({**mb.extras, TOKENS: tokens if group is None else group + tokens})
            mb.loss = mb.loss.detach() / tokens.clamp(min=1)  # the per-token mean, recorded weighted by the tokens:
            # train_loss is then (all token losses) / (all tokens); the count is the loss's weight, not a metric of its own
            mb.aux = {**{k: v for k, v in mb.aux.items() if k != TOKENS}, LOSS_WEIGHT: tokens}

        def scale(mb: MicroBatch) -> None:
            group = mb.extras[TOKENS]
            total = accelerator.reduce(group, reduction="sum") if several else group
            grads = [p.grad for p in mb.model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor / total)
            mb.extras = MappingProxyType({k: v for k, v in mb.extras.items() if k != TOKENS})

        return Stage("normalize_tokens", on_batch=count, on_update=scale)


def normalize_tokens() -> _NormalizeTokens:
    """A stage for sequence models whose batches hold different numbers of real (non-padding) tokens.

    ``loss_fn`` returns the **sum** of the token losses and ``aux["tokens"]``,
    the number of real tokens. Per micro-batch the stage adds the count to the
    group's, kept on the device in ``state.extras["tokens"]``. On the
    micro-batch that updates, it sums the count over processes (one all-reduce)
    and scales the gradients by ``accumulation_steps * num_processes /
    total_tokens``: Accelerate divided each summed loss by the accumulation
    steps and DDP averaged over processes, so the result is the gradient of
    (sum of all token losses) / (all tokens), what one big batch would give. The
    recorded loss (``state.last_loss``) is the micro-batch's per-token mean, and
    ``train_loss`` (like ``log_every``'s ``train/loss``) is weighted by tokens: all
    token losses over all tokens, so ``exp(train_loss)`` is the perplexity. It runs before clipping:
    ``make_step(normalize="tokens")`` puts it first.

    Returns:
        A stage spec; ``make_step(ctx, loss_fn, normalize="tokens")`` puts it first.

    Raises:
        ValueError: under DeepSpeed (when ``make_step`` binds it), which scales gradients itself;
            (when a step runs) ``loss_fn`` returned no ``aux["tokens"]``.

    Examples:
        >>> from trainfold import testing
        >>> ctx, state, loader, _ = testing.tiny_setup(seed=0)
        >>> def summed(model, batch):
        ...     x, y = batch
        ...     return ((model(x) - y) ** 2).sum(), {"tokens": torch.tensor(float(len(x)))}
        >>> state = run_epoch(ctx, make_step(ctx, summed, normalize="tokens"), loader, state)
        >>> state.step
        4
    """
    return _NormalizeTokens()
