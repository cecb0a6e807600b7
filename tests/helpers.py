"""Shared builders for the tests: seeded models, data and the canonical Accelerate loop."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from accelerate import Accelerator

from trainfold import testing


#: Marks a test that needs a GPU (it is skipped where CUDA is not available, as on CI).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def scaled(seconds: float) -> float:
    """A hang-guard of ``seconds`` on a quiet machine, stretched by the machine's load now (the 1-minute load average
    per core, as ``run_distributed`` stretches its own): a busy machine waits longer rather than failing a correct run."""
    from trainfold._src.distributed.launch import load_factor

    return seconds * load_factor()


def classification_data(n: int = 50, features: int = 8, classes: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def mlp(features: int = 8, classes: int = 3, dropout: float = 0.0) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, classes)
    )


def ce_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def ce_loss_with_accuracy(model, batch):
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits, y), {"accuracy": (logits.argmax(-1) == y).float().mean()}


def build(
    seed: int,
    *,
    dropout: float = 0.0,
    shuffle: bool = False,
    scheduler: bool = False,
    n: int = 50,
    batch_size: int = 8,
    lr: float = 0.1,
):
    """Model, optimizer, optional scheduler and loader, all seeded identically for both loops."""
    torch.manual_seed(seed)
    model = mlp(dropout=dropout)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    dl = torch.utils.data.DataLoader(classification_data(n), batch_size=batch_size, shuffle=shuffle)
    return model, opt, sched, dl


def canonical_loop(accelerator: Accelerator, model, opt, sched, dl, loss_fn, *, epochs: int, clip_norm=None, read=None):
    """The hand-written loop of Accelerate's gradient-accumulation guide, with clipping on sync steps.

    ``read(accelerator, prepared_model)`` gives the parameters returned (whole ones of a sharded engine);
    by default ``testing.parameters``.
    """
    objs = accelerator.prepare(model, opt, dl) if sched is None else accelerator.prepare(model, opt, dl, sched)
    model, opt, dl = objs[:3]
    sched = objs[3] if sched is not None else None
    losses = []
    for _ in range(epochs):
        model.train()
        for batch in dl:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip_norm is not None:
                    accelerator.clip_grad_norm_(model.parameters(), clip_norm)
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
            losses.append(loss.detach().float())
    return (testing.parameters(model) if read is None else read(accelerator, model)), losses


def fsdp2_accelerator(**kwargs) -> Accelerator:
    """An Accelerator on CPU processes that prepares models with Accelerate's real FSDP2 path.

    Accelerate selects FSDP only on accelerators (``Accelerator(cpu=True)`` always
    means MULTI_CPU), but torch's ``fully_shard`` runs on CPU with gloo. Setting
    the distributed type and plugin after the Accelerator is built makes
    ``prepare`` take ``fsdp2_prepare_model`` exactly as it would on GPUs, so the
    step, the checkpoints and the resharding are tested under FSDP2 on CI.
    The one place the tests do this.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, **kwargs)
    # Both: every AcceleratorState() (prepare makes some) copies PartialState's distributed type over its own.
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    if (
        acc.mixed_precision != "no"
    ):  # what AcceleratorState does for a plugin it selects itself: FSDP2's MixedPrecisionPolicy
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    return acc


