"""Embedding trainfold in a larger program: a learning-rate search that branches from one snapshot.

A research platform owns the loop; trainfold is a library inside it. Here the platform warms a
model up once, snapshots it, runs one branch per candidate learning rate from that snapshot
(each branch exactly as a fresh run from the warm-up would be), and keeps the best.

    python examples/hparam_search.py [--smoke]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from toolz import compose

from digits import datasets, loss_fn
from trainfold import Context, Snapshot, TrainState, evaluate, loop, make_step, restore, run_epoch, snapshot


@dataclass
class Trial:
    lr: float
    eval_accuracy: float
    eval_loss: float
    snap: Snapshot


def set_lr(state: TrainState, lr: float) -> TrainState:
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    return state


def search(
    ctx: Context, state: TrainState, train_dl, val_dl, lrs: list[float], epochs: int
) -> tuple[Trial, list[Trial]]:
    """Warm up one epoch, then train one branch per learning rate from the same snapshot."""
    step = make_step(ctx, loss_fn)
    state = run_epoch(ctx, step, train_dl, state)  # shared warm-up
    start = snapshot(state)
    epoch = compose(evaluate(ctx, loss_fn, val_dl), run_epoch(ctx, step, train_dl))
    trials = []
    for lr in lrs:
        branch = loop(epoch, max_epochs=start.epoch + epochs)(set_lr(restore(ctx, start, state), lr))
        trials.append(Trial(lr, branch.metrics["eval_accuracy"], branch.metrics["eval_loss"], snapshot(branch)))
        ctx.accelerator.print(
            f"lr {lr:<6}  eval_accuracy {trials[-1].eval_accuracy:.4f}  eval_loss {trials[-1].eval_loss:.4f}"
        )
    return min(trials, key=lambda t: t.eval_loss), trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator())
    train_ds, val_ds = datasets(seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    train_dl, val_dl = ctx.prepare_loaders(
        DataLoader(train_ds, batch_size=64, shuffle=True), DataLoader(val_ds, batch_size=128)
    )

    best, trials = search(
        ctx,
        state,
        train_dl,
        val_dl,
        [0.003, 0.03] if args.smoke else [0.001, 0.003, 0.01, 0.03, 0.1],
        epochs=1 if args.smoke else 5,
    )
    state = restore(ctx, best.snap, state)  # continue from the winner
    ctx.accelerator.print(
        f"best lr {best.lr} of {len(trials)}: eval_accuracy {best.eval_accuracy:.4f}; the state is at step {state.step}"
    )


if __name__ == "__main__":
    main()
