"""Checkpoint cost: trainfold's save/load against Accelerate's save_state/load_state.

    python benchmarks/bench_checkpoint.py [--width 4096] [--layers 4] [--repeats 3]

A model of --layers Linear(width, width) (4 x 4096^2 floats: 256 MB) with SGD momentum
(another 256 MB of optimizer state). trainfold's save writes safetensors + JSON, fsyncs every
file and records a digest of each in a manifest (XXH3-128; SHA-256 before 0.3); its load reads
each file once, verifying it as it is read, before anything is changed. Accelerate's writes the
model as safetensors and the optimizer with torch.save, without verification. Each round runs
the four operations in turn, each into a fresh folder; reported: the medians over --repeats
rounds, the ratios of the medians, and where a verified load's time goes: reading the files
(``base/io.read_into``), digesting them (XXH3-128, and SHA-256 for comparison), and the rest
(decoding, checking and copying into the live model).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, latest_checkpoint, load_checkpoint, make_step, save_checkpoint


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def _breakdown(folder: Path, results: dict[str, list[float]]) -> None:
    """Time the parts of a verified load on its own files: reading them, digesting them with each algorithm."""
    import hashlib

    import xxhash

    from trainfold._src.base.io import read_into

    files = [p for p in folder.iterdir() if p.name != "MANIFEST.json"]
    t = time.perf_counter()
    data = [read_into(p, p.stat().st_size) for p in files]
    results.setdefault("load: read the files", []).append(time.perf_counter() - t)
    for name, new in (("XXH3-128", xxhash.xxh3_128), ("SHA-256", hashlib.sha256)):
        t = time.perf_counter()
        for d in data:
            new(d).hexdigest()
        key = f"load: {name} of the files" + (" (for comparison)" if name == "SHA-256" else "")
        results.setdefault(key, []).append(time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    x = torch.randn(2, args.width)
    state = make_step(ctx, lambda m, b: m(b).pow(2).mean())(state, x)  # fill the momentum buffers
    acc = ctx.accelerator
    results: dict[str, list[float]] = {
        k: [] for k in ("trainfold save", "trainfold load (verified)", "accelerate save_state", "accelerate load_state")
    }
    sizes = {}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        for r in range(args.repeats):
            root = Path(tmp, f"tf{r}")
            t = time.perf_counter()
            save_checkpoint(ctx, root, state)
            results["trainfold save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            load_checkpoint(ctx, root, state)
            results["trainfold load (verified)"].append(time.perf_counter() - t)
            sizes["trainfold"] = folder_mb(latest_checkpoint(root))
            out = Path(tmp, f"acc{r}")
            t = time.perf_counter()
            acc.save_state(str(out))
            results["accelerate save_state"].append(time.perf_counter() - t)
            t = time.perf_counter()
            acc.load_state(str(out))
            results["accelerate load_state"].append(time.perf_counter() - t)
            sizes["accelerate"] = folder_mb(out)
            _breakdown(latest_checkpoint(root), results)
            shutil.rmtree(root)
            shutil.rmtree(out)
    med = {k: statistics.median(v) for k, v in results.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} x Linear({args.width}, {args.width}), {params / 1e6:.0f}M parameters; SGD momentum\n")
    print("| operation | median s |\n| --- | ---: |")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} |")
    tf, ac = (
        med["trainfold save"] + med["trainfold load (verified)"],
        med["accelerate save_state"] + med["accelerate load_state"],
    )
    print(
        f"\nsave: {med['trainfold save'] / med['accelerate save_state']:.2f}x save_state; "
        f"verified load: {med['trainfold load (verified)'] / med['accelerate load_state']:.2f}x load_state"
    )
    rest = med["trainfold load (verified)"] - med["load: read the files"] - med["load: XXH3-128 of the files"]
    print(
        f"verified load: read {med['load: read the files']:.2f} s + XXH3-128 {med['load: XXH3-128 of the files']:.2f} s "
        f"(SHA-256 would take {med['load: SHA-256 of the files (for comparison)']:.2f} s) + decode, check and copy {rest:.2f} s"
    )
    print(f"save + load: trainfold {tf:.2f} s, Accelerate {ac:.2f} s: ratio {tf / ac:.2f}")
    print(f"size: trainfold {sizes['trainfold']:.0f} MB, Accelerate {sizes['accelerate']:.0f} MB")


if __name__ == "__main__":
    main()