def mesh_accelerator(dp_replicate: int = 2, dp_shard: int = 2, tp: int = 1, cp: int = 1, **kwargs) -> Accelerator:
    """An Accelerator on CPU processes with a device mesh from Accelerate's ParallelismConfig (HSDP by default: 2 × 2).

    The same forcing as :func:`fsdp2_accelerator`, for the same reason, done earlier: ``Accelerator(cpu=True,
    parallelism_config=...)`` refuses a MULTI_CPU run, so PartialState's distributed type is set to MULTI_GPU before
    the Accelerator is built; with an FSDP2 plugin AcceleratorState then selects FSDP, builds the
    ``(dp_replicate, dp_shard)`` device mesh on the CPU (gloo), and ``prepare`` shards each parameter over
    ``dp_shard`` and replicates it over ``dp_replicate`` (DTensors placed ``(Replicate(), Shard(0))``), as on GPUs.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig

    PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    config = ParallelismConfig(dp_replicate_size=dp_replicate, dp_shard_size=dp_shard, tp_size=tp, cp_size=cp)
    return Accelerator(cpu=True, fsdp_plugin=plugin, parallelism_config=config, **kwargs)


#: transformers 4.57 and huggingface_hub < 1.0, kept apart from .venv (the Makefile's ``.tp-site``): Accelerate checks
#: transformers' version when a ParallelismConfig has ``tp_size``, and imports its ``ReplicateParallel`` under TP + FSDP2
TP_SITE = Path(__file__).resolve().parents[1] / ".tp-site"
needs_tp_site = pytest.mark.skipif(
    not (TP_SITE / ".trainfold-installed").exists(),
    reason="needs .tp-site (make .tp-site/.trainfold-installed; make test builds it)",
)


def tp_accelerator(tp: int = 2, dp_shard: int = 1, **kwargs) -> Accelerator:
    """An Accelerator on CPU processes whose ParallelismConfig has tensor parallelism (× FSDP2 over ``dp_shard``).

    The forcing of :func:`mesh_accelerator`; transformers comes from :data:`TP_SITE`, put first on this process's
    path (the processes of ``run_distributed`` have imported neither it nor huggingface_hub yet).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig

    if str(TP_SITE) not in sys.path:
        sys.path.insert(0, str(TP_SITE))
    PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True) if dp_shard > 1 else None
    return Accelerator(
        cpu=True, fsdp_plugin=plugin, parallelism_config=ParallelismConfig(tp_size=tp, dp_shard_size=dp_shard), **kwargs
    )


