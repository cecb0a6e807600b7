"""What an adapter checkpoint saves against one of the whole model: bytes, and the time ``save_checkpoint`` takes.

A frozen base of ``--layers`` square ``Linear`` layers of ``--width`` (a 4096-wide base of 4 layers: 67M parameters,
268 MB in float32) with rank-``--rank`` LoRA adapters on each, AdamW over the adapters, one update trained. Each round
saves the same state twice, as an adapter checkpoint (the frozen parameters by fingerprint) and with
``save_frozen=True`` (every parameter), in alternating order, each into a fresh root; the times are medians over the
rounds. Every adapter save hashes the base (its first round is reported apart too).

    python benchmarks/bench_adapters.py [--width 4096] [--layers 4] [--rank 8] [--rounds 5] [--json benchmarks/results_adapters.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, latest_checkpoint, make_step, save_checkpoint, testing


class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(0.01 * torch.randn(rank, base.in_features))
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def setup(width: int, layers: int, rank: int):
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Sequential(*(LoRALinear(torch.nn.Linear(width, width), rank) for _ in range(layers)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    step = make_step(ctx, lambda m, batch: m(batch).square().mean())
    state = step(state, torch.randn(8, width))
    return ctx, state


def bytes_of(root: Path) -> int:
    doc = json.loads((latest_checkpoint(root) / "MANIFEST.json").read_text())
    return sum(e["size"] for e in doc["files"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    ctx, state = setup(args.width, args.layers, args.rank)
    params = list(state.model.parameters())
    trainable, frozen = (
        sum(p.numel() for p in params if p.requires_grad),
        sum(p.numel() for p in params if not p.requires_grad),
    )
    times: dict[str, list[float]] = {"adapters": [], "full": []}
    sizes: dict[str, int] = {}
    first_adapter_save = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["adapters", "full"] if r % 2 == 0 else ["full", "adapters"]
            for kind in order:
                root = Path(tmp, f"{kind}-{r}")
                began = time.perf_counter()
                save_checkpoint(ctx, root, state, save_frozen=kind == "full")
                took = time.perf_counter() - began
                if kind == "adapters" and first_adapter_save is None:
                    first_adapter_save = took  # hashes the base: not one of the timed rounds
                else:
                    times[kind].append(took)
                sizes[kind] = bytes_of(root)
    ctx.close()
    result = {
        "base": {
            "width": args.width,
            "layers": args.layers,
            "rank": args.rank,
            "trainable": trainable,
            "frozen": frozen,
        },
        "bytes": sizes,
        "bytes_ratio": sizes["adapters"] / sizes["full"],
        "save_s": {k: statistics.median(v) for k, v in times.items()},
        "first_adapter_save_s": first_adapter_save,
        "rounds": args.rounds,
        "torch": torch.__version__,
    }
    result["save_ratio"] = result["save_s"]["adapters"] / result["save_s"]["full"]
    print(f"base: {frozen:,} frozen, {trainable:,} trainable ({100 * trainable / (trainable + frozen):.2f}%)")
    print(
        f"checkpoint bytes: adapters {sizes['adapters']:,}, full {sizes['full']:,} ({100 * result['bytes_ratio']:.2f}%)"
    )
    print(
        f"save (median of {len(times['full'])}): adapters {result['save_s']['adapters'] * 1000:.1f} ms, full "
        f"{result['save_s']['full'] * 1000:.1f} ms ({100 * result['save_ratio']:.1f}%); the first adapter save, "
        f"hashing the base: {first_adapter_save * 1000:.1f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
