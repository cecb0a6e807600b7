"""A training run over a stream that resumes from its latest checkpoint: killed and restarted by test_stream_resume.py.

    python stream_run.py ROOT OUT --source stateful [--workers 2 --stateful-loader] [--slow]
    torchrun --nproc_per_node 2 stream_run.py ROOT OUT --source datasets-plain --deal shard|split|dispatch
    torchrun --nproc_per_node 3 stream_run.py ROOT OUT --deal dispatch --stop-after 22   (stops at update 22, saved)

``train(argv)`` runs it in a process of ``testing.run_distributed`` and returns its warnings. Prints "ready <pid>" once
set up, saves a checkpoint every 3 updates, and appends every batch it trains to OUT/trained-<rank>.txt ("<update> <id> <id> ..."; every run first writes "resumed <update it starts from>"), and its final
parameters to OUT/params.safetensors when it finishes. ``--deal`` is how Accelerate hands the stream to several
processes: each process reads it and keeps its share (shard: IterableDatasetShard), the same with one global batch
split (split), or process 0 reads and sends each its part (dispatch, Accelerate's default for iterable datasets).
"""

import argparse
import multiprocessing
import os
import time
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from safetensors.torch import save_file

from trainfold import (
    Context,
    TrainState,
    checkpoint_every,
    latest_checkpoint,
    load_checkpoint,
    loop,
    make_step,
    max_steps,
    run_epoch,
)

SAMPLES, BATCH = 384, 8


class StatefulNumbers(torch.utils.data.IterableDataset):
    """A user's stream that can say where it is: a seeded permutation per epoch, split among loader workers."""

    def __init__(self) -> None:
        self.epoch = 0
        self.position = self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.start = state["epoch"], state["position"]

    def __iter__(self):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            order = order[worker.id :: worker.num_workers]
        start, self.start = self.start, 0
        for self.position, i in enumerate(order[start:], start + 1):
            yield {
                "x": torch.tensor([i / SAMPLES]) + 0.01 * torch.randn(1),
                "id": torch.tensor(i),
            }  # a random augmentation


class Plain(StatefulNumbers):
    state_dict = load_state_dict = None  # type: ignore[assignment]


def stream(source: str):
    if source == "stateful":
        return StatefulNumbers()
    if source == "plain":  # the same stream, unable to say where it is (read again on a resume)
        return Plain()
    from datasets import Dataset

    data = Dataset.from_dict({"x": [[i / SAMPLES] for i in range(SAMPLES)], "id": list(range(SAMPLES))})
    ds = data.to_iterable_dataset(num_shards=12)
    if source == "datasets-shards":
        ds = ds.shuffle(seed=7, buffer_size=1)
    if source == "datasets-buffer":  # a shuffle buffer of 32: ctx.prepare_loaders keeps it in the stream's state
        ds = ds.shuffle(seed=7, buffer_size=32)
    return ds.with_format("torch")


def train(argv: list[str]) -> list[str]:
    """The run, with ``argv`` as the command line's arguments; returns what it warned (the messages), which ``main``
    also prints. Called by ``testing.run_distributed`` in a test, where a process's own stderr is not read."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        _train(argv)
    return [str(w.message) for w in said]


def main():
    import sys

    for message in train(sys.argv[1:]):
        print(message, file=sys.stderr, flush=True)


def _train(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--source", default="stateful")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--stateful-loader", action="store_true")
    parser.add_argument("--deal", default="shard", choices=["shard", "split", "dispatch"])
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--stop-after", type=int, default=None, help="stop (and save) at this update")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    config = DataLoaderConfiguration(
        use_stateful_dataloader=args.stateful_loader,
        dispatch_batches=args.deal == "dispatch",
        split_batches=args.deal == "split",
    )
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=config))
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    batch = BATCH * ctx.accelerator.num_processes if args.deal == "split" else BATCH
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(stream(args.source), batch_size=batch, num_workers=args.workers)
    )
    log = open(out / f"trained-{ctx.accelerator.process_index}.txt", "a", buffering=1)  # a line a write: kept by a kill
    if latest_checkpoint(args.root) is not None:
        state = load_checkpoint(ctx, args.root, state)
    log.write(f"resumed {state.step}\n")  # what this process trains from here replaces what an earlier one trained
    if args.source != "plain":  # a stream that says where it is: reading its consumed part again would be a failure
        warnings.filterwarnings("error", "run_epoch: the checkpoint stopped at batch")

    def loss_fn(model, batch):
        if args.slow:
            time.sleep(0.02)
        log.write(f"{state_box[0]} " + " ".join(str(i) for i in batch["id"].tolist()) + "\n")
        return ((model(batch["x"]) - batch["x"].sin()) ** 2).mean()

    state_box = [state.step]
    saving = checkpoint_every(ctx, 3, args.root, keep_last=2)
    inner = saving(make_step(ctx, loss_fn))
    if args.stop_after is not None:
        inner = max_steps(args.stop_after)(inner)

    def step(s, b):  # the update a batch belongs to, for the log
        state_box[0] = s.step
        return inner(s, b)

    os.write(1, f"ready {os.getpid()}\n".encode())
    with ctx:
        state = saving.at_end(loop(run_epoch(ctx, step, dl), max_epochs=2)(state))
        params = {n: p.detach().clone() for n, p in ctx.accelerator.unwrap_model(state.model).named_parameters()}
        if ctx.is_main_process and args.stop_after is None:
            save_file(params, str(out / "params.safetensors"))
    print("done", state.step, flush=True)


if __name__ == "__main__":
    multiprocessing.set_start_method("fork", force=True)
    import stream_run  # the module, not __main__: a checkpoint names its stream's class, the same however the run started

    stream_run.main()
