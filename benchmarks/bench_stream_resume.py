"""How long a resume over a stream takes to reach its first batch, by how far into the epoch the checkpoint stands.

A 10^5-sample ``datasets`` stream (64 shards, batches of 100: 1,000 an epoch) is trained to 1%, 50% and 90% of its
epoch and checkpointed there; each checkpoint is then resumed in a fresh Context, timing ``load_checkpoint`` and the
resumed epoch's first step together, the three positions in turn, round by round. Two sources over the same data:
the stream itself, which says where it is (``state_dict()``: the resume loads it, O(1)), and the same stream behind
a plain ``IterableDataset`` without a state (the resume reads the consumed part again). Each time is the median of
``--repeats`` resumes. ``--buffer N``: the stream shuffled through a buffer of N samples first (``shuffle(seed,
buffer_size=N)``), whose state ``ctx.prepare_loaders`` makes hold the buffer.

    python benchmarks/bench_stream_resume.py [--samples 100000] [--repeats 5] [--buffer N] [--state-only] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, load_checkpoint, make_step, run_epoch, save_checkpoint, testing

BATCH = 100


class Plain(torch.utils.data.IterableDataset):
    """The same stream without a state: a resume reads its consumed part again."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self):
        return iter(self.inner)


def stream(samples: int, stateful: bool, buffer: int = 0):
    from datasets import Dataset

    data = Dataset.from_dict({"x": [[i / samples] for i in range(samples)], "id": list(range(samples))})
    ds = data.to_iterable_dataset(num_shards=64)
    if buffer:
        ds = ds.shuffle(seed=0, buffer_size=buffer)
    ds = ds.with_format("torch")
    return ds if stateful else Plain(ds)


def setup(samples: int, stateful: bool, buffer: int = 0):
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(stream(samples, stateful, buffer), batch_size=BATCH))
    return ctx, state, dl


def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["x"]) ** 2).mean()


def checkpoint_at(folder: Path, samples: int, stateful: bool, batches: int, buffer: int = 0) -> Path:
    ctx, state, dl = setup(samples, stateful, buffer)
    inner = make_step(ctx, loss_fn)

    def step(s, batch):  # stops inside the epoch after ``batches`` batches, as a preemption would
        s = inner(s, batch)
        return s.with_stop("benchmark") if s.batch_in_epoch == batches else s

    state = run_epoch(ctx, step, dl, state)
    assert state.batch_in_epoch == batches and state.epoch == 0
    save_checkpoint(ctx, folder, state)
    ctx.close()
    return folder


def time_resume(folder: Path, samples: int, stateful: bool, buffer: int = 0) -> float:
    ctx, state, dl = setup(samples, stateful, buffer)
    step = make_step(ctx, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replay's warning
        start = time.perf_counter()
        resumed = load_checkpoint(ctx, folder, state)
        at = resumed.batch_in_epoch
        resumed = run_epoch(ctx, step, dl, resumed, max_batches=at + 1)  # one batch, then the epoch ends
        seconds = time.perf_counter() - start
    assert at > 0 and resumed.epoch == 1
    ctx.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--buffer", type=int, default=0, help="shuffle through a buffer of this many samples")
    parser.add_argument(
        "--state-only", action="store_true", help="time the stream with a state alone (the reading again takes minutes)"
    )
    args = parser.parse_args()
    batches = args.samples // BATCH
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stateful in (True,) if args.state_only else (True, False):
            name = "state" if stateful else "read again"
            shares = (0.01, 0.5, 0.9)
            ats = {share: max(1, int(share * batches)) for share in shares}
            folders = {
                share: checkpoint_at(Path(tmp) / f"{name}-{share}", args.samples, stateful, ats[share], args.buffer)
                for share in shares
            }
            times: dict[float, list[float]] = {share: [] for share in shares}
            for _ in range(args.repeats):  # in rounds: a slow moment of a shared machine falls on every position alike
                for share in shares:
                    times[share].append(time_resume(folders[share], args.samples, stateful, args.buffer))
            for share in shares:
                results[f"{name} {share:.0%}"] = statistics.median(times[share])
                print(
                    f"{name:>10} at {share:>4.0%} of the epoch (batch {ats[share]:>4} of {batches}): "
                    f"{statistics.median(times[share]) * 1e3:8.1f} ms to the first resumed batch",
                    flush=True,
                )
    flat = [v for k, v in results.items() if k.startswith("state")]
    print(f"with a state: slowest / fastest = {max(flat) / min(flat):.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"samples": args.samples, "batch": BATCH, "buffer": args.buffer, "seconds": results}, indent=1)
            + "\n"
        )


if __name__ == "__main__":
    main()
