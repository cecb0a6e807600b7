"""What watching a run costs: log_every(50, watch=True) against log_every(50) on the tiny MLP, in paired rounds.

Each process builds the raw PyTorch loop and both trainfold configurations (bench.py's tiny MLP, 256 batches an
epoch), then times an epoch of each per round in a shuffled order. Per round, the watched epoch's time over the
logged one's; the median over every round of every process, and the ratio of each configuration's fastest epoch in a
process (noise only adds time; their median over processes), are the figures (the issue's guard: at most 1.01). The
host work watching adds per step is also timed alone (the meter, the loader's timing and, on several processes, the
per-process timing that names stragglers), which noise cannot hide.

    python benchmarks/bench_watch.py --processes 4 --rounds 15 [--out benchmarks/results_watch.json]
    python benchmarks/bench_watch.py --model compute --rounds 10 --out benchmarks/results_watch_compute.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES, BATCH, BATCHES = (32, 64, 10), 32, 256


def child(rounds: int, seed: int, model: str = "tiny") -> dict[str, list[float]]:
    import torch

    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    import bench

    sizes, batch, batches = bench.MODELS[model]

    rng = random.Random(seed)
    epochs = {}
    bench.reset_accelerate()
    for key in rng.sample(["raw", "logged", "watched"], 3):
        data = bench.make_data(sizes, batch, batches)
        epochs[key] = bench.raw(sizes, data, batch) if key == "raw" else bench.trainfold_loop(sizes, data, batch, key)
        epochs[key]()  # warm-up (and the first step's FLOPs counted)
    times: dict[str, list[float]] = {key: [] for key in epochs}
    for _ in range(rounds):
        for key in rng.sample(list(epochs), len(epochs)):
            start = time.perf_counter()
            epochs[key]()
            times[key].append((time.perf_counter() - start) / batches * 1e6)
    return times


def overhead(calls: int = 200_000) -> dict[str, float]:
    """The host work watching adds to a step, timed alone (microseconds a call): the meter around a step that does
    nothing, over the bare call, and the loader's timed iteration over a plain one."""
    import torch

    from trainfold import Watch, testing
    from trainfold._src.compose.watch import Meter
    from trainfold._src.core.clock import Clock, Compute

    ctx, state, _, _ = testing.tiny_setup(seed=0)
    batch = (torch.zeros(BATCH, SIZES[0]), torch.zeros(BATCH, dtype=torch.long))
    meter, noop = Meter(ctx, Watch(measure_flops=False)), (lambda s, b: s)

    def per_call(fn) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    clock = Clock()
    clock.on = True
    start = time.perf_counter()
    for _ in clock.timed(iter(range(calls))):
        pass
    timed = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for _ in iter(range(calls)):
        pass
    plain = (time.perf_counter() - start) / calls * 1e6
    ctx.close()
    compute, model = Compute(), torch.nn.Linear(2, 1)  # the per-process timing of a watch on several processes
    noted = compute._noted(0)  # the one gradient hook it keeps, called once a backward
    return {
        "meter_us": per_call(lambda: meter.step(noop, state, batch)) - per_call(lambda: noop(state, batch)),
        "timed_loader_us": timed - plain,
        "per_process_us": per_call(lambda: compute.end(compute.begin(model), synced=False))
        + per_call(lambda: noted(None)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--model", default="tiny", help="bench.py's model: tiny (the guard's), or compute (a step 100x longer)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds, args.seed, args.model)))
        return
    runs = []
    for seed in range(args.processes):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--rounds",
                str(args.rounds),
                "--seed",
                str(seed),
                "--model",
                args.model,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    paired = [w / l for run in runs for w, l in zip(run["watched"], run["logged"])]
    over_raw = {
        key: statistics.median(t / r for run in runs for t, r in zip(run[key], run["raw"]))
        for key in ("logged", "watched")
    }
    # Noise on a shared machine only ever adds time: each configuration's fastest epoch in a process is its cost with
    # the least noise, and the ratio of the two fastest (per process; their median) resolves what the paired rounds' spread hides.
    fastest = [min(run["watched"]) / min(run["logged"]) for run in runs]
    result = {
        "watched_over_logged_median": statistics.median(paired),
        "watched_over_logged_quartiles": statistics.quantiles(paired, n=4),
        "watched_over_logged_fastest_epochs": statistics.median(fastest),
        "watched_over_logged_fastest_epochs_per_process": fastest,
        "over_raw_median": over_raw,
        "raw_us_per_step_median": statistics.median(t for run in runs for t in run["raw"]),
        "added_host_work_us": overhead(),
        "model": args.model,
        "rounds": len(paired),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
