"""A short two-process run that ends the way Accelerate's scripts end: run by test_exit.py many times under torchrun.

    torchrun --nproc_per_node 2 exit_run.py ROOT [--end-training]

Trains two epochs with a background checkpoint every other update (one may
still be in flight when the loop ends), evaluates and predicts, then, with
--end-training, calls ``accelerator.end_training()`` inside the ``with`` block,
as Accelerate's examples do. Prints "done" after the block.
"""

import sys

import torch
from accelerate import Accelerator
from toolz import compose

from trainfold import Context, TrainState, checkpoint_every, evaluate, loop, make_step, predict, run_epoch


def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def main():
    root, end_training = sys.argv[1], "--end-training" in sys.argv
    with Context(accelerator=Accelerator(cpu=True)) as ctx:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
        train_dl, eval_dl = ctx.prepare_loaders(
            torch.utils.data.DataLoader(data, batch_size=8, shuffle=True),
            torch.utils.data.DataLoader(data, batch_size=8),
        )
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        saving = checkpoint_every(ctx, 2, root, keep_last=2, async_save=True)
        step = saving(make_step(ctx, loss_fn))
        state = compose(
            saving.at_end, loop(compose(evaluate(ctx, loss_fn, eval_dl), run_epoch(ctx, step, train_dl)), max_epochs=2)
        )(state)
        predict(ctx, lambda m, b: m(b[0]), eval_dl, state)
        if end_training:
            ctx.accelerator.end_training()
    print("done", flush=True)


if __name__ == "__main__":
    main()
