"""Step-overhead harness: trainfold against a raw PyTorch loop, the canonical Accelerate loop and peers.

    python benchmarks/bench.py                 # tiny + compute-bound models, 15 interleaved rounds
    python benchmarks/bench.py --quick         # fewer rounds (a smoke run)
    python benchmarks/bench.py --scaling       # also: trainfold's per-step cost at 1k, 10k, 50k steps
    python benchmarks/bench.py --json out.json
    python benchmarks/bench.py --device cuda   # on a GPU: tiny + a GPU-sized compute-bound model
    python benchmarks/bench.py --device cuda --pin   # ... with pinned batches copied without blocking

Every contender trains the same model on the same synthetic data, one epoch per round;
rounds are interleaved (A B C A B C ...) so that drift of the machine hits all alike.
Reported: microseconds per step (median, min, max over rounds), the ratio to the raw
PyTorch loop and to the canonical Accelerate loop (the median of the per-round ratios, which
cancels the drift of a shared machine), and the peak resident memory of the
process. pytorch-accelerated's Trainer, Lightning Fabric and Lightning's Trainer are timed
when installed (pip install 'trainfold[bench]'), with their progress bars and printing off.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

MODELS = {
    # name: (layer sizes, batch size, batches per round)
    "tiny": ((32, 64, 10), 32, 256),
    "compute": ((256, 1024, 1024, 10), 128, 32),
    # compute-bound on a GPU (about 0.3 TFLOP a step), the default there instead of "compute".
    # Its batches are 8 MB: with --pin the host keeps ahead of the GPU only while collating them
    # stays cheap (see README: with 128 steps a round it did not, on the machine measured)
    "compute_gpu": ((4096, 8192, 8192, 10), 512, 32),
    # compute-bound on a GPU with cheap batches (0.5 MB; about 0.8 TFLOP a step): collating a batch
    # costs ~1% of a step, so the loader's per-epoch work cannot mask a per-step cost of the loop
    "compute_gpu_narrow": ((256, 16384, 16384, 10), 512, 64),
}
DEFAULT_MODELS = {"cpu": ["tiny", "compute"], "cuda": ["tiny", "compute_gpu"]}

#: where every contender trains ("cpu" or "cuda"); the data starts on the host, as from a DataLoader
DEVICE = "cpu"
#: pinned batches and non-blocking copies to the GPU, for every contender (--pin)
PIN = False


def loader(ds, batch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=batch, pin_memory=PIN)


def accelerator():
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    return Accelerator(cpu=DEVICE == "cpu", dataloader_config=DataLoaderConfiguration(non_blocking=PIN))


def make_model(sizes: tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(DEVICE)


def make_data(sizes: tuple[int, ...], batch: int, batches: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = batch * batches
    return torch.utils.data.TensorDataset(torch.randn(n, sizes[0], generator=g), torch.randint(0, sizes[-1], (n,), generator=g))


def OPTIMIZER(params, lr):
    """Fused SGD for every contender: the same update everywhere, and one that nan_guard can skip on the device."""
    return torch.optim.SGD(params, lr=lr, fused=FUSED)


FUSED = True


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


# --- contenders: each returns a function that runs one epoch ---------------------------------


def raw(sizes, ds, batch):
    model = make_model(sizes)
    opt = OPTIMIZER(model.parameters(), lr=0.01)
    dl = loader(ds, batch)
    move, non_blocking = DEVICE != "cpu", PIN

    def epoch():
        for x, y in dl:
            if move:
                x, y = x.to(DEVICE, non_blocking=non_blocking), y.to(DEVICE, non_blocking=non_blocking)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return epoch


def accelerate_loop(sizes, ds, batch):
    acc = accelerator()
    model = make_model(sizes)
    model, opt, dl = acc.prepare(model, OPTIMIZER(model.parameters(), lr=0.01), loader(ds, batch))

    def epoch():
        model.train()
        for x, y in dl:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()

    return epoch


def _trainfold(sizes, ds, batch, full: bool):
    from toolz import compose

    from trainfold import Context, TrainState, log_every, make_step, nan_guard, progress_bar, run_epoch

    ctx = Context(accelerator=accelerator())
    model = make_model(sizes)
    box = [TrainState.create(ctx, model=model, optimizer=OPTIMIZER(model.parameters(), lr=0.01))]
    (dl,) = ctx.prepare_loaders(loader(ds, batch))
    step = make_step(ctx, loss_fn)
    if full:
        step = compose(progress_bar(ctx, total=len(dl), force=True, file=io.StringIO()), log_every(ctx, 50), nan_guard(3))(step)

    def epoch():
        box[0] = run_epoch(ctx, step, dl, box[0])

    return epoch


def trainfold_plain(sizes, ds, batch):
    return _trainfold(sizes, ds, batch, full=False)


def trainfold_full(sizes, ds, batch):
    return _trainfold(sizes, ds, batch, full=True)


def pytorch_accelerated(sizes, ds, batch):
    from pytorch_accelerated import Trainer

    model = make_model(sizes)
    trainer = Trainer(model, loss_func=torch.nn.CrossEntropyLoss(), optimizer=OPTIMIZER(model.parameters(), lr=0.01), callbacks=[])

    def epoch():
        trainer.train(train_dataset=ds, num_epochs=1, per_device_batch_size=batch, train_dataloader_kwargs={"shuffle": False})

    return epoch


def _quiet_lightning() -> None:
    """Lightning's info lines off; after its import, which sets its loggers to INFO."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def lightning_fabric(sizes, ds, batch):
    from lightning.fabric import Fabric

    _quiet_lightning()

    fabric = Fabric(accelerator=DEVICE, devices=1)
    model = make_model(sizes)
    model, opt = fabric.setup(model, OPTIMIZER(model.parameters(), lr=0.01))
    dl = fabric.setup_dataloaders(loader(ds, batch))

    def epoch():
        for x, y in dl:
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()

    return epoch


