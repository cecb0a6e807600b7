"""k-fold cross-validation on scikit-learn's digits: one Context, a fresh TrainState per fold.

python examples/cross_validation.py [--folds 5] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from accelerate import Accelerator
from sklearn.model_selection import StratifiedKFold
from torch.utils.data import DataLoader, Subset
from toolz import compose

from digits import datasets, loss_fn
from trainfold import Context, TrainState, evaluate, loop, make_step, run_epoch


def fold_accuracy(ctx: Context, train_ds, val_ds, epochs: int, seed: int) -> float:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    train_dl, val_dl = ctx.prepare_loaders(
        DataLoader(train_ds, batch_size=64, shuffle=True), DataLoader(val_ds, batch_size=256)
    )
    epoch = compose(evaluate(ctx, loss_fn, val_dl), run_epoch(ctx, make_step(ctx, loss_fn), train_dl))
    state = loop(epoch, max_epochs=epochs)(state)
    ctx.release(state, train_dl, val_dl)  # the Accelerator would keep every fold's model and optimizer alive
    return state.metrics["eval_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    ctx = Context(accelerator=Accelerator())  # Accelerate's state is process-wide: one Context for every fold
    data, _ = datasets(seed=0)
    labels = data.tensors[1].numpy()
    folds = StratifiedKFold(n_splits=2 if args.smoke else args.folds, shuffle=True, random_state=0)
    scores = []
    for k, (train_idx, val_idx) in enumerate(folds.split(np.zeros(len(labels)), labels)):
        scores.append(
            fold_accuracy(ctx, Subset(data, train_idx), Subset(data, val_idx), epochs=1 if args.smoke else 15, seed=k)
        )
        ctx.accelerator.print(f"fold {k}: eval_accuracy {scores[-1]:.4f}")
    ctx.accelerator.print(
        f"cross-validated accuracy {statistics.mean(scores):.4f} ± {statistics.pstdev(scores):.4f} over {len(scores)} folds"
    )


if __name__ == "__main__":
    main()