def tensor_parallel(model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
    """:func:`mlp` split over the mesh's ``tp`` dimension before ``prepare``, as a transformers ``tp_plan`` splits a
    transformer's MLP (torch's ``parallelize_module``: the first layer by columns, the last by rows), and marked with
    its degree (``model.tp_size``), which Accelerate's ``prepare`` checks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = accelerator.torch_device_mesh["tp"]
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "3": RowwiseParallel()})
    model.tp_size = mesh.size()
    return model


def on_processes(nprocs: int, fn, *args, **kwargs) -> list:
    """Each rank's ``fn(*args, **kwargs)``: on ``nprocs`` fresh processes (``testing.run_distributed``), or, for one,
    in this process between two resets of Accelerate's process-wide state."""
    if nprocs > 1:
        return testing.run_distributed(fn, *args, nprocs=nprocs, **kwargs)
    testing.reset_accelerate_state()
    try:
        return [fn(*args, **kwargs)]
    finally:
        testing.reset_accelerate_state()


def continues_exactly(before, after) -> None:
    """A run's rank 0 starts with the model, step, scheduler and optimizer (whole tensors) the run before stopped with:
    each run's result is ``(seen, at_start, at_end, ...)``, a position being ``(params, step, last_epoch, moments)``."""
    stopped, started = before[0][2], after[0][1]
    testing.assert_params_equal(stopped[0], started[0])
    assert stopped[1] == started[1] and stopped[2] == started[2]
    for k, per in stopped[3].items():
        for name, value in per.items():
            assert torch.equal(value, started[3][k][name]), (k, name)


def small_disk(folder, size: str):
    """A tmpfs of ``size`` mounted at ``folder`` (a full disk, for real), unmounted after; skips where mounting needs root."""
    import subprocess

    folder.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs needs root (CI and the project's machines run as root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


#: Marks a test that needs DeepSpeed installed (``make dev`` installs it; it is skipped where it is not).
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")


def deepspeed_accelerator(
    stage: int, *, gradient_accumulation_steps: int = 1, clip: float | None = None, config: dict | None = None, **kwargs
) -> Accelerator:
    """An Accelerator that prepares with DeepSpeed ZeRO stage ``stage``, on CPU processes as on GPUs.

    DeepSpeed runs on CPU (its CPU accelerator, over a gloo group that
    ``deepspeed.comm`` starts), and Accelerate takes its DeepSpeed path there,
    but Accelerate's PartialState picks a process group only for accelerators
    (``cpu=True`` means MULTI_CPU) and so reports one process while every
    process is in DeepSpeed's group. Filling in the process counts from
    ``torch.distributed`` makes ``prepare`` build DeepSpeed's config with the
    real world size and shard the loader; where Accelerate counted them itself
    (one process, or a GPU), nothing is changed. The one place the tests do this.
    Call it inside a process of its own (``testing.run_distributed``): it sets
    ``ACCELERATE_USE_DEEPSPEED`` as ``accelerate launch`` does.
    """
    import os

    import torch.distributed as dist
    from accelerate.state import PartialState
    from accelerate.utils import DeepSpeedPlugin

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    plugin = (
        DeepSpeedPlugin(hf_ds_config=config)
        if config is not None
        # a whole config (its stage wins)
        else DeepSpeedPlugin(
            zero_stage=stage,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clipping=0.0 if clip is None else clip,
        )
    )
    acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=gradient_accumulation_steps, **kwargs)
    if dist.is_initialized() and acc.num_processes != dist.get_world_size():
        shared = PartialState()
        for state in (shared, acc.state):  # AcceleratorState copied PartialState's values when it was built
            state.num_processes = dist.get_world_size()
            state.process_index = dist.get_rank()
            state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
            state.backend = dist.get_backend()
    return acc


def each_fresh(*runs):
    """Call each run in turn, Accelerate's process-wide state reset after each, so each builds its own Accelerator
    (the Accelerate way, then the trainfold way, with other settings than the test before). Their results, in order."""
    from accelerate.state import AcceleratorState, GradientState

    results = []
    for run in runs:
        results.append(run())
        AcceleratorState._reset_state()  # keep the process group, forget the Accelerator settings
        GradientState._reset_state()
    return tuple(results)


def wait_until_listening(proc, port: int, what: str) -> None:
    """Wait for the event: the server ``proc`` accepts a connection on 127.0.0.1:``port`` (at most 120 s, or until it exits)."""
    deadline = time.monotonic() + scaled(120)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on port {port} (exit {proc.poll()})") from None
            time.sleep(0.05)


_SECOND_JOB = """
import sys
from trainfold import CheckpointError, testing, load_checkpoint, save_checkpoint
ctx, state, *_ = testing.tiny_setup(seed=0)
try:
    state = load_checkpoint(ctx, sys.argv[1], state, storage_options={options})  # the same run, continued
    save_checkpoint(ctx, sys.argv[1], state, storage_options={options})
    print("saved")
except CheckpointError as exc:
    print("refused", exc)
ctx.close()
"""


def second_job(root: str, options: dict[str, Any]) -> str:
    """Another job, in its own process, continuing the run at ``root`` on a store: "saved", or "refused <why>"."""
    code = _SECOND_JOB.replace("{options}", repr(options))
    return subprocess.run(
        [sys.executable, "-c", code, root], capture_output=True, text=True, timeout=scaled(600)
    ).stdout.strip()


@contextlib.contextmanager
def moto_server(env: dict[str, str] | None = None, log: Path | None = None):
    """A real S3-protocol server (moto's server mode) on 127.0.0.1, in a subprocess (with ``env`` added to its environment).

    Loopback only, a free port, stopped (killed) when the block ends; ``.proc`` of the yielded
    value lets a test stop it in the middle of a save. With ``log``, the server's access log (a line
    per request, written before the request is answered) goes to that file: :class:`RequestLog` reads it.
    """
    from trainfold.testing import free_port

    port = free_port()
    out = subprocess.DEVNULL if log is None else open(log, "w")  # noqa: SIM115 (closed below, after the server)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=out,
        stderr=out,
        env={**os.environ, **(env or {})},
    )
    server = S3Server(f"http://127.0.0.1:{port}", proc)
    try:
        wait_until_listening(proc, port, "moto's S3 server")
        yield server
    finally:
        proc.kill()
        proc.wait(timeout=scaled(30))
        if log is not None:
            out.close()