def lightning_trainer(sizes, ds, batch):
    import lightning as L

    _quiet_lightning()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model(sizes)

        def training_step(self, b, i):
            return loss_fn(self.net, b)

        def configure_optimizers(self):
            return OPTIMIZER(self.parameters(), lr=0.01)

    module = Module()
    dl = loader(ds, batch)

    def epoch():
        trainer = L.Trainer(max_epochs=1, accelerator=DEVICE, devices=1, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(module, dl)

    return epoch


CONTENDERS: dict[str, Callable] = {
    "raw PyTorch": raw,
    "Accelerate loop": accelerate_loop,
    "trainfold run_epoch": trainfold_plain,
    "trainfold + log_every(50) + progress_bar + nan_guard": trainfold_full,
    "pytorch-accelerated Trainer": pytorch_accelerated,
    "Lightning Fabric": lightning_fabric,
    "Lightning Trainer": lightning_trainer,
}
OPTIONAL = {"pytorch-accelerated Trainer": "pytorch_accelerated", "Lightning Fabric": "lightning", "Lightning Trainer": "lightning"}


def available(name: str) -> bool:
    module = OPTIONAL.get(name)
    if module is None:
        return True
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def bench_model(name: str, rounds: int) -> dict:
    sizes, batch, batches = MODELS[name]
    ds = make_data(sizes, batch, batches)
    epochs = {}
    reset_accelerate()  # once: every contender uses the same settings (Accelerate's state is process-wide)
    for contender, build in CONTENDERS.items():
        if available(contender):
            epochs[contender] = build(sizes, ds, batch)
            epochs[contender]()  # warm-up round, not timed
    times: dict[str, list[float]] = {k: [] for k in epochs}
    for _ in range(rounds):
        for contender, run in epochs.items():
            t0 = time.perf_counter()
            run()
            if DEVICE != "cpu":
                torch.cuda.synchronize()
            times[contender].append((time.perf_counter() - t0) / batches * 1e6)
    raw, acc = times["raw PyTorch"], times["Accelerate loop"]

    def paired(v: list[float], base: list[float]) -> float:
        # the median of per-round ratios: rounds are interleaved, so drift of the machine cancels
        return statistics.median(a / b for a, b in zip(v, base))

    return {
        c: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v),
            "vs_raw": paired(v, raw), "vs_accelerate": paired(v, acc)}
        for c, v in times.items()
    }


