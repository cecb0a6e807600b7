"""Shared builders for the tests: seeded models, data and the canonical Accelerate loop."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from trainfold import testing


#: Marks a test that needs a GPU (it is skipped where CUDA is not available, as on CI).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def classification_data(n: int = 50, features: int = 8, classes: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def mlp(features: int = 8, classes: int = 3, dropout: float = 0.0) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, classes)
    )


def ce_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def ce_loss_with_accuracy(model, batch):
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits, y), {"accuracy": (logits.argmax(-1) == y).float().mean()}


def build(seed: int, *, dropout: float = 0.0, shuffle: bool = False, scheduler: bool = False, n: int = 50, batch_size: int = 8, lr: float = 0.1):
    """Model, optimizer, optional scheduler and loader, all seeded identically for both loops."""
    torch.manual_seed(seed)
    model = mlp(dropout=dropout)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    dl = torch.utils.data.DataLoader(classification_data(n), batch_size=batch_size, shuffle=shuffle)
    return model, opt, sched, dl


def canonical_loop(accelerator: Accelerator, model, opt, sched, dl, loss_fn, *, epochs: int, clip_norm=None):
    """The hand-written loop of Accelerate's gradient-accumulation guide, with clipping on sync steps."""
    objs = accelerator.prepare(model, opt, dl) if sched is None else accelerator.prepare(model, opt, dl, sched)
    model, opt, dl = objs[:3]
    sched = objs[3] if sched is not None else None
    losses = []
    for _ in range(epochs):
        model.train()
        for batch in dl:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip_norm is not None:
                    accelerator.clip_grad_norm_(model.parameters(), clip_norm)
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
            losses.append(loss.detach().float())
    return testing.parameters(model), losses