class RequestLog:
    """The requests a moto server answered (its access log), counted from a mark on: what a store's client really sent.

    A line is logged before its response is sent, so once a call returns every request it made is counted.
    """

    _LINE = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP')

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mark = len(self._requests())

    def _requests(self) -> list[tuple[str, str]]:
        return [
            (m.group(1), m.group(2)) for line in self.path.read_text().splitlines() if (m := self._LINE.search(line))
        ]

    def since(self) -> list[str]:
        """The requests since the last call (or since this log was opened), each as "LIST", "GET", "PUT", "HEAD",
        "DELETE" (one batch delete) or "PUT part"... in the order the server answered them; then a new mark."""
        found = self._requests()
        new, self.mark = found[self.mark :], len(found)
        return [self._kind(method, target) for method, target in new]

    @staticmethod
    def _kind(method: str, target: str) -> str:
        query = target.partition("?")[2]
        if method == "GET" and ("list-type" in query or "prefix=" in query):
            return "LIST"
        if method == "POST" and query.startswith("delete"):
            return "DELETE"
        return method


@attrs.frozen
class S3Server:
    endpoint: str
    proc: Any = attrs.field(repr=False)

    def options(self) -> dict[str, Any]:
        """``storage_options`` for this server (moto takes any credentials)."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def env(self) -> dict[str, str]:
        """The same as fsspec's and botocore's own configuration: what a job launched with it reads."""
        return {
            "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def bucket(self, name: str) -> str:
        """Create the bucket ``name`` (once) and return ``s3://name``."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.options(), use_listings_cache=False)
        if not fs.exists(name):
            fs.call_s3("create_bucket", Bucket=name)  # no LocationConstraint: us-east-1 takes none
        return f"s3://{name}"


