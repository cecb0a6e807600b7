"""Checkpoints on object storage: trainfold's save and verified load against s3fs's own put/get of the same bytes.

    python benchmarks/bench_s3.py [--width 4096] [--layers 4] [--repeats 3]

A real S3-protocol server (moto's server mode) on 127.0.0.1, started here. The model is
--layers Linear(width, width) (4 x 4096^2 floats: 256 MB) with SGD momentum (another 256 MB):
a 512 MB checkpoint. Each round, in turn:

- trainfold's blocking ``save_checkpoint`` to ``s3://bench/run`` (capture, encode, upload every
  file hashed as it goes, commit with the manifest);
- s3fs's ``put`` of the same files, from a local copy, to another prefix (the upload alone);
- trainfold's verified ``load_checkpoint`` (every object read by ranged reads in parallel,
  verified, decoded, checked, copied into the live model);
- s3fs's ``get`` of the same objects to a local folder (the download alone);
- the step's blocked time under a background save (``async_save=True``: the call returns once
  the state is copied to host memory) against the blocking save;
- a verified load of the same state from a memory tier (a root in ``/dev/shm``, saved there the same
  round): what a restart that finds the memory tier costs against one that reads the store.

Reported: medians, and throughput ratios (s3fs's time / trainfold's: at least 0.9 is the target).
The server runs on the same two cores as the client: the figures compare the two clients on
one server, not S3's speed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from trainfold import Context, TrainState, load_checkpoint, save_checkpoint, testing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("bench_s3.py: moto's server did not start") from None
            time.sleep(0.05)


def _state(width: int, layers: int) -> tuple[Context, TrainState]:
    testing.reset_accelerate_state()
    torch.manual_seed(0)
    ctx = Context(accelerator=Accelerator(cpu=True))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # momentum buffers exist: the optimizer state is as large as the model
    opt.zero_grad(set_to_none=True)  # between updates: no partial gradients to keep
    return ctx, TrainState.create(ctx, model=model, optimizer=opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import s3fs

    proc, endpoint = _server()
    options = {
        "endpoint_url": endpoint,
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    fs = s3fs.S3FileSystem(**options, use_listings_cache=False)
    fs.call_s3("create_bucket", Bucket="bench")
    ctx, state = _state(args.width, args.layers)
    times: dict[str, list[float]] = {}
    local = Path(tempfile.mkdtemp())
    try:
        for r in range(args.repeats):
            root = f"s3://bench/run-{r}"
            t = time.perf_counter()
            save_checkpoint(ctx, root, state, storage_options=options)
            times.setdefault("trainfold save", []).append(time.perf_counter() - t)
            ckpt = f"bench/run-{r}/ckpt-0000000000"
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(ckpt, detail=False)]
            size = sum(fs.info(f"{ckpt}/{n}")["size"] for n in names)
            copy = local / f"copy-{r}"
            fs.get(f"{ckpt}/", str(copy) + "/", recursive=True)

            t = time.perf_counter()
            fs.put(str(copy) + "/", f"bench/put-{r}/", recursive=True)
            times.setdefault("s3fs put (same files)", []).append(time.perf_counter() - t)

            t = time.perf_counter()
            load_checkpoint(ctx, root, state, storage_options=options)
            times.setdefault("trainfold load (verified)", []).append(time.perf_counter() - t)

            t = time.perf_counter()
            fs.get(f"{ckpt}/", str(local / f"get-{r}") + "/", recursive=True)
            times.setdefault("s3fs get (same objects)", []).append(time.perf_counter() - t)

            t = time.perf_counter()
            save_checkpoint(ctx, f"s3://bench/async-{r}", state, storage_options=options, async_save=True)
            times.setdefault("step blocked by a background save", []).append(time.perf_counter() - t)
            ctx.wait_for_checkpoints()

            memory = Path(tempfile.mkdtemp(dir="/dev/shm"))
            save_checkpoint(ctx, memory, state)
            t = time.perf_counter()
            load_checkpoint(ctx, memory, state)
            times.setdefault("trainfold load from a memory tier (/dev/shm)", []).append(time.perf_counter() - t)
            shutil.rmtree(memory)
            for prefix in (f"bench/run-{r}", f"bench/put-{r}", f"bench/async-{r}"):
                fs.rm(prefix, recursive=True)
            shutil.rmtree(copy)
            shutil.rmtree(local / f"get-{r}")
            print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        ctx.close()
        proc.kill()
        shutil.rmtree(local, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    mb = size / 2**20
    print(f"checkpoint: {mb:.0f} MB in {len(names)} objects; medians of {args.repeats} rounds\n")
    print("| operation | seconds | MB/s |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {mb / v:.0f} |")
    ratios = {
        "save throughput / s3fs put": med["s3fs put (same files)"] / med["trainfold save"],
        "verified load throughput / s3fs get": med["s3fs get (same objects)"] / med["trainfold load (verified)"],
        "background save's blocked time / blocking save": med["step blocked by a background save"]
        / med["trainfold save"],
        "memory tier load / S3 verified load": med["trainfold load from a memory tier (/dev/shm)"]
        / med["trainfold load (verified)"],
    }
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    print(json.dumps({"medians_s": med, "mb": mb, "ratios": ratios}))


if __name__ == "__main__":
    main()