def scaling(steps_list=(1_000, 10_000, 50_000)) -> dict:
    """trainfold's per-step cost over runs of growing length (tiny model): constant if nothing accumulates."""
    from trainfold import Context, TrainState, make_step, run_epoch

    sizes, batch, _ = MODELS["tiny"]
    out = {}
    for steps in steps_list:
        reset_accelerate()
        ds = make_data(sizes, batch, 1000)
        ctx = Context(accelerator=accelerator())
        model = make_model(sizes)
        state = TrainState.create(ctx, model=model, optimizer=OPTIMIZER(model.parameters(), lr=0.01))
        (dl,) = ctx.prepare_loaders(loader(ds, batch))
        step = make_step(ctx, loss_fn)
        rss0 = rss_mb()
        t0 = time.perf_counter()
        while state.micro_step < steps:
            state = run_epoch(ctx, step, dl, state)
        out[steps] = {"us_per_step": (time.perf_counter() - t0) / state.micro_step * 1e6, "rss_growth_mb": rss_mb() - rss0}
    return out


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def import_time() -> dict:
    """Seconds to import torch+accelerate, and then trainfold alone (fresh interpreters, best of 5)."""
    code = ("import time; t0=time.perf_counter(); import torch, accelerate, attrs, toolz; t1=time.perf_counter(); "
            "import trainfold; t2=time.perf_counter(); print(t1-t0, t2-t1)")
    runs = [tuple(map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()))
            for _ in range(5)]
    return {"torch+accelerate": min(r[0] for r in runs), "trainfold (on top)": min(r[1] for r in runs)}


def machine() -> str:
    gpu = f", {torch.cuda.get_device_name()}{', pinned non-blocking batches' if PIN else ''}" if DEVICE != "cpu" else ""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {'fused' if FUSED else 'foreach'} SGD")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 rounds, tiny model only, no import timing")
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), help="default: tiny and the device's compute-bound model")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--pin", action="store_true", help="pinned batches, copied to the GPU without blocking (every contender)")
    parser.add_argument("--json")
    parser.add_argument("--unfused", action="store_true", help="plain (foreach) SGD: nan_guard then reads a flag per update")
    args = parser.parse_args()
    global FUSED, DEVICE, PIN
    FUSED = not args.unfused
    DEVICE, PIN = args.device, args.pin
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the harness measures framework overhead, not BLAS threading
    models = ["tiny"] if args.quick else (args.models or DEFAULT_MODELS[DEVICE])
    rounds = 3 if args.quick else args.rounds

    results = {"machine": machine(), "rounds": rounds, "models": {}}
    print(f"# {results['machine']}; {rounds} interleaved rounds\n")
    for name in models:
        sizes, batch, batches = MODELS[name]
        res = bench_model(name, rounds)
        results["models"][name] = res
        print(f"## {name}: MLP {'-'.join(map(str, sizes))}, batch {batch}, {batches} steps a round\n")
        print("| loop | median us/step | min | max | vs raw (paired median) | vs Accelerate loop |\n| --- | ---: | ---: | ---: | ---: | ---: |")
        for c, r in res.items():
            print(f"| {c} | {r['median_us']:.1f} | {r['min_us']:.1f} | {r['max_us']:.1f} | {r['vs_raw']:.3f} | {r['vs_accelerate']:.3f} |")
        print()
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory of the harness: {results['peak_rss_mb']:.0f} MB\n")
    if DEVICE != "cpu":
        results["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
        print(f"peak GPU memory allocated: {results['peak_gpu_mb']:.0f} MB\n")
    if not args.quick:
        results["import_s"] = import_time()
        print("import time (s): " + ", ".join(f"{k} {v:.3f}" for k, v in results["import_s"].items()) + "\n")
    if args.scaling:
        results["scaling"] = scaling()
        print("| steps | trainfold us/step | RSS growth (MB) |\n| ---: | ---: | ---: |")
        for steps, r in results["scaling"].items():
            print(f"| {steps} | {r['us_per_step']:.1f} | {r['rss_growth_mb']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
