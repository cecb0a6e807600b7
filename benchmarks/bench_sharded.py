"""Sharded and background checkpoints: memory per process under FSDP2, and how long a save blocks the step.

    python benchmarks/bench_sharded.py memory [--width 4096] [--layers 4]
    python benchmarks/bench_sharded.py async  [--width 4096] [--layers 4] [--repeats 3]
    python benchmarks/bench_sharded.py dcp    [--width 4096] [--layers 4] [--repeats 3] [--engine fsdp2|ddp]

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

``dcp``: 2 CPU processes under FSDP2 (or DDP), the same model with Adam, against
``torch.distributed.checkpoint`` on the same state with its own ``FileSystemWriter``/``Reader``
(defaults: a file per process, fsynced): trainfold's blocking sharded save against ``dcp.save``
(``get_state_dict`` included), the time a background save blocks the caller against
``dcp.async_save``'s, and trainfold's verified load against ``dcp.load`` + ``set_state_dict``.
Rounds interleaved, each save into a fresh folder, the order within a round shuffled; every time is
the slowest process's (a barrier before and after), the median over --repeats.
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
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


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
    return {
        "model MB": full / mb,
        "own shard MB (weights + Adam)": shard / mb,
        "sharded save: peak rise MB": sharded / mb,
        "gathering the state dict: peak rise MB": gathered / mb,
    }


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
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "blocking save",
            "blocking save (sharded)",
            "async save: step blocked",
            "async save: written and committed",
            "accelerate save_state",
        )
    }
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
    print(
        f"{sum(p.numel() for p in model.parameters()) * 4 / 2**20:.0f} MB of weights + as much optimizer state, medians of {args.repeats}"
    )
    for k, v in times.items():
        print(f"{k:36s} {statistics.median(v):7.3f} s  ({statistics.median(v) / blocking:.2f} x blocking save)")
    ctx.close()


def _versus_dcp_on_this_rank(width: int, layers: int, root: str, engine: str, repeats: int) -> dict[str, list[float]]:
    import random
    import shutil

    import helpers
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from trainfold import Context, TrainState, load_checkpoint, make_step, save_checkpoint

    ctx = Context(accelerator=helpers.fsdp2_accelerator() if engine == "fsdp2" else Accelerator(cpu=True))
    model = _model(width, layers)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))
    state = make_step(ctx, lambda m, b: m(b).pow(2).mean())(state, torch.randn(2, width))  # fill Adam's moments
    model, optimizer = state.model, state.optimizer.optimizer
    times: dict[str, list[float]] = {}

    def timed(name: str, work) -> None:
        dist.barrier()
        t = time.perf_counter()
        work()
        dist.barrier()
        times.setdefault(name, []).append(time.perf_counter() - t)

    def dcp_state() -> dict[str, object]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def dcp_async(path: str) -> None:
        t = time.perf_counter()
        pending = dcp.async_save(dcp_state(), storage_writer=dcp.FileSystemWriter(path))
        times.setdefault("DCP async_save: caller blocked", []).append(time.perf_counter() - t)
        pending.result()

    def tf_async(path: str) -> None:
        t = time.perf_counter()
        save_checkpoint(ctx, path, state, async_save=True)
        times.setdefault("trainfold background save: caller blocked", []).append(time.perf_counter() - t)
        ctx.wait_for_checkpoints()

    def dcp_load(path: str) -> None:
        sd = dcp_state()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    order = random.Random(0)
    for r in range(repeats):
        base = Path(root, f"round{r}")
        saves = [
            (
                "trainfold save_checkpoint (sharded, blocking)",
                lambda: save_checkpoint(ctx, base / "tf", state, sharded=True),
            ),
            (
                "DCP save (FileSystemWriter)",
                lambda: dcp.save(dcp_state(), storage_writer=dcp.FileSystemWriter(str(base / "dcp"))),
            ),
            ("trainfold background save: until committed", lambda: tf_async(str(base / "tf-async"))),
            ("DCP async_save: until written", lambda: dcp_async(str(base / "dcp-async"))),
        ]
        order.shuffle(saves)
        for name, work in saves:
            timed(name, work)
        loads = [
            ("trainfold load_checkpoint (verified)", lambda: load_checkpoint(ctx, base / "tf", state)),
            ("DCP load + set_state_dict (FileSystemReader)", lambda: dcp_load(str(base / "dcp"))),
        ]
        order.shuffle(loads)
        for name, work in loads:
            timed(name, work)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(base)
    ctx.close()
    return times


def versus_dcp(args: argparse.Namespace) -> None:
    from trainfold import testing

    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        ranks = testing.run_distributed(
            _versus_dcp_on_this_rank, args.width, args.layers, tmp, args.engine, args.repeats, nprocs=2, timeout=3600
        )
    times = ranks[0]  # with the barriers, every process measured the same spans
    state_mb = 3 * args.layers * (args.width * args.width + args.width) * 4 / 2**20
    print(
        f"{args.engine}, 2 processes, {state_mb:.0f} MB of weights and Adam moments in all; medians of {args.repeats} rounds"
    )
    median = {k: statistics.median(v) for k, v in times.items()}
    pairs = [
        ("trainfold save_checkpoint (sharded, blocking)", "DCP save (FileSystemWriter)"),
        ("trainfold background save: caller blocked", "DCP async_save: caller blocked"),
        ("trainfold background save: until committed", "DCP async_save: until written"),
        ("trainfold load_checkpoint (verified)", "DCP load + set_state_dict (FileSystemReader)"),
    ]
    for ours, theirs in pairs:
        print(
            f"{ours:48s} {median[ours]:7.3f} s   {theirs:46s} {median[theirs]:7.3f} s   ratio {median[ours] / median[theirs]:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["memory", "async", "dcp"])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=["fsdp2", "ddp"], default="fsdp2")
    args = parser.parse_args()
    {"memory": memory, "async": asynchronous, "dcp": versus_dcp}[args.what](args)


if __name__ == "__main__":
    main()
