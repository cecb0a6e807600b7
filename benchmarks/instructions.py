"""Per-step instruction counts (deterministic, unlike wall time on a shared machine), under callgrind.

    python benchmarks/instructions.py            # runs each loop under valgrind --tool=callgrind

For each loop it runs N1 and N2 steps of the tiny MLP in separate processes and reports
(instructions(N2) - instructions(N1)) / (N2 - N1): the instructions of one step, with start-up
and set-up cancelled out. Needs valgrind. Slow (minutes): callgrind runs Python ~50x slower.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

N1, N2 = 64, 320
LOOPS = ("raw", "accelerate", "trainfold", "trainfold_full")

CHILD = r'''
import gc, io, sys, torch
import torch.nn.functional as F
torch.set_num_threads(1)
which, n = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
ds = torch.utils.data.TensorDataset(torch.randn(32 * n, 32), torch.randint(0, 10, (32 * n,)))
dl = torch.utils.data.DataLoader(ds, batch_size=32)
loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])
gc.collect()
gc.disable()  # a cyclic collection of torch's heap costs ~10^8 instructions: keep it out of the difference
if which == "raw":
    for x, y in dl:
        loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
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
    step = make_step(ctx, loss_fn)
    if which == "trainfold_full":
        step = compose(progress_bar(ctx, total=len(dl), force=True, file=io.StringIO()), log_every(ctx, 50), nan_guard(3))(step)
    run_epoch(ctx, step, dl, state)
'''


def instructions(which: str, n: int, tmp: Path) -> int:
    script = tmp / f"child-{which}-{n}.py"
    script.write_text(CHILD)
    out = tmp / f"cg.{which}.{n}"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, str(script), which, str(n)],
                   check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"})
    summary = re.search(r"^summary:\s+(\d+)", out.read_text(errors="replace"), re.M) or re.search(r"^totals:\s+(\d+)", out.read_text(errors="replace"), re.M)
    return int(summary.group(1))


def main() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=len(LOOPS) * 2) as pool:
        # instruction counts do not depend on load, so every run can go at once
        runs = {(w, n): pool.submit(instructions, w, n, Path(tmp)) for w in LOOPS for n in (N1, N2)}
        per_step = {}
        for which in LOOPS:
            per_step[which] = (runs[which, N2].result() - runs[which, N1].result()) / (N2 - N1)
            print(f"{which:16s} {per_step[which] / 1e6:8.3f} M instructions/step", flush=True)
    print()
    for which in LOOPS[1:]:
        print(f"{which:16s} {per_step[which] / per_step['raw']:.3f} x raw")


if __name__ == "__main__":
    main()
