"""A compiled step against eager and compiled hand-written loops (CPU, inductor; CUDA where there is one).

    python benchmarks/bench_compile.py                          # tiny MLP and a small GPT-2, 10 paired rounds
    PYTHONPATH=.deepspeed-site python benchmarks/bench_compile.py --json benchmarks/results_compile.json
    python benchmarks/bench_compile.py --models tiny --rounds 20 --backend inductor

Five loops train the same model on the same batches, one epoch of ``--steps`` batches per round:

- ``raw``: the hand-written eager loop (``loss_fn(model, batch).backward()``, ``opt.step()``, ``opt.zero_grad()``);
- ``raw_compiled``: the same loop compiled the way torch's tutorials do: ``torch.compile`` of the loss with the
  model inside, and of ``opt.step`` with the learning rate a tensor; ``opt.zero_grad()`` eager;
- ``raw_compiled_lean``: the same loop with the update compiled as ``make_step(compile=True)`` compiles it: the
  body of the optimizer's ``step`` (under torch's profiler and grad-mode wrappers) and the gradients set to None,
  one compiled function, called with the grad mode off;
- ``trainfold``: ``run_epoch(ctx, make_step(ctx, loss_fn), loader)``;
- ``trainfold_compiled``: the same with ``make_step(..., compile=Compile(backend=...))``.

The first round of each loop is its warm-up (compilation) and is reported apart, as seconds; inductor's
caches on disk are off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``, ``TORCHINDUCTOR_AUTOGRAD_CACHE=0``), so each
compiled loop compiles from nothing rather than the second reusing the first's kernels. The
timed rounds are paired: every loop once per round, in a shuffled order; reported per loop are the
median microseconds per step and the medians of the per-round ratios to ``raw``, ``raw_compiled`` and
``raw_compiled_lean``.
The small GPT-2 (2 layers of width 128, 4 heads, a vocabulary of 256, sequences of 64) is built from
its config with transformers (``.deepspeed-site`` has it): nothing is downloaded. ``--models gpt2-small`` is GPT-2
small itself (124M, sequences of 1024, batch 8), for a GPU (``benchmarks/gpu_checks.sh`` runs it there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # before torch reads its configuration
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

Runner = Callable[[], None]


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _mlp_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(steps)]


def _mlp_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _gpt2(seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)


def _gpt2_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (8, 64), generator=g) for _ in range(steps)]


def _gpt2_small(seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    )  # 124M, built locally


def _gpt2_small_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50257, (8, 1024), generator=g) for _ in range(steps)]


def _gpt2_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


MODELS: dict[str, tuple[Callable[[int], torch.nn.Module], Callable[[int], list[Any]], Callable[..., torch.Tensor]]] = {
    "tiny": (_mlp, _mlp_batches, _mlp_loss),
    "gpt2": (_gpt2, _gpt2_batches, _gpt2_loss),
    "gpt2-small": (
        _gpt2_small,
        _gpt2_small_batches,
        _gpt2_loss,
    ),  # GPT-2 small (124M), sequences of 1024, batch 8: for a GPU
}


def _optimizer(model: torch.nn.Module, *, tensor_lr: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, dtype=torch.float64) if tensor_lr else 1e-3)


def raw(
    model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], batches: list[Any], backend: str | None
) -> Runner:
    opt = _optimizer(model, tensor_lr=backend is not None)
    loss_call = loss_fn if backend is None else torch.compile(loss_fn, backend=backend)
    step = opt.step if backend is None else torch.compile(opt.step, backend=backend)

    def run() -> None:
        for batch in batches:
            loss_call(model, batch).backward()
            step()
            opt.zero_grad()

    return run


def raw_lean(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], batches: list[Any], backend: str) -> Runner:
    opt = _optimizer(model, tensor_lr=True)
    body = type(opt).step.__wrapped__.__wrapped__  # type: ignore[attr-defined]  # inside the profiler's and grad mode's wrappers
    params = list(model.parameters())

    def update() -> None:
        body(opt)
        for p in params:
            p.grad = None

    loss_call, update_call = torch.compile(loss_fn, backend=backend), torch.compile(update, backend=backend)

    def run() -> None:
        for batch in batches:
            loss_call(model, batch).backward()
            with torch.no_grad():
                update_call()

    return run


def composed(
    model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], batches: list[Any], backend: str | None
) -> Runner:
    from accelerate import Accelerator

    from trainfold import Compile, Context, TrainState, make_step, run_epoch

    ctx = Context(accelerator=Accelerator(cpu=not torch.cuda.is_available()))
    holder = {"state": TrainState.create(ctx, model=model, optimizer=_optimizer(model))}
    step = make_step(ctx, loss_fn, compile=False if backend is None else Compile(backend=backend))

    def run() -> None:
        holder["state"] = run_epoch(ctx, step, batches, holder["state"])

    return run


def _timed(run: Runner) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench(model_name: str, *, rounds: int, steps: int, backend: str, seed: int) -> dict[str, Any]:
    build, make_batches, loss_fn = MODELS[model_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [tuple(t.to(device) for t in b) if isinstance(b, tuple) else b.to(device) for b in make_batches(steps)]
    loops = {
        "raw": raw(build(0).to(device), loss_fn, batches, None),
        "raw_compiled": raw(build(0).to(device), loss_fn, batches, backend),
        "raw_compiled_lean": raw_lean(build(0).to(device), loss_fn, batches, backend),
        "trainfold": composed(build(0).to(device), loss_fn, batches, None),
        "trainfold_compiled": composed(build(0).to(device), loss_fn, batches, backend),
    }
    warmup = {name: _timed(run) for name, run in loops.items()}  # compiles the compiled ones
    times: dict[str, list[float]] = {name: [] for name in loops}
    order = list(loops)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(_timed(loops[name]) / steps * 1e6)

    def ratio(name: str, to: str) -> float:
        return statistics.median(a / b for a, b in zip(times[name], times[to]))

    return {
        "model": model_name,
        "steps": steps,
        "rounds": rounds,
        "backend": backend,
        "warmup_s": {name: round(t, 2) for name, t in warmup.items()},
        "us_per_step": {name: round(statistics.median(t), 1) for name, t in times.items()},
        "ratio_to_raw": {name: round(ratio(name, "raw"), 3) for name in loops},
        "ratio_to_raw_compiled": {name: round(ratio(name, "raw_compiled"), 3) for name in loops},
        "ratio_to_raw_compiled_lean": {name: round(ratio(name, "raw_compiled_lean"), 3) for name in loops},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "gpt2"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        },
        "models": [],
    }
    for name in args.models:
        result = bench(name, rounds=args.rounds, steps=args.steps, backend=args.backend, seed=args.seed)
        results["models"].append(result)
        print(json.dumps(result, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
