"""A 2-process DDP run that a signal stops at a step boundary with a final checkpoint; run again, it resumes.

    torchrun --nproc_per_node 2 signal_run.py ROOT OUT [--step-s S] [--stop-check-s S] [--uneven]

Each rank prints "ready <rank> <pid>" when set up; rank 0 prints "update <n>"
after every update. With no checkpoint under ROOT it starts fresh, otherwise it
resumes from the newest. When it finishes it writes its parameters to OUT
(rank 0); when a signal stopped it, it prints "stopped <update> <reason>" and exits 0.
With --uneven the loader gives rank 0 one batch more than the others (Accelerate's
even_batches=False): each rank prints "refused <rank> <message>" and exits 0.
"""

import argparse
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from safetensors.torch import save_file

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    load_checkpoint,
    loop,
    make_step,
    run_epoch,
    testing,
)


def say(line):
    sys.stdout.write(line + "\n")  # one write: the two ranks share the pipe
    sys.stdout.flush()


def main(argv=None):
    """The job, with ``argv`` as the command line's arguments (``sys.argv[1:]`` where None): ``testing.run_distributed``
    runs it so in a test."""
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--stop-check-s", type=float, default=1.0)
    parser.add_argument("--uneven", action="store_true")
    args = parser.parse_args(argv)
    loaders = DataLoaderConfiguration(even_batches=not args.uneven)

    torch.manual_seed(0)
    with Context(
        accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=loaders),
        stop_check_s=args.stop_check_s,
    ) as ctx:
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3)
        )
        state = TrainState.create(
            ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        )
        g = torch.Generator().manual_seed(3)
        n = 242 if args.uneven else 240  # 121 batches of 2: one more on rank 0
        data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
        (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
        state = load_checkpoint(ctx, args.root, state, missing_ok=True)
        inner = make_step(ctx, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
        rank = ctx.accelerator.process_index

        def slow(s, b):
            time.sleep(args.step_s)
            new = inner(s, b)
            if rank == 0 and new.step != s.step:
                say(f"update {new.step}")
            return new

        saving = checkpoint_every(ctx, 10_000, args.root)  # no periodic save: only the final one on a stop, and the end
        step = saving(slow)
        say(f"ready {rank} {os.getpid()}")
        try:
            state = saving.at_end(loop(run_epoch(ctx, step, dl), max_epochs=2)(state))
        except ValueError as exc:
            if not args.uneven:
                raise
            say(f"refused {rank} {exc}")
            return
        if state.should_stop:
            if rank == 0:
                say(f"stopped {state.step} {state.stop.reason}")
            return
        if rank == 0:
            save_file(testing.parameters(state), args.out)
            say(f"done {state.step}")


if __name__ == "__main__":
    main()
