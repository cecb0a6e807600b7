"""Sharded and background checkpoints: memory per process under FSDP2, and how long a save blocks the step.

    python benchmarks/bench_sharded.py memory [--width 4096] [--layers 4]
    python benchmarks/bench_sharded.py async  [--width 4096] [--layers 4] [--repeats 3]

``memory``: 2 CPU processes (gloo) under Accelerate's FSDP2 (the test helper's way: the
distributed type set after the Accelerator is built), a model of --layers Linear(width, width)
with Adam. Each process samples the memory it has allocated (glibc's ``mallinfo2``) every
millisecond while it (a) saves a sharded checkpoint and (b) gathers the whole state dict as a
gathered save must (``accelerator.get_state_dict``). Printed per process: the model's size, the
process's own shard (weights and Adam's two moments), and the peak rise of allocated memory.

``async``: one process, the same model with SGD momentum. The time ``save_checkpoint`` keeps the
caller for a blocking save, for ``async_save=True`` (the step is blocked only while the state is
copied to host memory; the write, fsync, hashing and commit go on in a thread) and for Accelerate's
``save_state``; medians over --repeats, each into a fresh folder.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def _in_use() -> int:
    """Bytes the process has allocated and not freed (glibc's mallinfo2: heap in use + mapped blocks).

    Not resident memory: pages a freed allocation leaves behind stay resident and are reused, so a
    rise in resident memory would miss an allocation that fits in them (the whole model, freed by
    ``fully_shard``, leaves 256 MB of such pages).
    """
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _peak_rise(work) -> int:
    """The most memory allocated at once while ``work`` runs, above the moment before (sampled every millisecond)."""
    base, peak, done = _in_use(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _in_use())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    try:
        kept = work()  # what it returns is held until measured (a gathered state dict is written before it is freed)
        after = _in_use()
    finally:
        done.set()
        t.join()
    del kept
    return max(peak[0], after) - base


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _memory_on_this_rank(width: int, layers: int, root: str) -> dict[str, float]:
    import helpers

    from trainfold import Context, TrainState, make_step, save_checkpoint

    ctx = Context(accelerator=helpers.fsdp2_accelerator())
    model = _model(width, layers)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))
    state = make_step(ctx, lambda m, b: m(b).pow(2).mean())(state, torch.randn(2, width))  # fill Adam's moments
    shard = 3 * sum(p.to_local().numel() * p.element_size() for p in state.model.parameters())  # weights + 2 moments
    sharded = _peak_rise(lambda: save_checkpoint(ctx, root, state))
    gathered = _peak_rise(lambda: ctx.accelerator.get_state_dict(state.model))
    ctx.close()
    mb = 2**20
    return {"model MB": full / mb, "own shard MB (weights + Adam)": shard / mb, "sharded save: peak rise MB": sharded / mb,
            "gathering the state dict: peak rise MB": gathered / mb}


def memory(args: argparse.Namespace) -> None:
    from trainfold import testing

    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        ranks = testing.run_distributed(_memory_on_this_rank, args.width, args.layers, tmp, nprocs=2, timeout=600)
    for r, figures in enumerate(ranks):
        print(f"process {r}: " + ", ".join(f"{k} {v:.0f}" for k, v in figures.items()))


def asynchronous(args: argparse.Namespace) -> None:
    from accelerate import Accelerator

    from trainfold import Context, TrainState, make_step, save_checkpoint

    ctx = Context(accelerator=Accelerator(cpu=True))
    model = _model(args.width, args.layers)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    state = make_step(ctx, lambda m, b: m(b).pow(2).mean())(state, torch.randn(2, args.width))
    acc = ctx.accelerator
    times: dict[str, list[float]] = {k: [] for k in ("blocking save", "blocking save (sharded)", "async save: step blocked",
                                                     "async save: written and committed", "accelerate save_state")}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        for r in range(args.repeats):
            for sharded in (False, True):
                t = time.perf_counter()
                save_checkpoint(ctx, Path(tmp, f"b{r}{sharded}"), state, sharded=sharded)
                times["blocking save (sharded)" if sharded else "blocking save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            save_checkpoint(ctx, Path(tmp, f"a{r}"), state, async_save=True)
            times["async save: step blocked"].append(time.perf_counter() - t)
            ctx.wait_for_checkpoints()
            times["async save: written and committed"].append(time.perf_counter() - t)
            t = time.perf_counter()
            acc.save_state(str(Path(tmp, f"acc{r}")))
            times["accelerate save_state"].append(time.perf_counter() - t)
    blocking = statistics.median(times["blocking save"])
    print(f"{sum(p.numel() for p in model.parameters()) * 4 / 2**20:.0f} MB of weights + as much optimizer state, medians of {args.repeats}")
    for k, v in times.items():
        print(f"{k:36s} {statistics.median(v):7.3f} s  ({statistics.median(v) / blocking:.2f} x blocking save)")
    ctx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["memory", "async"])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    memory(args) if args.what == "memory" else asynchronous(args)


if __name__ == "__main__":
    main()
