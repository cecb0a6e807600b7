"""Step-overhead harness: trainfold against a raw PyTorch loop, the canonical Accelerate loop and peers.

    python benchmarks/bench.py                 # tiny + compute-bound models, 15 interleaved rounds
    python benchmarks/bench.py --processes 5 --rounds 6   # the same in 5 fresh processes, pooled
    python benchmarks/bench.py --quick         # fewer rounds (a smoke run)
    python benchmarks/bench.py --scaling       # also: trainfold's per-step cost at 1k, 10k, 50k steps
    python benchmarks/bench.py --json out.json
    python benchmarks/bench.py --device cuda   # on a GPU: tiny + a GPU-sized compute-bound model
    python benchmarks/bench.py --device cuda --pin   # ... with pinned batches copied without blocking

Every contender trains the same model on the same synthetic data, one epoch per round;
rounds are interleaved (every contender once per round) so that drift of the machine hits
all alike, and the order in which the contenders are built and run is shuffled (``--seed``):
on the 2-core machine measured, two identical contenders in one process read up to 10% apart,
so a fixed order would hand one loop a lasting advantage. ``--processes N`` repeats the run
in N fresh interpreters with seeds 0..N-1 and pools the rounds.
Reported: microseconds per step (median, min, max over rounds), the ratio to the raw
PyTorch loop and to the canonical Accelerate loop (the median of the per-round ratios, which
cancels the drift of a shared machine), the lowest and highest per-process ratio, and the
peak resident memory of the process. pytorch-accelerated's Trainer, Lightning Fabric and
Lightning's Trainer are timed when installed (pip install 'trainfold[bench]'), with their
progress bars and printing off.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
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
    return torch.utils.data.TensorDataset(
        torch.randn(n, sizes[0], generator=g), torch.randint(0, sizes[-1], (n,), generator=g)
    )


#: the optimizers ``--optimizer`` chooses from, as a user builds them (torch's defaults otherwise)
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd-fused": lambda params, lr: torch.optim.SGD(params, lr=lr, fused=True),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "adamw-fused": lambda params, lr: torch.optim.AdamW(params, lr=lr, fused=True),
}

#: every contender's optimizer (--optimizer); fused SGD by default: the cheapest update, so the loops' own
#: cost is the largest share of a step, and one that nan_guard can skip on the device
OPTIMIZER_NAME = "sgd-fused"


def OPTIMIZER(params, lr):
    """The same optimizer for every contender (``OPTIMIZER_NAME``)."""
    return OPTIMIZERS[OPTIMIZER_NAME](params, lr)


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


def trainfold_loop(sizes, ds, batch, config: str = "plain", package: str = "trainfold"):
    """trainfold's run_epoch, ``config`` "plain", "guard" (nan_guard), "full" (progress bar, log_every(50),
    nan_guard), "logged" (log_every(50)) or "watched" (log_every(50, watch=True)); ``package`` is the module to import
    it from (benchmarks/ab.py loads two versions side by side)."""
    import importlib

    from toolz import compose

    t = importlib.import_module(package)
    ctx = t.Context(accelerator=accelerator())
    model = make_model(sizes)
    box = [t.TrainState.create(ctx, model=model, optimizer=OPTIMIZER(model.parameters(), lr=0.01))]
    (dl,) = ctx.prepare_loaders(loader(ds, batch))
    if config not in ("plain", "guard", "full", "logged", "watched"):
        raise ValueError(f"unknown trainfold configuration {config!r}: plain, guard, full, logged or watched")
    guarded = config in ("guard", "full")
    if hasattr(t, "Stage"):  # since 0.2 nan_guard is a stage of make_step
        step = t.make_step(ctx, loss_fn, stages=[t.nan_guard(3)] if guarded else [])
    else:  # an older version (ab.py compares against git revisions): nan_guard wrapped the step
        step = t.make_step(ctx, loss_fn)
        step = t.nan_guard(3)(step) if guarded else step
    if config == "full":
        step = compose(t.progress_bar(ctx, total=len(dl), force=True, file=io.StringIO()), t.log_every(ctx, 50))(step)
    if config in ("logged", "watched"):
        step = t.log_every(ctx, 50, **({"watch": True} if config == "watched" else {}))(step)

    def epoch():
        box[0] = t.run_epoch(ctx, step, dl, box[0])

    return epoch


def trainfold_plain(sizes, ds, batch):
    return trainfold_loop(sizes, ds, batch, "plain")


def trainfold_full(sizes, ds, batch):
    return trainfold_loop(sizes, ds, batch, "full")


def pytorch_accelerated(sizes, ds, batch):
    from pytorch_accelerated import Trainer

    model = make_model(sizes)
    trainer = Trainer(
        model, loss_func=torch.nn.CrossEntropyLoss(), optimizer=OPTIMIZER(model.parameters(), lr=0.01), callbacks=[]
    )

    def epoch():
        trainer.train(
            train_dataset=ds, num_epochs=1, per_device_batch_size=batch, train_dataloader_kwargs={"shuffle": False}
        )

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
        trainer = L.Trainer(
            max_epochs=1,
            accelerator=DEVICE,
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(module, dl)

    return epoch


def raw_on_accelerate_loader(sizes, ds, batch):
    """The raw loop's body over Accelerate's prepared loader (DataLoaderShard) as ``ctx.prepare_loaders`` prepares it
    for a trainfold run (no device placement on a CPU device): what the loader wrapper costs that run."""
    from trainfold import Context

    model = make_model(sizes)
    opt = OPTIMIZER(model.parameters(), lr=0.01)
    (dl,) = Context(accelerator=accelerator()).prepare_loaders(loader(ds, batch))

    def epoch():
        for x, y in dl:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return epoch


def trainfold_step_loop(sizes, ds, batch):
    """trainfold's step called in a plain ``for`` loop over the prepared loader: the step without run_epoch."""
    from trainfold import Context, TrainState, make_step

    ctx = Context(accelerator=accelerator())
    model = make_model(sizes)
    box = [TrainState.create(ctx, model=model, optimizer=OPTIMIZER(model.parameters(), lr=0.01))]
    (dl,) = ctx.prepare_loaders(loader(ds, batch))
    step = make_step(ctx, loss_fn)

    def epoch():
        state = box[0]
        for b in dl:
            state = step(state, b)
        box[0] = state

    return epoch


