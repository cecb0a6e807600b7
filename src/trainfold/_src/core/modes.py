"""Train and eval modes: the model's, and an optimizer's where it has them (schedule-free optimizers).

Owned here: when trainfold switches modes. ``run_epoch`` puts the model and
the optimizer in train mode; ``evaluate``, ``evaluate_metrics``, ``predict``,
``save_checkpoint`` and ``save_best`` put both in eval mode for their work and
back afterwards, as ``schedulefree``'s documentation asks (``optimizer.eval()``
before evaluating and saving, ``optimizer.train()`` before training). An
optimizer has modes when the torch optimizer inside Accelerate's wrapper has
callable ``train`` and ``eval`` methods; torch's own optimizers have none, and
then nothing here touches them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from trainfold._src.backend.optim import inner_optimizer


def optimizer_modes(optimizer: Any) -> Any:
    """The optimizer whose ``train()`` / ``eval()`` switch its modes, or None if it has none."""
    if optimizer is None:
        return None
    inner = inner_optimizer(optimizer)
    return inner if callable(getattr(inner, "train", None)) and callable(getattr(inner, "eval", None)) else None


def train_mode(model: torch.nn.Module, optimizer: Any) -> None:
    """Put the model, and the optimizer if it has modes, in train mode (once per epoch)."""
    model.train()
    modes = optimizer_modes(optimizer)
    if modes is not None:
        modes.train()


@contextmanager
def eval_mode(model: torch.nn.Module, optimizer: Any = None, *, no_grad: bool = True) -> Iterator[None]:
    """The model in eval mode (under ``torch.no_grad()`` unless told), and the optimizer too if it has modes.

    Both are put back afterwards: the model to the mode it had, the optimizer to
    train mode if the model was training (a schedule-free optimizer's mode follows
    the model's: ``run_epoch`` sets both). Pass the optimizer only when ``model``
    is the one it trains (not an EMA copy).
    """
    was_training = model.training
    modes = optimizer_modes(optimizer) if was_training else None
    model.eval()
    if modes is not None:
        modes.eval()
    try:
        if no_grad:
            with torch.no_grad():
                yield
        else:
            yield
    finally:
        if modes is not None:
            modes.train()
        model.train(was_training)
