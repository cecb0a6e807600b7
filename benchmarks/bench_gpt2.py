"""GPU throughput on a realistic model: a GPT-2-small-sized transformers model, bf16, sequences of 1024 tokens.

    python benchmarks/bench_gpt2.py                    # 3 interleaved rounds of 30 steps per loop
    python benchmarks/bench_gpt2.py --rounds 5 --steps 40 --batch 8 --json out.json

Five loops train the same model (``GPT2LMHeadModel(GPT2Config())``, 124M parameters, built
from its config: nothing is downloaded) on the same random token ids, with fused AdamW:

- raw PyTorch: ``torch.autocast(bfloat16)``, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``;
- the canonical Accelerate loop (``Accelerator(mixed_precision="bf16")``, ``accumulate``, ``backward``);
- trainfold's ``run_epoch(ctx, make_step(ctx, loss_fn), loader)``;
- the raw loop with the model's outputs converted to float32 (``convert_outputs_to_fp32``), which
  Accelerate's mixed precision does to every prepared model: the logits (batch x 1024 x 50257) are
  copied to float32 on every step, whichever loop drives the model;
- and trainfold with ``TrainState.create(..., outputs_to_fp32=False)``, which keeps autocast and
  drops that copy (the loss, computed in the model's forward, is float32 either way).

Each round runs every loop once (one epoch of ``--steps`` batches after ``--warmup`` untimed
ones), in a shuffled order; tokens per second is counted from the first timed step to the
device being idle after the last. Batches are pinned and copied without blocking in every
loop (docs/guides/speed.md's advice for GPU runs). Reported per loop: the median tokens/s over the
rounds and the median of the per-round ratios to the raw loop. Needs CUDA and transformers.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable

import torch


def _model(seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_positions=1024, n_ctx=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _batches(n: int, batch: int, seq: int, vocab: int = 50257) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=g).pin_memory() for _ in range(n)]


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batches[i]


def _loader(batches: list[torch.Tensor]) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(_Tokens(batches), batch_size=None, pin_memory=True)


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _timed(run: Callable[[list[torch.Tensor]], None], warmup: list[torch.Tensor], timed: list[torch.Tensor]) -> float:
    run(warmup)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(timed)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def raw(seed: int, *, fp32_outputs: bool = False) -> Callable[[list[torch.Tensor]], None]:
    model = _model(seed).cuda()
    if fp32_outputs:  # as Accelerate's mixed precision does to every model it prepares
        from accelerate.utils import convert_outputs_to_fp32

        model.forward = convert_outputs_to_fp32(model.forward)  # type: ignore[method-assign]
    opt = _optimizer(model)

    def run(batches: list[torch.Tensor]) -> None:
        model.train()
        for b in _loader(batches):
            b = b.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model, b)
            loss.backward()
            opt.step()
            opt.zero_grad()

    return run


def raw_fp32_outputs(seed: int) -> Callable[[list[torch.Tensor]], None]:
    """The raw loop with the model's outputs converted to float32, as Accelerate's mixed precision does to every model."""
    return raw(seed, fp32_outputs=True)


def accelerate_loop(seed: int) -> Callable[[list[torch.Tensor]], None]:
    from accelerate import Accelerator

    from trainfold.testing import reset_accelerate_state

    reset_accelerate_state()
    acc = Accelerator(mixed_precision="bf16", dataloader_config=_non_blocking())
    model = _model(seed)
    opt = _optimizer(model)
    model, opt = acc.prepare(model, opt)

    def run(batches: list[torch.Tensor]) -> None:
        model.train()
        for b in acc.prepare(_loader(batches)):
            with acc.accumulate(model):
                loss = loss_fn(model, b)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()

    return run


def trainfold_loop(seed: int, *, outputs_to_fp32: bool = True) -> Callable[[list[torch.Tensor]], None]:
    from accelerate import Accelerator

    from trainfold import Context, TrainState, make_step, run_epoch
    from trainfold.testing import reset_accelerate_state

    reset_accelerate_state()
    ctx = Context(accelerator=Accelerator(mixed_precision="bf16", dataloader_config=_non_blocking()))
    model = _model(seed)
    state = [TrainState.create(ctx, model=model, optimizer=_optimizer(model), outputs_to_fp32=outputs_to_fp32)]
    step = make_step(ctx, loss_fn)

    def run(batches: list[torch.Tensor]) -> None:
        (dl,) = ctx.prepare_loaders(_loader(batches))
        state[0] = run_epoch(ctx, step, dl, state[0])

    return run


def trainfold_bf16_outputs(seed: int) -> Callable[[list[torch.Tensor]], None]:
    """trainfold with ``TrainState.create(..., outputs_to_fp32=False)``: autocast kept, the logits' float32 copy dropped."""
    return trainfold_loop(seed, outputs_to_fp32=False)


def _non_blocking() -> Any:
    from accelerate.utils import DataLoaderConfiguration

    return DataLoaderConfiguration(non_blocking=True)


LOOPS = {
    "raw PyTorch": raw,
    "raw, outputs to float32": raw_fp32_outputs,
    "Accelerate loop": accelerate_loop,
    "trainfold run_epoch": trainfold_loop,
    "trainfold, outputs_to_fp32=False": trainfold_bf16_outputs,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gpt2.py needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = True
    warmup = _batches(args.warmup, args.batch, args.seq)
    timed = _batches(args.steps, args.batch, args.seq)
    tokens = args.steps * args.batch * args.seq
    rng = random.Random(args.seed)
    seconds: dict[str, list[float]] = {name: [] for name in LOOPS}
    for _ in range(args.rounds):
        order = list(LOOPS)
        rng.shuffle(order)
        for name in order:  # one loop's model on the GPU at a time
            run = LOOPS[name](args.seed)
            seconds[name].append(_timed(run, warmup, timed))
            del run
            torch.cuda.empty_cache()
    result: dict[str, Any] = {
        "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {platform.python_version()}",
        "model": "GPT2LMHeadModel(GPT2Config()), 124M parameters, bf16 autocast, fused AdamW",
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "rounds": args.rounds,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loops": {},
    }
    for name, times in seconds.items():
        ratios = [t_raw / t for t, t_raw in zip(times, seconds["raw PyTorch"])]  # throughput relative to raw
        result["loops"][name] = {
            "tokens_per_s_median": tokens / statistics.median(times),
            "tokens_per_s_each": [tokens / t for t in times],
            "vs_raw_median": statistics.median(ratios),
        }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
