"""A training script written from the guide "Running at scale": it resumes by itself, on any number of processes.

    torchrun --nnodes 1:2 --nproc_per_node 1 --rdzv-backend c10d ... elastic_run.py ROOT OUT [--step-s S] [--until N]
        [--every K] [--memory MEM]

Resumes from ROOT's newest checkpoint at start (``missing_ok``), whatever the world size; saves a checkpoint every two
updates (``--every``) and at a stop; with ``--memory`` also every update into MEM (a memory tier, the newest two kept),
and resumes from the newest of either (a SIGTERM: the agent restarting its workers); trains four epochs of 24 samples. Each process
prints "start <world> <update> <rank> <pid>" once set up, and rank 0 "update <n>" after each update; every micro-batch's
sample ids go to ``OUT/records-<pid>.txt`` as "<incarnation> <update> <epoch> <world> <ids...>" (the incarnation: its
rank 0's pid). At the end rank 0 writes the parameters to ``OUT/final.st`` and prints "done". ``--until N`` ends the
run after update N (a budget): a replay of the world-size schedule an elastic run followed, one launch per world size.
Under SLURM (``SLURM_JOB_ID`` set) a run stopped before its end (a signal: the time limit's, a preemption's) requeues
its job, once its final checkpoint is written.
"""

import argparse
import os
import subprocess
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from safetensors.torch import save_file

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    load_checkpoint,
    loop,
    make_step,
    max_steps,
    run_epoch,
    testing,
)


class Numbered(torch.utils.data.Dataset):
    """24 samples, each with its id: what the test counts."""

    def __init__(self, n=24):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i], i


def loss_fn(model, batch):
    x, y, _ = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def say(line):
    sys.stdout.write(line + "\n")  # one write: the processes share the pipe
    sys.stdout.flush()


def main(argv=None, *, on_update=None, on_commit=None):
    """The run. ``on_update(state)`` is called after each update, ``on_commit(state, path)`` after each checkpoint is
    committed, on every process (Ray Train's training function reports them with these)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--until", type=int, default=None)
    parser.add_argument("--every", type=int, default=2, help="updates between two checkpoints in ROOT")
    parser.add_argument("--memory", default=None, help="a memory tier (a root in /dev/shm), saved every update")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    with Context(accelerator=Accelerator(cpu=True)) as ctx:
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3)
        )
        state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
        (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(Numbered(), batch_size=2, shuffle=True))
        roots = [args.memory, args.root] if args.memory else args.root  # the newest of either, the memory tier's first
        state = load_checkpoint(ctx, roots, state, missing_ok=True)

        world, rank = ctx.accelerator.num_processes, ctx.accelerator.process_index
        incarnation = broadcast_object_list([os.getpid()])[0]
        records = open(os.path.join(args.out, f"records-{os.getpid()}.txt"), "a")
        inner = make_step(ctx, loss_fn)

        def step(s, batch):
            time.sleep(args.step_s)
            ids = " ".join(str(int(i)) for i in batch[2])
            records.write(f"{incarnation} {s.step + 1} {s.epoch} {world} {ids}\n")
            records.flush()
            new = inner(s, batch)
            if rank == 0:
                say(f"update {new.step}")
            return new

        saving = checkpoint_every(ctx, args.every, args.root)  # every checkpoint kept: the test replays from them
        if args.memory:  # the fast tier: every update, the newest two kept
            step = checkpoint_every(ctx, 1, args.memory, keep_last=2, best_effort=True)(step)
        if args.until is not None:
            step = max_steps(args.until)(step)

        told = []  # the checkpoints on_commit was told of

        def tell(s):
            newest = latest_checkpoint(args.root)
            if on_commit is not None and newest is not None and newest.name not in told:
                told.append(newest.name)
                on_commit(s, newest)

        def step_and_tell(s, batch):  # outside the saving: a save at this update is committed when it returns
            new = saved(s, batch)
            if new.step != s.step:
                if on_update is not None:
                    on_update(new)
                if new.step % saving.n == 0 or new.should_stop:
                    tell(new)
            return new

        saved = saving(step)
        say(f"start {world} {state.step} {rank} {os.getpid()}")
        state = saving.at_end(loop(run_epoch(ctx, step_and_tell, dl), max_epochs=4)(state))
        tell(state)  # the end, where at_end saved it
        records.close()
        if state.should_stop:
            say(f"stopped {state.step} {state.stop.reason}")
            if not state.stop.final and ctx.is_main_process and "SLURM_JOB_ID" in os.environ:
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)  # stopped, not done
            return
        if rank == 0:
            save_file(testing.parameters(state), os.path.join(args.out, "final.st"))
            say(f"done {state.step}")


if __name__ == "__main__":
    main()
