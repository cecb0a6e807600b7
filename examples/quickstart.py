"""pytorch-accelerated's quick-start, composed from trainfold, on scikit-learn's digits (no download).

Train, evaluate every epoch, stop early, keep the best weights, average them (EMA), show a
progress bar and log to TensorBoard; then restore the best weights and evaluate the test split.

    python examples/quickstart.py [--smoke]      # TensorBoard logs in examples/out/quickstart/
"""

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from digits import datasets, loss_fn
from trainfold import Context, TrainState, ema, ema_model, evaluate, fit, restore_best, save_best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    out = Path(__file__).resolve().parent / "out" / "quickstart"
    torch.manual_seed(0)
    accelerator = Accelerator(log_with="tensorboard", project_dir=out)
    accelerator.init_trackers("digits")
    ctx = Context(accelerator=accelerator)
    train_ds, test_ds = datasets(seed=0)
    train_ds, val_ds = torch.utils.data.random_split(train_ds, [0.85, 0.15], generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    train_dl, val_dl, test_dl = ctx.prepare_loaders(
        DataLoader(train_ds, batch_size=32, shuffle=True),
        DataLoader(val_ds, batch_size=64),
        DataLoader(test_ds, batch_size=64),
    )

    state = fit(
        ctx,
        loss_fn,
        train_dl,
        state,
        max_epochs=2 if args.smoke else 30,
        eval_loader=val_dl,
        patience=3,
        log_every_n=20,
        transforms=[ema(0.99)],
        epoch_fns=[
            evaluate(ctx, loss_fn, val_dl, prefix="ema", model=ema_model),
            save_best(ctx, out / "best.safetensors", "eval_loss"),
        ],
    )

    state = evaluate(ctx, loss_fn, test_dl, restore_best(ctx, out / "best.safetensors", state), prefix="test")
    ctx.accelerator.print(
        f"stopped after {state.epoch} epochs; best epoch {state.extras['save_best:eval_loss'].epoch}; "
        f"test accuracy {state.metrics['test_accuracy']:.4f} (EMA on validation: {state.metrics['ema_accuracy']:.4f})"
    )
    ctx.close()


if __name__ == "__main__":
    main()