#: Azurite, Microsoft's Azure Storage emulator, installed by `make test` with npm into .azurite/ (the Makefile's AZURITE)
AZURITE = Path(__file__).resolve().parents[1] / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
#: Azurite's well-known development account (public, in Microsoft's documentation): not a secret
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@contextlib.contextmanager
def azurite_server(folder):
    """Azurite's blob service on 127.0.0.1 (a free port, its data in ``folder``), killed when the block ends."""
    from trainfold.testing import free_port

    if not AZURITE.exists():
        raise RuntimeError(f"{AZURITE} is missing: `make test` installs Azurite with npm (make .azurite/.installed)")
    port = free_port()
    proc = subprocess.Popen(
        [
            str(AZURITE),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--location",
            str(folder),
            "--silent",
            "--skipApiVersionCheck",
            "--loose",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_listening(proc, port, "Azurite")
        yield AzureServer(
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
        )
    finally:
        proc.kill()
        proc.wait(timeout=scaled(30))


@attrs.frozen
class AzureServer:
    connection_string: str

    def options(self) -> dict[str, Any]:
        """``storage_options`` for this service (adlfs)."""
        return {"connection_string": self.connection_string}

    def container(self, name: str) -> str:
        """Create the container ``name`` and return ``az://name``."""
        import adlfs

        adlfs.AzureBlobFileSystem(**self.options()).mkdir(name)
        return f"az://{name}"


def kill_after_a_new_checkpoint(cmd, env, newest, delay: float, processes: int = 2) -> int:
    """Start the job ``cmd`` (torchrun and its ``processes`` workers, or one process; each prints "ready <pid>"), SIGKILL the
    launcher and every worker ``delay`` s after ``newest()`` (the newest committed checkpoint) changed; return the launcher's
    exit status.

    Waiting for that event, not for a fixed time: on a loaded machine a job once had no checkpoint at all when the kills
    came. A job that ended first is not killed (its status says so).
    """
    import signal

    before = newest()
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as proc:
        lines = [proc.stdout.readline() for _ in range(processes)]
        if not all(line.startswith("ready") for line in lines):
            proc.kill()
            _, err = proc.communicate(timeout=scaled(30))
            raise AssertionError(f"the job did not start: {lines}\n{err[-3000:]}")
        pids = [int(line.split()[1]) for line in lines]
        deadline = time.monotonic() + scaled(600)
        while newest() == before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # training: the first new checkpoint is the event the kill counts from
        time.sleep(delay)
        for kill in (
            lambda: os.killpg(proc.pid, signal.SIGKILL),
            *(lambda pid=pid: os.kill(pid, signal.SIGKILL) for pid in pids),
        ):
            try:
                kill()
            except ProcessLookupError:  # it had ended already
                pass
        proc.communicate(timeout=scaled(30))
    return proc.returncode


def kill_at_line(cmd, env, wanted) -> int:
    """Start the one-process job ``cmd`` (it prints "ready <pid>", then lines of its progress), SIGKILL its process group
    once it prints a line for which ``wanted(line)`` holds, and return its exit status (a job that ended first is not
    killed: its status says so). The event is the job's own word, not a time after another event: on a busy machine the
    time between two updates was longer than any fixed delay a test can choose.
    """
    import signal

    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as proc:
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            proc.kill()
            _, err = proc.communicate(timeout=scaled(30))
            raise AssertionError(f"the job did not start: {line!r}\n{err[-3000:]}")
        while (line := proc.stdout.readline()) and not wanted(line):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had ended already
            pass
        proc.communicate(timeout=scaled(30))
    return proc.returncode


def dvclive_series(folder) -> dict[str, list[tuple[int, float]]]:
    """Every metric in DVCLive's files under ``folder`` (a ``.tsv`` per key under ``plots/metrics``, rows in the order
    written): ``{key: [(step, value), ...]}``."""
    import csv

    metrics = Path(folder) / "plots" / "metrics"
    series = {}
    for path in sorted(metrics.rglob("*.tsv")):
        with open(path, newline="") as f:
            rows = csv.DictReader(f, delimiter="\t")
            series[path.relative_to(metrics).with_suffix("").as_posix()] = [
                (int(r["step"]), float(r[path.stem])) for r in rows
            ]
    return series


def clearml_series(cache_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one offline ClearML session under ``cache_dir`` (its ``metrics.jsonl``: a JSON list of events
    per line), by the key Accelerate's ClearMLTracker was given (title ``x``, series ``eval``: ``eval_x``; series ``train``:
    the title), in the order written: ``{key: [(iteration, value), ...]}``."""
    import json

    (session,) = [
        p for p in (Path(cache_dir) / "offline").iterdir() if p.is_dir()
    ]  # one session: the resumed run went on with it
    series: dict[str, list[tuple[int, float]]] = {}
    for line in (session / "metrics.jsonl").read_text().splitlines():
        for event in json.loads(line):
            if event["type"] == "training_stats_scalar":
                key = event["metric"] if event["variant"] == "train" else f"{event['variant']}_{event['metric']}"
                series.setdefault(key, []).append((event["iter"], event["value"]))
    return series


AIM_READ = r"""
import json, sys
from aim import Repo, Run

repo = Repo.from_path(sys.argv[1])
runs = {}
for stored in repo.structured_db.runs():
    series = {}
    for metric in Run(stored.hash, repo=repo, read_only=True).metrics():
        if not metric.name.startswith("__system__"):  # Aim's own resource series
            steps, (values, _, _) = metric.data.numpy()
            series[metric.name] = [(int(step), float(value)) for step, value in zip(steps, values)]
    runs[stored.hash] = {"tags": sorted(stored.tags), "series": series}
print(json.dumps(runs))
"""


def aim_runs(path) -> dict[str, dict[str, Any]]:
    """The runs of the Aim repository under ``path``, by hash: ``{"tags": [...], "series": {name: [(step, value), ...]}}``,
    each series by step as Aim holds it (a step logged again holds its last value).

    Indexed first with Aim's own command (``aim storage reindex``: Aim's UI indexes runs as it shows them, and a run
    nothing indexed, a killed one, cannot be read), then read in a process of its own (Aim keeps its repositories open).
    """
    import json
    import subprocess
    import sys

    aim = Path(sys.executable).with_name("aim")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run(
        [str(aim), "storage", "--repo", str(path), "reindex", "--yes"],
        check=True,
        capture_output=True,
        timeout=scaled(120),
        env=env,
    )
    result = subprocess.run(
        [sys.executable, "-c", AIM_READ, str(path)], capture_output=True, text=True, timeout=scaled(120), env=env
    )
    assert 0 == result.returncode, result.stderr[-3000:]
    runs = json.loads(result.stdout.splitlines()[-1])
    for run in runs.values():
        run["series"] = {name: [tuple(point) for point in points] for name, points in run["series"].items()}
    return runs


class NoisyData(torch.utils.data.Dataset):
    """Draws from the global torch RNG in __getitem__, like a random augmentation."""

    def __init__(self, n=21):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


def noisy_setup(ga=3, seed=0, empty=False):
    """A fresh Context, a dropout MLP with SGD momentum and a step scheduler, and a shuffled loader of NoisyData.
    ``empty``: the MLP built on the meta device and given memory by ``to_empty``, without values (a model to load)."""
    from trainfold import Context, TrainState

    testing.reset_accelerate_state()
    torch.manual_seed(seed)
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    if empty:
        with torch.device("meta"):
            model = mlp(dropout=0.3)
        model.to_empty(device="cpu")
    else:
        model = mlp(dropout=0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=sched)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(NoisyData(), batch_size=4, shuffle=True))
    return ctx, state, dl


def rewrite_signed(folder, name, data):
    """Replace a checkpoint's file and re-sign it in the manifest, as an attacker who can write the folder would."""
    (folder / name).write_bytes(data)
    doc = json.loads((folder / "MANIFEST.json").read_text())
    doc["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "MANIFEST.json").write_text(json.dumps(doc))


def edit_signed_json(folder, name, change):
    """Change a checkpoint's JSON file in place (``change(doc)``) and re-sign it."""
    doc = json.loads((folder / name).read_text())
    change(doc)
    rewrite_signed(folder, name, json.dumps(doc).encode())


class LoRALinear(torch.nn.Module):
    """A frozen ``Linear`` plus a trainable low-rank update ``b @ a`` (LoRA, written out: no peft needed)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(0.1 * torch.randn(rank, base.in_features))
        self.b = torch.nn.Parameter(0.1 * torch.randn(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.a.T) @ self.b.T


def lora_mlp(base_seed: int = 0, adapter_seed: int = 1, width: int = 640, dtype=torch.float32) -> torch.nn.Module:
    """A 0.42M-parameter base (three Linears and a frozen BatchNorm, whose running statistics still change) drawn from
    ``base_seed``, frozen, with rank-4 adapters drawn from ``adapter_seed`` on its three Linears (10,284 parameters: 2.4% trains)."""
    torch.manual_seed(base_seed)
    base = (
        torch.nn.Sequential(
            torch.nn.Linear(8, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.BatchNorm1d(width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 3),
        )
        .to(dtype)
        .requires_grad_(False)
    )
    torch.manual_seed(adapter_seed)
    for i in (0, 2, 5):
        base[i] = LoRALinear(base[i]).to(dtype)
    return base


def adapter_setup(
    *,
    base_seed: int = 0,
    adapter_seed: int = 1,
    n: int = 64,
    batch_size: int = 8,
    accelerator=None,
    dtype=torch.float32,
):
    """A fresh Context over an adapter model (:func:`lora_mlp`) with AdamW over its trainable parameters and a prepared loader."""
    from trainfold import Context, TrainState

    if accelerator is None:
        testing.reset_accelerate_state()
        accelerator = Accelerator(cpu=True)
    ctx = Context(accelerator=accelerator)
    model = lora_mlp(base_seed, adapter_seed, dtype=dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    data = classification_data(n)
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(data.tensors[0].to(dtype), data.tensors[1]),
            batch_size=batch_size,
            shuffle=True,
        )
    )
    return ctx, state, dl


def checkpoint_bytes(folder) -> int:
    """The bytes a committed checkpoint's manifest lists."""
    doc = json.loads((Path(folder) / "MANIFEST.json").read_text())
    return sum(entry["size"] for entry in doc["files"].values())


class OwnTracker:
    """A tracker of one's own (Accelerate's ``GeneralTracker`` protocol; make one with :func:`own_tracker`), which cannot
    cut its series back: it keeps what it is sent, ``logged``: ``[(step, values)]``."""

    name = "mine"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self):
        self.logged = []

    def start(self):
        pass

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))

    def finish(self):
        pass

    @property
    def tracker(self):
        return self


