"""Python lines executed per training step, by function: where a loop's interpreter time goes.

    python benchmarks/python_lines.py                 # trainfold against the raw loop
    python benchmarks/python_lines.py trainfold_full  # another trainfold loop against raw
    python benchmarks/python_lines.py --top 40

Deterministic and quick (seconds), unlike wall time here or callgrind (minutes): it counts the
``line`` events of ``sys.settrace`` over one epoch of bench.py's tiny MLP (200 steps), divided
by the steps, and prints the functions whose counts differ most from the raw PyTorch loop.
Lines are a proxy: a line that calls into C (a tensor op) counts once. Use it to find Python
work to remove, and ``instructions.py`` to confirm a change.
"""

from __future__ import annotations

import argparse
import collections
import io
import sys
from typing import Any

import torch
import torch.nn.functional as F

SIZES, BATCH, STEPS = (32, 64, 10), 32, 200
LOOPS = ("raw", "trainfold", "trainfold+nan_guard", "trainfold_full")


def lines_per_step(which: str) -> collections.Counter[str]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=True)
    n = BATCH * STEPS
    ds = torch.utils.data.TensorDataset(torch.randn(n, SIZES[0]), torch.randint(0, SIZES[-1], (n,)))
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH)
    run = _loop(which, model, opt, dl)
    counts: collections.Counter[str] = collections.Counter()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            code = frame.f_code
            counts[f"{_short(code.co_filename)}:{code.co_name}"] += 1
        return local

    sys.settrace(lambda frame, event, arg: local)
    try:
        run()
    finally:
        sys.settrace(None)
    return collections.Counter({k: v / STEPS for k, v in counts.items()})


def _short(filename: str) -> str:
    for marker in ("site-packages/", "src/"):
        if marker in filename:
            return filename.split(marker)[-1]
    return filename


def _loop(which: str, model: torch.nn.Module, opt: torch.optim.Optimizer, dl: Any) -> Any:
    if which == "raw":

        def raw() -> None:
            for x, y in dl:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()

        return raw
    from accelerate import Accelerator
    from toolz import compose

    from trainfold import Context, TrainState, log_every, make_step, nan_guard, progress_bar, run_epoch

    ctx = Context(accelerator=Accelerator(cpu=True))
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (prepared,) = ctx.prepare_loaders(dl)
    guarded = which in ("trainfold+nan_guard", "trainfold_full")
    step = make_step(ctx, lambda m, b: F.cross_entropy(m(b[0]), b[1]), stages=[nan_guard(3)] if guarded else [])
    # as in instructions.py: tqdm's redraws are timed, and tracing slows the loop ~10x, so redraw
    # every 1,000 steps (natively: every ~1,500) and without tqdm's monitor thread
    from tqdm.auto import tqdm

    tqdm.monitor_interval = 0
    bar = progress_bar(ctx, total=len(prepared), force=True, file=io.StringIO(), miniters=1000, mininterval=0)
    wrap = {"trainfold": [], "trainfold+nan_guard": [], "trainfold_full": [bar, log_every(ctx, 50)]}[which]
    return lambda: run_epoch(ctx, compose(*wrap)(step), prepared, state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", nargs="?", default="trainfold", choices=LOOPS[1:])
    parser.add_argument("--top", type=int, default=25, help="how many functions to list (default 25)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base, mine = lines_per_step("raw"), lines_per_step(args.loop)
    print(f"Python lines per step: raw {sum(base.values()):.0f}, {args.loop} {sum(mine.values()):.0f}\n")
    print(f"{'extra':>7} {'total':>7}  function")
    diff = {k: mine[k] - base[k] for k in base.keys() | mine.keys()}
    for name, extra in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
        print(f"{extra:7.1f} {mine[name]:7.1f}  {name}")


if __name__ == "__main__":
    main()
