"""Train a small classifier on scikit-learn's bundled digits (no download), composed from trainfold.

    python examples/digits.py              # full run: ~97% test accuracy in seconds on 2 CPU cores
    python examples/digits.py --smoke      # a 2-epoch check (what CI runs)

Works unchanged under ``torchrun --nproc_per_node 2 examples/digits.py --cpu``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from accelerate import Accelerator
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from toolz import compose

from trainfold import Context, TrainState, evaluate, loop, make_step, predict, run_epoch


def datasets(seed: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = x_train.mean(0), x_train.std(0)  # statistics of the training split only
    std[std == 0] = 1.0  # border pixels that are constant in the training split

    def tensors(x, y):
        return torch.utils.data.TensorDataset(torch.tensor((x - mean) / std, dtype=torch.float32), torch.tensor(y))

    return tensors(x_train, y_train), tensors(x_test, y_test)


def loss_fn(model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits, y), {"accuracy": (logits.argmax(-1) == y).float().mean()}


def report(ctx: Context, started: float):
    def show(state: TrainState) -> TrainState:
        m = state.metrics
        ctx.accelerator.print(
            f"epoch {state.epoch:3d}  step {state.step:5d}  train_loss {m['train_loss']:.4f}  "
            f"eval_loss {m['eval_loss']:.4f}  eval_accuracy {m['eval_accuracy']:.4f}  ({time.perf_counter() - started:.1f}s)"
        )
        return state

    return show


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="2 epochs, no accuracy target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="force CPU (gloo when launched on several processes)")
    args = parser.parse_args()
    epochs = 2 if args.smoke else args.epochs

    torch.manual_seed(args.seed)
    # The with block ends the run cleanly: every process waits for the others, then the process
    # group is destroyed (a distributed run that skips this can abort at exit).
    with Context(accelerator=Accelerator(cpu=args.cpu)) as ctx:
        train_ds, test_ds = datasets(args.seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(128, 10)
        )
        train_dl, test_dl = ctx.prepare_loaders(
            torch.utils.data.DataLoader(train_ds, batch_size=64, shuffle=True),
            torch.utils.data.DataLoader(test_ds, batch_size=128),
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
        # Accelerate steps a prepared scheduler num_processes times per update: size it so (docs/guides/loop.md)
        updates_per_epoch = math.ceil(len(train_dl) / ctx.gradient_accumulation_steps)  # this process's batches
        scheduler_steps = epochs * updates_per_epoch * ctx.accelerator.num_processes
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=scheduler_steps)
        state = TrainState.create(ctx, model=model, optimizer=optimizer, scheduler=scheduler)

        step = make_step(ctx, loss_fn, clip_grad_norm=1.0)
        epoch = compose(
            report(ctx, time.perf_counter()), evaluate(ctx, loss_fn, test_dl), run_epoch(ctx, step, train_dl)
        )
        state = loop(epoch, max_epochs=epochs)(state)

        logits = predict(ctx, lambda m, b: m(b[0]), test_dl, state)
        accuracy = (logits.argmax(-1).cpu() == test_ds.tensors[1]).float().mean().item()
        ctx.accelerator.print(
            f"test accuracy {accuracy:.4f} on {len(logits)} samples after {state.step} updates on {ctx.accelerator.num_processes} process(es)"
        )
    if not args.smoke and accuracy < 0.95:
        raise SystemExit(f"test accuracy {accuracy:.4f} is below the 0.95 target")


if __name__ == "__main__":
    main()
