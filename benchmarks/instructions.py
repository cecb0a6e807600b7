"""Per-step instruction counts (deterministic, unlike wall time on a shared machine), under callgrind.

    python benchmarks/instructions.py                    # every loop, under valgrind --tool=callgrind
    python benchmarks/instructions.py trainfold_full     # only some (raw always runs: it is the base)

For each loop it runs N1 and N2 steps of the tiny MLP in separate processes and reports
(instructions(N2) - instructions(N1)) / (N2 - N1): the instructions of one step, with start-up
and set-up cancelled out. Needs valgrind. Slow (minutes): callgrind runs Python ~50x slower.
Counts repeat exactly between runs. Do not edit the sources while it runs, or count a copy:
`git worktree add /tmp/wt && PYTHONPATH=/tmp/wt/src python benchmarks/instructions.py`. Only the tiny MLP:
under callgrind the compute-bound MLP's matrix kernels did not finish 20 steps in 20 minutes
on 2 cores, and there the per-step overhead is the same absolute amount of Python anyway.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES, BATCH = (32, 64, 10), 32  # bench.py's tiny MLP
N1, N2 = 64, 320
LOOPS = (
    "raw",
    "raw+loader",
    "raw+loader+optimizer",
    "accelerate",
    "trainfold_step",
    "trainfold",
    "trainfold+nan_guard",
    "trainfold+log_every",
    "trainfold+progress_bar",
    "trainfold_full",
)
#: The per-component breakdown: each line's cost is its loop's instructions minus the loop before it.
BREAKDOWN = (
    (
        "Accelerate's loader as ctx.prepare_loaders prepares it (DataLoaderShard: its look-ahead; no placement on a CPU device)",
        "raw+loader",
        "raw",
    ),
    ("Accelerate's optimizer wrapper (AcceleratedOptimizer.step, zero_grad)", "raw+loader+optimizer", "raw+loader"),
    (
        "trainfold's step over the raw body on the prepared loader (stages, update, state, running sums)",
        "trainfold_step",
        "raw+loader",
    ),
    ("run_epoch over calling the step (the cursor, checks, the epoch's end)", "trainfold", "trainfold_step"),
)

CHILD = r"""
import gc, io, sys, torch
import torch.nn.functional as F
torch.set_num_threads(1)
which, n, sizes, batch = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4])
torch.manual_seed(0)
layers = []
for a, b in zip(sizes[:-1], sizes[1:]):
    layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers[:-1])
opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
ds = torch.utils.data.TensorDataset(torch.randn(batch * n, sizes[0]), torch.randint(0, sizes[-1], (batch * n,)))
dl = torch.utils.data.DataLoader(ds, batch_size=batch)
loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])
gc.collect()
gc.disable()  # a cyclic collection of torch's heap costs ~10^8 instructions: keep it out of the difference
if which == "raw":
    for x, y in dl:
        loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
elif which in ("raw+loader", "raw+loader+optimizer"):  # the raw body; Accelerate's loader (and optimizer wrapper) around it
    from accelerate import Accelerator
    from trainfold import Context
    acc = Accelerator(cpu=True)
    (dl,) = Context(accelerator=acc).prepare_loaders(dl)  # the loader a trainfold run gets (no placement on a CPU device)
    if which == "raw+loader+optimizer":
        opt = acc.prepare_optimizer(opt)
    for x, y in dl:
        loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
elif which == "trainfold_step":  # the step called in a plain loop over the prepared loader: no run_epoch
    from accelerate import Accelerator
    from trainfold import Context, TrainState, make_step
    ctx = Context(accelerator=Accelerator(cpu=True))
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    step = make_step(ctx, loss_fn)
    for batch in dl:
        state = step(state, batch)
elif which == "accelerate":
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    for x, y in dl:
        with acc.accumulate(model):
            loss = F.cross_entropy(model(x), y); acc.backward(loss); opt.step(); opt.zero_grad()
else:
    from accelerate import Accelerator
    from toolz import compose
    from trainfold import Context, TrainState, log_every, make_step, nan_guard, progress_bar, run_epoch
    ctx = Context(accelerator=Accelerator(cpu=True))
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(dl)
    guarded = which in ("trainfold+nan_guard", "trainfold_full")
    step = make_step(ctx, loss_fn, stages=[nan_guard(3)] if guarded else [])
    # tqdm redraws every 0.1 s of wall time; callgrind runs ~50x slower, so a timed redraw would
    # come every step or two instead of every ~1,500 (as natively). Redraw every 1,000 steps instead,
    # and without tqdm's monitor thread, which after 10 s of wall time without a redraw would make
    # every later step redraw.
    from tqdm.auto import tqdm
    tqdm.monitor_interval = 0
    bar = progress_bar(ctx, total=len(dl), force=True, file=io.StringIO(), miniters=1000, mininterval=0)
    wrap = {"trainfold": [], "trainfold+nan_guard": [], "trainfold+log_every": [log_every(ctx, 50)],
            "trainfold+progress_bar": [bar], "trainfold_full": [bar, log_every(ctx, 50)]}[which]
    run_epoch(ctx, compose(*wrap)(step), dl, state)
"""


# No .pyc writing: a module compiled by one run and read by the other would put the compilation
# (tens of millions of instructions) into the difference. With it off, both runs do the same.
# PYTHONPATH is passed on, so a copy of the sources (a git worktree) can be counted while these are edited.
ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PATH": "/usr/bin:/bin",
    **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
}


def instructions(which: str, n: int, tmp: Path) -> int:
    script = tmp / f"child-{which}-{n}.py"
    script.write_text(CHILD)
    out = tmp / f"cg.{which}.{n}"
    args = [which, str(n), ",".join(map(str, SIZES)), str(BATCH)]
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, str(script), *args],
        check=True,
        capture_output=True,
        text=True,
        env=ENV,
    )
    summary = re.search(r"^summary:\s+(\d+)", out.read_text(errors="replace"), re.MULTILINE) or re.search(
        r"^totals:\s+(\d+)", out.read_text(errors="replace"), re.MULTILINE
    )
    return int(summary.group(1))


def main() -> None:
    import argparse
    from concurrent.futures import ThreadPoolExecutor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loops", nargs="*", metavar="LOOP", help=f"some of {', '.join(LOOPS)} (default: all)")
    args = parser.parse_args()
    if unknown := set(args.loops) - set(LOOPS):
        parser.error(f"unknown loop(s) {sorted(unknown)}: choose from {', '.join(LOOPS)}")
    loops = ["raw", *(w for w in (args.loops or LOOPS) if w != "raw")]
    print(f"tiny MLP {SIZES}, batch {BATCH}: steps {N1} and {N2}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=len(loops) * 2) as pool:
        # instruction counts do not depend on load, so every run can go at once
        runs = {(w, n): pool.submit(instructions, w, n, Path(tmp)) for w in loops for n in (N1, N2)}
        per_step = {}
        for which in loops:
            per_step[which] = (runs[which, N2].result() - runs[which, N1].result()) / (N2 - N1)
            print(f"{which:24s} {per_step[which] / 1e6:8.3f} M instructions/step", flush=True)
    print()
    for which in loops[1:]:
        print(f"{which:24s} {per_step[which] / per_step['raw']:.3f} x raw")
    print()
    for what, loop, base in BREAKDOWN:
        if loop in per_step and base in per_step:
            cost = per_step[loop] - per_step[base]
            print(f"{cost / 1e3:8.1f} K instructions/step ({cost / per_step['raw']:+.1%} of raw): {what}")


if __name__ == "__main__":
    main()
