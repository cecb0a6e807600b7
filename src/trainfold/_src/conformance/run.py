"""One run of the resume kit: a tiny model trained on the user's loader for a few epochs, from the latest checkpoint
of its root if there is one, logging every batch's sample ids.

``train(spec)`` runs it in a process of ``run_distributed`` (``spec`` is a :class:`RunSpec` as JSON). The run writes,
in its own folder ``log``:

- ``trained-<rank>.txt``: ``resumed <update>`` first, then ``first <seconds>`` (from the start of the load to the
  first batch), then a line a batch, ``<epoch> <update> <id> <id> ...`` (kept whole by a kill: a line a write);
- ``refused-<rank>.txt``: the message of a ``CheckpointError`` that refused the resume;
- ``pid-<rank>``: the process's id, once it is set up, where the kit is to kill it (with every process it started:
  its process group).
"""

from __future__ import annotations

import importlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

from trainfold.errors import CheckpointError


@attrs.frozen
class LoaderRequest:
    """What a loader factory given to ``testing.check_resume`` is asked for: the loader of one process of a run."""

    #: processes in this run (Accelerate's ``num_processes``)
    num_processes: int
    #: this process's index among them
    process_index: int
    #: the ``num_workers`` to give the ``DataLoader``
    num_workers: int


def _pairs(items: Any) -> tuple[tuple[str, Any], ...]:
    """Key-value pairs as a tuple of tuples (JSON gives them back as lists)."""
    return tuple((str(k), v) for k, v in items)


@attrs.frozen
class RunSpec:
    """One run of the kit, handed to its processes as JSON."""

    loader: str  # "module:qualname" of the factory
    ids: str  # a batch's key, or "module:qualname" of a function of the batch
    root: str
    log: str
    workers: int
    epochs: int
    every: int
    #: keyword arguments of Accelerate's DataLoaderConfiguration, as pairs
    dataloader_config: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_pairs)
    stop_after: int | None = None  # stop (and save) at this update
    epoch_end: bool = False  # stop (and save) at the first epoch's end
    slow_s: float = 0.0  # a pause a batch, so that a kill lands inside the run
    announce: bool = False  # write pid-<rank> in the log once set up (a run to be killed: the kit reads the pids)

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


def resolve(reference: str) -> Any:
    """The object a ``"module:qualname"`` reference names."""
    module, _, name = reference.partition(":")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def batch_ids(ids: str) -> Callable[[Any], list[int]]:
    """The function giving a batch's sample ids: a key of the batch, or a function of it (a reference)."""
    if ":" in ids:
        fn = resolve(ids)
        return lambda batch: [int(i) for i in fn(batch)]
    return lambda batch: [int(i) for i in torch.as_tensor(batch[ids]).reshape(-1).tolist()]


def train(text: str) -> dict[str, Any]:
    """The run of ``text`` (a :class:`RunSpec` as JSON): ``{"refused": message}`` where a ``CheckpointError`` refused
    its resume, else ``{"step": the last update}``; and ``"said"``, the messages of the warnings it gave."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        out = _train(RunSpec.from_json(text))
    return {**out, "said": [str(w.message) for w in said]}


def _train(spec: RunSpec) -> dict[str, Any]:
    from accelerate import Accelerator, DataLoaderConfiguration

    from trainfold._src.checkpoint.every import checkpoint_every
    from trainfold._src.checkpoint.load import load_checkpoint
    from trainfold._src.checkpoint.root import latest_checkpoint
    from trainfold._src.compose.epoch import run_epoch
    from trainfold._src.compose.loop import loop
    from trainfold._src.compose.transforms import max_steps
    from trainfold._src.core.context import Context
    from trainfold._src.core.state import TrainState
    from trainfold._src.core.step import make_step

    log = Path(spec.log)
    log.mkdir(parents=True, exist_ok=True)
    if spec.announce:  # a process group of its own: the kill reaches what it starts too (its loader's workers)
        os.setsid()
    config = DataLoaderConfiguration(**dict(spec.dataloader_config))
    ctx = Context(accelerator=Accelerator(cpu=True, dataloader_config=config))
    rank = ctx.accelerator.process_index
    request = LoaderRequest(ctx.accelerator.num_processes, rank, spec.workers)
    (loader,) = ctx.prepare_loaders(resolve(spec.loader)(request))
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    ids_of = batch_ids(spec.ids)
    where = [0, 0]  # the epoch and update the batch being trained belongs to
    out = open(log / f"trained-{rank}.txt", "a", buffering=1)  # noqa: SIM115 (closed below)
    started, first = time.perf_counter(), [True]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        ids = ids_of(batch)
        if first[0]:
            out.write(f"first {time.perf_counter() - started:.6f}\n")
            first[0] = False
        out.write(f"{where[0]} {where[1]} " + " ".join(map(str, ids)) + "\n")
        if spec.slow_s:
            time.sleep(spec.slow_s)
        x = torch.tensor(ids, dtype=torch.float32)[:, None] / 1000.0
        loss: torch.Tensor = ((model(x) - x) ** 2).mean()
        return loss

    saving = checkpoint_every(ctx, spec.every, spec.root, keep_last=2)
    inner = saving(make_step(ctx, loss_fn))
    if spec.stop_after is not None:
        inner = max_steps(spec.stop_after)(inner)

    def step(state: TrainState, batch: Any) -> TrainState:
        where[:] = [state.epoch, state.step]
        return inner(state, batch)

    try:
        with ctx:
            if latest_checkpoint(spec.root) is not None:
                state = load_checkpoint(ctx, spec.root, state)
            out.write(f"resumed {state.step}\n")
            if spec.announce:
                (log / f"pid-{rank}").write_text(str(os.getpid()))
            epochs = 1 if spec.epoch_end else spec.epochs
            state = saving.at_end(loop(run_epoch(ctx, step, loader), max_epochs=epochs)(state))
    except CheckpointError as exc:
        (log / f"refused-{rank}.txt").write_text(str(exc))
        return {"refused": str(exc)}
    finally:
        out.close()
    return {"step": state.step}