def own_tracker(kind=OwnTracker, *args):
    """An instance of ``kind`` (:class:`OwnTracker` or a subclass) that is an Accelerate ``GeneralTracker`` too."""
    from accelerate.tracking import GeneralTracker

    return type(kind.__name__, (kind, GeneralTracker), {})(*args)


def with_metric(state, value, name: str = "eval_loss"):
    """``state`` with one more history record at its epoch and step: ``{name: value}`` (what an evaluation records)."""
    return attrs.evolve(state, history=state.history.add(epoch=state.epoch, step=state.step, values={name: value}))


def nan_setup(fused: bool, **accelerator_kwargs):
    """A Context, a state (an MLP, Adam, ``fused`` or not) and a prepared loader of 6 batches: what a guarded step trains."""
    from trainfold import Context, TrainState

    ctx = Context(accelerator=Accelerator(cpu=True, **accelerator_kwargs))
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    state = TrainState.create(ctx, model=model, optimizer=opt)
    (dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(classification_data(48), batch_size=8))
    return ctx, state, dl


def poisoned(bad_micro_steps):
    """``ce_loss``, NaN at the micro-steps (counted from 1) in ``bad_micro_steps``."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = ce_loss(model, batch)
        return loss * float("nan") if calls["n"] in bad_micro_steps else loss

    return loss_fn


def sgd_momentum(params):
    """SGD with momentum 0.9 at lr 0.1: the tests' usual optimizer."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def setup(
    *,
    seed=0,
    ga=1,
    n=48,
    batch_size=4,
    shuffle=True,
    dropout=0.0,
    dataset=None,
    collate_fn=None,
    optimizer=sgd_momentum,
    scheduler=None,
):
    """A fresh Context (Accelerate's state reset, ``ga`` accumulation steps), the seeded MLP with ``optimizer(params)``
    and ``scheduler(optimizer)``, and a prepared loader of ``dataset`` (``n`` classification samples): the one set-up
    most tests start from, each file giving its own defaults (``functools.partial``)."""
    from trainfold import Context, TrainState

    testing.reset_accelerate_state()
    torch.manual_seed(seed)
    ctx = Context(accelerator=Accelerator(cpu=True, gradient_accumulation_steps=ga))
    model = mlp(dropout=dropout)
    opt = optimizer(model.parameters())
    state = TrainState.create(ctx, model=model, optimizer=opt, scheduler=None if scheduler is None else scheduler(opt))
    data = classification_data(n) if dataset is None else dataset
    (dl,) = ctx.prepare_loaders(
        torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=shuffle, collate_fn=collate_fn)
    )
    return ctx, state, dl


def train(ctx, state, dl, wrap=lambda step: step, *, epochs, clip_grad_norm=None):
    """``epochs`` epochs of ``wrap(make_step(ctx, ce_loss))`` over ``dl`` from ``state``."""
    from trainfold import loop, make_step, run_epoch

    return loop(run_epoch(ctx, wrap(make_step(ctx, ce_loss, clip_grad_norm=clip_grad_norm)), dl), max_epochs=epochs)(
        state
    )
