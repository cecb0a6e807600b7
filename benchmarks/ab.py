"""Compare two versions of trainfold in the same processes: paired, interleaved, shuffled rounds.

On a shared machine a loop's wall time moves between processes by more than most changes to
the step (see docs/guides/speed.md), so timing each version in its own processes cannot resolve a change
of a few tenths of a percent. This script copies both versions into a temporary folder as the
packages ``trainfold_a`` and ``trainfold_b`` (its absolute imports of itself renamed), imports
both into each process, and times the raw PyTorch loop and each version's configurations on the
tiny MLP round by round, in a shuffled order. It reports each contender's ratio to the raw
loop and, per configuration, the paired difference b - a of the same round, in units of the
raw step.

    python benchmarks/ab.py HEAD .                  # the last commit against the working tree
    python benchmarks/ab.py HEAD~3 HEAD --configs plain,guard,full --processes 6 --rounds 8
    python benchmarks/ab.py HEAD . --optimizer adamw    # every contender with another optimizer (bench.py's)

A version is a directory holding ``trainfold/`` or ``src/trainfold/``, or a git revision.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = ("plain", "guard", "full", "logged", "watched")
SIZES, BATCH, BATCHES = (32, 64, 10), 32, 256


def materialize(version: str, name: str, into: Path) -> None:
    """Copy ``version``'s trainfold package to ``into/name``, its imports of ``trainfold`` made imports of ``name``."""
    _copy(version, name, into)
    for module in (into / name).rglob("*.py"):
        text = module.read_text()
        renamed = re.sub(r"^(\s*)(from|import) trainfold\b", rf"\1\2 {name}", text, flags=re.M)
        if renamed != text:
            module.write_text(renamed)


def _copy(version: str, name: str, into: Path) -> None:
    path = Path(version)
    for candidate in (path / "trainfold", path / "src" / "trainfold"):
        if candidate.is_dir():
            shutil.copytree(candidate, into / name, ignore=shutil.ignore_patterns("__pycache__"))
            return
    extracted = into / f"{name}-git"
    extracted.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", version, "src/trainfold"], capture_output=True, check=False
    )
    if archive.returncode:
        sys.exit(
            f"ab.py: {version!r} is neither a directory holding trainfold/ nor a git revision: {archive.stderr.decode().strip()}"
        )
    subprocess.run(["tar", "-x", "-C", str(extracted)], input=archive.stdout, check=True)
    shutil.move(str(extracted / "src" / "trainfold"), str(into / name))


def child(packages: Path, configs: list[str], rounds: int, seed: int, optimizer: str) -> dict[str, list[float]]:
    """Microseconds per step of every contender, one value per round."""
    import torch

    sys.path[:0] = [str(HERE), str(packages)]
    torch.set_num_threads(1)
    import bench

    bench.OPTIMIZER_NAME = optimizer
    specs: dict[str, tuple[str, str] | None] = {"raw": None}
    specs.update({f"{p}:{c}": (p, c) for p in ("trainfold_a", "trainfold_b") for c in configs})
    rng = random.Random(seed)
    built = list(specs)
    rng.shuffle(built)  # the order in which contenders are built (and so placed in memory) is shuffled too
    bench.reset_accelerate()
    epochs = {}
    for key in built:
        spec = specs[key]
        data = bench.make_data(SIZES, BATCH, BATCHES)
        epochs[key] = (
            bench.raw(SIZES, data, BATCH)
            if spec is None
            else bench.trainfold_loop(SIZES, data, BATCH, spec[1], spec[0])
        )
        epochs[key]()  # warm-up
    times: dict[str, list[float]] = {key: [] for key in specs}
    for _ in range(rounds):
        order = list(specs)
        rng.shuffle(order)
        for key in order:
            start = time.perf_counter()
            epochs[key]()
            times[key].append((time.perf_counter() - start) / BATCHES * 1e6)
    return times


def built_optimizer() -> str:
    """What every contender's optimizer is in this process (after :func:`child`): its class, and "fused" where it is."""
    import bench
    import torch

    opt = bench.OPTIMIZER(torch.nn.Linear(1, 1).parameters(), lr=0.01)
    return type(opt).__name__ + (" (fused)" if opt.defaults.get("fused") else "")


def report(runs: list[dict[str, list[float]]], configs: list[str]) -> None:
    def ratios(run: dict[str, list[float]], key: str) -> list[float]:
        return [t / r for t, r in zip(run[key], run["raw"])]

    raw = statistics.median(t for run in runs for t in run["raw"])
    print(f"raw PyTorch loop: {raw:.0f} us/step (median)\n")
    print(f"{'contender':22s} {'vs raw':>7s}  per-process medians")
    for key in runs[0]:
        pooled = statistics.median(x for run in runs for x in ratios(run, key))
        per = " ".join(f"{statistics.median(ratios(run, key)):.3f}" for run in runs)
        print(f"{key:22s} {pooled:7.3f}  {per}")
    print(f"\n{'b - a, per round':22s} {'median':>7s} {'b faster':>9s}")
    for config in configs:
        diffs = [
            (b - a) / r
            for run in runs
            for a, b, r in zip(run[f"trainfold_a:{config}"], run[f"trainfold_b:{config}"], run["raw"])
        ]
        faster = sum(d < 0 for d in diffs) / len(diffs)
        print(
            f"{config:22s} {statistics.median(diffs):+7.4f} {faster:9.0%}   ({len(diffs)} rounds, in units of the raw step)"
        )


def _optimizers() -> list[str]:
    sys.path.insert(0, str(HERE))
    from bench import OPTIMIZERS

    return list(OPTIMIZERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "a", help="the base version: a directory holding trainfold/ or src/trainfold/, or a git revision"
    )
    parser.add_argument("b", help="the version compared with it")
    parser.add_argument(
        "--configs", default="plain,full", help=f"comma-separated, from {', '.join(CONFIGS)} (default: plain,full)"
    )
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--optimizer",
        default="sgd-fused",
        choices=_optimizers(),
        help="every contender's, as bench.py's --optimizer (default: sgd-fused)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"unknown configuration(s) {sorted(unknown)}: choose from {', '.join(CONFIGS)}")
    if args.child:
        times = child(Path(args.child), configs, args.rounds, args.seed, args.optimizer)
        print(json.dumps({"optimizer": built_optimizer(), "times": times}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        materialize(args.a, "trainfold_a", Path(tmp))
        materialize(args.b, "trainfold_b", Path(tmp))
        runs = []
        for k in range(args.processes):
            cmd = [
                sys.executable,
                __file__,
                args.a,
                args.b,
                "--configs",
                args.configs,
                "--rounds",
                str(args.rounds),
                "--seed",
                str(args.seed + k),
                "--optimizer",
                args.optimizer,
                "--child",
                tmp,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            done = json.loads(out.strip().splitlines()[-1])
            runs.append(done["times"])
            built = done["optimizer"]
            print(f"process {k + 1}/{args.processes} done", file=sys.stderr, flush=True)
    print(f"optimizer: {args.optimizer}, built as {built}")
    report(runs, configs)


if __name__ == "__main__":
    main()