#: ``--breakdown``: contenders between the raw loop and run_epoch, one wrapper more each
BREAKDOWN: dict[str, Callable] = {
    "raw body on Accelerate's loader": raw_on_accelerate_loader,
    "trainfold step in a for loop": trainfold_step_loop,
}

CONTENDERS: dict[str, Callable] = {
    "raw PyTorch": raw,
    "Accelerate loop": accelerate_loop,
    "trainfold run_epoch": trainfold_plain,
    "trainfold + log_every(50) + progress_bar + nan_guard": trainfold_full,
    "pytorch-accelerated Trainer": pytorch_accelerated,
    "Lightning Fabric": lightning_fabric,
    "Lightning Trainer": lightning_trainer,
}
OPTIONAL = {
    "pytorch-accelerated Trainer": "pytorch_accelerated",
    "Lightning Fabric": "lightning",
    "Lightning Trainer": "lightning",
}


def available(name: str) -> bool:
    module = OPTIONAL.get(name)
    if module is None:
        return True
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def bench_model(name: str, rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Per-round microseconds per step of every contender, in rounds of interleaved epochs.

    The contenders are built, and each round is run, in an order shuffled by ``seed``: where a
    contender sits in the heap and in the round must not favour one of them.
    """
    sizes, batch, batches = MODELS[name]
    ds = make_data(sizes, batch, batches)
    order = random.Random(seed)
    names = [c for c in CONTENDERS if available(c)]
    skipped = [c for c in CONTENDERS if c not in names]
    if skipped:  # said, not silent: the table would otherwise just lack them
        print(
            f"skipped (not installed; `make bench` installs them with pip install -e '.[bench]'): {', '.join(skipped)}",
            file=sys.stderr,
        )
    build = names[:]
    order.shuffle(build)
    epochs = {}
    reset_accelerate()  # once: every contender uses the same settings (Accelerate's state is process-wide)
    for contender in build:
        epochs[contender] = CONTENDERS[contender](sizes, ds, batch)
        epochs[contender]()  # warm-up round, not timed
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(rounds):
        this_round = names[:]
        order.shuffle(this_round)
        for contender in this_round:
            t0 = time.perf_counter()
            epochs[contender]()
            if DEVICE != "cpu":
                torch.cuda.synchronize()
            times[contender].append((time.perf_counter() - t0) / batches * 1e6)
    return times


def summarise(runs: list[dict[str, list[float]]]) -> dict:
    """Per contender: median, min, max microseconds per step over every round of every process, and ratios.

    A ratio is the median of per-round ratios (rounds are interleaved, so drift of the machine
    cancels), pooled over the processes; ``vs_raw_range`` is the lowest and highest per-process
    median ratio, the spread that heap layout and the machine leave between fresh processes.
    """

    def paired(run: dict[str, list[float]], c: str, base: str) -> list[float]:
        return [a / b for a, b in zip(run[c], run[base])]

    out = {}
    for c in runs[0]:
        v = [t for run in runs for t in run[c]]
        per_process = [statistics.median(paired(run, c, "raw PyTorch")) for run in runs]
        out[c] = {
            "median_us": statistics.median(v),
            "min_us": min(v),
            "max_us": max(v),
            "vs_raw": statistics.median([r for run in runs for r in paired(run, c, "raw PyTorch")]),
            "vs_accelerate": statistics.median([r for run in runs for r in paired(run, c, "Accelerate loop")]),
            "vs_raw_range": [min(per_process), max(per_process)],
        }
    return out


def in_processes(
    args: argparse.Namespace, models: list[str], rounds: int
) -> tuple[dict[str, list[dict[str, list[float]]]], dict[str, float]]:
    """Run ``bench.py --seed i`` in ``args.processes`` fresh interpreters, one after another.

    Returns their per-round times by model, and the largest of their peaks (:func:`peaks`).
    """
    runs: dict[str, list[dict[str, list[float]]]] = {m: [] for m in models}
    peak: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            out = os.path.join(tmp, f"{i}.json")
            cmd = [
                sys.executable,
                __file__,
                "--seed",
                str(i),
                "--rounds",
                str(rounds),
                "--models",
                *models,
                "--device",
                args.device,
                "--times-json",
                out,
            ]
            cmd += ["--pin"] * args.pin + ["--optimizer", args.optimizer] + ["--breakdown"] * args.breakdown
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                child = json.load(f)
            for m, times in child["times"].items():
                runs[m].append(times)
            peak = {k: max(v, peak.get(k, 0.0)) for k, v in child["peaks"].items()}
            print(f"process {i + 1}/{args.processes} done", file=sys.stderr, flush=True)
    return runs, peak


def scaling(steps_list=(1_000, 10_000, 50_000)) -> dict:
    """trainfold's per-step cost over runs of growing length (tiny model), after a warm-up epoch: constant if nothing accumulates."""
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
        state = run_epoch(ctx, step, dl, state)  # warm-up epoch: one-time allocations are not growth
        start, rss0 = state.micro_step, rss_mb()
        t0 = time.perf_counter()
        while state.micro_step - start < steps:
            state = run_epoch(ctx, step, dl, state)
        done = state.micro_step - start
        out[steps] = {"us_per_step": (time.perf_counter() - t0) / done * 1e6, "rss_growth_mb": rss_mb() - rss0}
    return out


def peaks() -> dict[str, float]:
    """This process's peak resident memory and (on a GPU) peak GPU memory allocated, in MB."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if DEVICE != "cpu":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def import_time() -> dict:
    """Seconds to import torch+accelerate, and then trainfold alone (fresh interpreters, best of 5)."""
    code = (
        "import time; t0=time.perf_counter(); import torch, accelerate, attrs, toolz; t1=time.perf_counter(); "
        "import trainfold; t2=time.perf_counter(); print(t1-t0, t2-t1)"
    )
    runs = [
        tuple(
            map(
                float,
                subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(),
            )
        )
        for _ in range(5)
    ]
    return {"torch+accelerate": min(r[0] for r in runs), "trainfold (on top)": min(r[1] for r in runs)}


def machine() -> str:
    gpu = f", {torch.cuda.get_device_name()}{', pinned non-blocking batches' if PIN else ''}" if DEVICE != "cpu" else ""
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {OPTIMIZER_NAME}"
    )


def main() -> None:
    global OPTIMIZER_NAME, DEVICE, PIN
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 rounds, tiny model only, no import timing")
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument(
        "--models", nargs="*", choices=list(MODELS), help="default: tiny and the device's compute-bound model"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--pin", action="store_true", help="pinned batches, copied to the GPU without blocking (every contender)"
    )
    parser.add_argument("--json")
    parser.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default=OPTIMIZER_NAME,
        help="every contender's optimizer (default: fused SGD; unfused, nan_guard reads a flag per update)",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="repeat in this many fresh processes and pool the rounds"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffles the order contenders are built and run in")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also the raw body on Accelerate's loader, and trainfold's step in a plain for loop (no run_epoch)",
    )
    parser.add_argument(
        "--times-json", help=argparse.SUPPRESS
    )  # a child of --processes: write per-round times, nothing else
    args = parser.parse_args()
    if args.breakdown:
        CONTENDERS.update(BREAKDOWN)
    OPTIMIZER_NAME = args.optimizer
    DEVICE, PIN = args.device, args.pin
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the harness measures framework overhead, not BLAS threading
    models = ["tiny"] if args.quick else (args.models or DEFAULT_MODELS[DEVICE])
    rounds = 3 if args.quick else args.rounds
    if args.times_json:
        with open(args.times_json, "w") as f:
            times = {name: bench_model(name, rounds, args.seed) for name in models}
            json.dump({"times": times, "peaks": peaks()}, f)
        return

    results = {"machine": machine(), "rounds": rounds, "processes": args.processes, "models": {}}
    print(f"# {results['machine']}; {args.processes} process(es) x {rounds} interleaved rounds, order shuffled\n")
    if args.processes > 1:
        runs, peak = in_processes(args, models, rounds)
    else:
        runs = {m: [bench_model(m, rounds, args.seed)] for m in models}
    for name in models:
        sizes, batch, batches = MODELS[name]
        res = summarise(runs[name])
        results["models"][name] = res
        print(f"## {name}: MLP {'-'.join(map(str, sizes))}, batch {batch}, {batches} steps a round\n")
        print(
            "| loop | median us/step | min | max | vs raw (paired median) | per-process range | vs Accelerate loop |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        )
        for c, r in res.items():
            lo, hi = r["vs_raw_range"]
            print(
                f"| {c} | {r['median_us']:.1f} | {r['min_us']:.1f} | {r['max_us']:.1f} | {r['vs_raw']:.3f} | {lo:.3f}-{hi:.3f} | {r['vs_accelerate']:.3f} |"
            )
        print()
    results.update(peak if args.processes > 1 else peaks())
    print(f"peak resident memory of the harness: {results['peak_rss_mb']:.0f} MB\n")
    if DEVICE != "cpu":
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
