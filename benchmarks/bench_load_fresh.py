"""A resume's load, timed as a resume runs it: each load in a fresh process, against Accelerate's ``load_state``.

    python benchmarks/bench_load_fresh.py [--width 2048] [--layers 8] [--rounds 7]

A model of --layers Linear(width, width) with AdamW (8 x 2048^2: 403 MB of checkpoint), saved once by
``save_checkpoint`` and by ``accelerator.save_state``. Each round starts two processes in turn, each of which builds
the live model and optimizer (as a resumed job does) and then loads once: trainfold's verified ``load_checkpoint``
or Accelerate's unverified ``load_state``, the page cache warm. Reported: the medians, their ratio, and each load's
peak growth of resident memory (``VmHWM``, reset before the load), as a multiple of the checkpoint's size.

Loads repeated inside one process (``bench_checkpoint.py``) measure something else: Accelerate's optimizer tensors
are allocated from the heap, which reuses the pages the previous round freed, while a verified load reads each file
into an anonymous map of its own, whose pages are new every time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import sys, time, torch
from accelerate import Accelerator
from trainfold import Context, TrainState, load_checkpoint, save_checkpoint

which, root, acc_dir, width, layers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
ctx = Context(accelerator=Accelerator(cpu=True))
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
state = TrainState.create(ctx, model=model, optimizer=opt)
model(torch.randn(4, width)).sum().backward(); opt.step(); opt.zero_grad()  # the live state exists, as in a resume
if which == "save":
    save_checkpoint(ctx, root, state); ctx.accelerator.save_state(acc_dir); sys.exit()

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":")) * 1024

open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
start = time.perf_counter()
load_checkpoint(ctx, root, state) if which == "trainfold" else ctx.accelerator.load_state(acc_dir)
print(time.perf_counter() - start, status("VmHWM") - before)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root, acc_dir = Path(tmp) / "trainfold", Path(tmp) / "accelerate"
        shape = [str(args.width), str(args.layers)]
        subprocess.run([sys.executable, "-c", CHILD, "save", str(root), str(acc_dir), *shape], check=True)
        size = sum(p.stat().st_size for p in acc_dir.rglob("*") if p.is_file())
        results: dict[str, list[tuple[float, int]]] = {"trainfold": [], "accelerate": []}
        for _ in range(args.rounds):
            for which in results:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, which, str(root), str(acc_dir), *shape],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.split()
                results[which].append((float(out[0]), int(out[1])))
    seconds = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
    peaks = {k: statistics.median(m for _, m in v) for k, v in results.items()}
    print(
        f"{args.layers} x Linear({args.width}, {args.width}) + AdamW, {size / 2**20:.0f} MB; {args.rounds} rounds, a fresh process each\n"
    )
    print("| load | median s | peak memory growth |")
    print("| --- | ---: | ---: |")
    for k in results:
        print(f"| {k} | {seconds[k]:.3f} | {peaks[k] / 2**20:.0f} MB ({peaks[k] / size:.2f}x the checkpoint) |")
    print(f"\nverified load / load_state: {seconds['trainfold'] / seconds['accelerate']:.2f}")


if __name__ == "__main__":
    main()
