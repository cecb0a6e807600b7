"""A 2-process DDP run that a signal stops at a step boundary with a final checkpoint; run again, it resumes.

    torchrun --nproc_per_node 2 signal_run.py ROOT OUT [--step-s S] [--stop-check-s S]

Each rank prints "ready <rank> <pid>" when set up; rank 0 prints "update <n>"
after every update. With no checkpoint under ROOT it starts fresh, otherwise it
resumes from the newest. When it finishes it writes its parameters to OUT
(rank 0); when a signal stopped it, it prints "stopped <update> <reason>" and exits 0.
"""

import argparse
import os
import sys
import time

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from trainfold import Context, TrainState, checkpoint_every, latest_checkpoint, load_checkpoint, loop, make_step, run_epoch, testing


def say(line):
    sys.stdout.write(line + "\n")  # one write: the two ranks share the pipe
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--stop-check-s", type=float, default=1.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    with Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2), stop_check_s=args.stop_check_s) as ctx:
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3))
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(240, 8, generator=g), torch.randint(0, 3, (240,), generator=g))
        (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
        if latest_checkpoint(args.root) is not None:
            state = load_checkpoint(ctx, args.root, state)
        inner = make_step(ctx, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
        rank = ctx.accelerator.process_index

        def slow(s, b):
            time.sleep(args.step_s)
            new = inner(s, b)
            if rank == 0 and new.step != s.step:
                say(f"update {new.step}")
            return new

        step = checkpoint_every(ctx, args.root, 10_000)(slow)  # no periodic save: only the final one on a stop
        say(f"ready {rank} {os.getpid()}")
        state = loop(run_epoch(ctx, step, dl), max_epochs=2)(state)
        if state.should_stop:
            if rank == 0:
                say(f"stopped {state.step} {state.stop_reason}")
            return
        if rank == 0:
            save_file(testing.parameters(state), args.out)
            say(f"done {state.step}")


if __name__ == "__main__":
    main()
