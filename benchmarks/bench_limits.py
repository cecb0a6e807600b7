"""Checkpoints at the machine's limits: each save's and load's time and host memory, against raw I/O of the same bytes.

    python benchmarks/bench_limits.py [--sizes 0.5,2,4] [--storage disk,s3] [--layouts gathered,sharded]
                                      [--rounds 2] [--json FILE]

For each state size (GB of weights and SGD-momentum state together: --layers of ``Linear(4096, 4096)``, 64 MiB a
tensor), layout (``gathered``: DDP, every process holding the whole state, the main process writing it; ``sharded``:
FSDP2, each process holding and writing its half) and storage (``disk``: a folder under ``$HOME``; ``s3``: a bucket on
moto's S3 server on 127.0.0.1, started here), two CPU processes (gloo) run a few rounds of, each between barriers:

- trainfold's blocking ``save_checkpoint``, and a raw write of the same bytes: each file this process writes in
  trainfold's layout, from the live tensors, one thread per file, then ``fsync`` (disk); a multipart upload of them
  through the same s3fs client, 16 MiB parts, 8 at once (S3);
- a background save (``async_save=True``, to a root of its own saved to once before the rounds, as a run's later
  saves are): the time the caller is blocked, against a copy of the tensors it stages (``clone``, just before), and
  the time until it is committed;
- trainfold's verified ``load_checkpoint`` into the live model, and a raw read of the same files into fresh memory
  (disk: ``readinto``, one thread per file; S3: ranged GETs, 64 MiB, 4 at once), with the page cache warm, then
  cold (dropped before each, through ``/proc/sys/vm/drop_caches``: needs root; the table says where it could not).
  On moto, which keeps every object in its own memory, cold changes nothing but the client's side; that memory also
  limits the S3 cases to what the machine holds beside the two processes (2 GB of state did not fit in 24 GB).

Printed for each case: the slowest process's time (median over rounds) of trainfold and of the raw baseline, and
their throughput ratio (raw time / trainfold's: a save's and a load's target is at least 0.9); the background save's
blocked time over the copy's (the target: at most the copy + 10 ms); and each operation's peak growth of resident
memory (``VmHWM``, reset before it) on the process that grew most, over its bound: max(64 MiB, 2 x the largest
tensor) for a blocking save (and for a background save beyond its staged copy), the state once for a load into a
live model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

WIDTH = 4096
TENSOR = WIDTH * WIDTH * 4  # bytes of one weight (and of its momentum)
MiB = 1 << 20
PART, UPLOADS = 16 << 20, 8  # the raw upload's parts: trainfold's own sizes (storage/upload.py)
RANGE, GETS = 64 << 20, 4  # the raw download's ranges (storage/remote.py)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def _measured(work: Callable[[], Any], times: dict[str, list[float]], peaks: dict[str, int], name: str) -> None:
    """``work()`` between barriers: its time (the slowest process's, as the barriers make it) and its peak growth of
    resident memory on this process."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    start = time.perf_counter()
    work()
    dist.barrier()
    times.setdefault(name, []).append(time.perf_counter() - start)
    peaks[name] = max(peaks.get(name, 0), _status("VmHWM") - before)


def _drop_page_cache() -> bool:
    """Whether the page cache was dropped (root on Linux); on every process after a barrier."""
    import torch.distributed as dist

    dist.barrier()
    dropped = True
    if dist.get_rank() == 0:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        except OSError:
            dropped = False
    flag = [dropped]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def _state(ctx: Any, layers: int) -> Any:
    from trainfold import TrainState, make_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    state = TrainState.create(ctx, model=model, optimizer=optimizer)
    return make_step(ctx, lambda m, b: m(b).pow(2).mean())(state, torch.randn(2, WIDTH))  # the momentum exists


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _own_files(state: Any, layout: str, rank: int) -> list[list[torch.Tensor]]:
    """The tensors of each large file this process writes in trainfold's layout: the main process's model and
    optimizer files (gathered), this process's shard file (sharded)."""
    model = [_local(t) for t in state.model.state_dict().values()]
    moments = [_local(s["momentum_buffer"]) for s in state.optimizer.optimizer.state.values()]
    if layout == "sharded":
        return [model + moments]
    return [model, moments] if rank == 0 else []


def _raw_write(folder: Path, files: list[list[torch.Tensor]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)

    def write(i: int) -> None:
        with open(folder / f"raw-{i}", "wb") as f:
            for t in files[i]:
                f.write(memoryview(t.detach().numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    with ThreadPoolExecutor(max_workers=max(1, len(files))) as pool:
        list(pool.map(write, range(len(files))))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(paths: list[Path]) -> list[torch.Tensor]:
    def read(path: Path) -> torch.Tensor:
        buf = torch.empty(path.stat().st_size, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            view, done = memoryview(buf.numpy()), 0
            while done < len(view):
                done += f.readinto(view[done:])
        return buf

    with ThreadPoolExecutor(max_workers=max(1, len(paths))) as pool:
        return list(pool.map(read, paths))


def _raw_upload(fs: Any, prefix: str, files: list[list[torch.Tensor]]) -> None:
    bucket, key, _ = fs.split_path(prefix)

    def one(i: int) -> None:
        name = f"{key}/raw-{i}"
        views = [memoryview(t.detach().numpy()).cast("B") for t in files[i]]
        parts = [v[s : s + PART] for v in views for s in range(0, len(v), PART)]
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name)["UploadId"]

        def send(n: int) -> dict[str, Any]:
            out = fs.call_s3(
                "upload_part", Bucket=bucket, Key=name, UploadId=upload, PartNumber=n + 1, Body=bytes(parts[n])
            )
            return {"PartNumber": n + 1, "ETag": out["ETag"]}

        with ThreadPoolExecutor(max_workers=UPLOADS) as pool:
            done = list(pool.map(send, range(len(parts))))
        fs.call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=name, UploadId=upload, MultipartUpload={"Parts": done}
        )

    for i in range(len(files)):
        one(i)


def _raw_get(fs: Any, paths: list[str]) -> list[bytearray]:
    def get(path: str) -> bytearray:
        size = fs.info(path)["size"]
        buf = bytearray(size)

        def part(start: int) -> None:
            end = min(start + RANGE, size)
            buf[start:end] = fs.cat_file(path, start=start, end=end)

        with ThreadPoolExecutor(max_workers=GETS) as pool:
            list(pool.map(part, range(0, size, RANGE)))
        return buf

    return [get(p) for p in paths]


def _on_this_rank(
    layers: int, layout: str, storage: str, options: dict[str, Any] | None, where: str, rounds: int
) -> dict[str, Any]:
    import helpers
    import torch.distributed as dist
    from accelerate import Accelerator

    from trainfold import Context, load_checkpoint, save_checkpoint
    from trainfold._src.checkpoint.staging_budget import bytes_to_copy

    ctx = Context(accelerator=helpers.fsdp2_accelerator() if layout == "sharded" else Accelerator(cpu=True), signals=())
    state = _state(ctx, layers)
    rank = dist.get_rank()
    files = _own_files(state, layout, rank)
    staged = [_local(t) for t in state.model.state_dict().values()]
    staged += [_local(s["momentum_buffer"]) for s in state.optimizer.optimizer.state.values()]
    fs = None
    if storage == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(**options, use_listings_cache=False)
    times: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    cold_dropped = True
    storage_options = options if storage == "s3" else None
    sharded = layout == "sharded"
    # the background saves go to one root of their own, saved to once first: a run's later saves are what is timed
    # (its first save to a root takes the root's lock before it returns: on a store, requests)
    background_root = f"{where}-background"
    save_checkpoint(ctx, background_root, state, sharded=sharded, storage_options=storage_options)
    for r in range(rounds):
        root = f"{where}/round-{r}"
        _measured(
            lambda: save_checkpoint(ctx, root, state, sharded=sharded, storage_options=storage_options),
            times,
            peaks,
            "save",
        )
        if fs is None:
            _measured(lambda: _raw_write(Path(where, f"raw-{r}", str(rank)), files), times, peaks, "raw write")
        else:
            _measured(lambda: _raw_upload(fs, f"{where}/raw-{r}/{rank}", files), times, peaks, "raw write")

        def background() -> None:
            start = time.perf_counter()
            save_checkpoint(
                ctx,
                background_root,
                attrs.evolve(state, step=state.step + 1 + r),
                sharded=sharded,
                async_save=True,
                keep_last=1,
                storage_options=storage_options,
            )
            times.setdefault("background: blocked", []).append(time.perf_counter() - start)
            ctx.wait_for_checkpoints()

        # the copy first, in the conditions the background save meets (after a write: the page cache full)
        _measured(lambda: [t.clone() for t in staged], times, peaks, "copy of the staged tensors")
        _measured(background, times, peaks, "background: until committed")

        if fs is None:
            (ckpt,) = Path(root).glob("ckpt-*")
            reads = sorted(p for p in ckpt.iterdir() if p.stat().st_size > MiB)
        else:
            (ckpt,) = (p for p in fs.ls(root.removeprefix("s3://"), detail=False) if "/ckpt-" in p)
            reads = sorted(p for p in fs.ls(ckpt, detail=False) if fs.info(p)["size"] > MiB)
        if layout == "sharded":
            reads = [p for p in reads if os.path.basename(str(p)).startswith(f"shard-{rank}.")]
        for cache in ("warm", "cold"):
            if cache == "warm" and fs is None:
                _raw_read(reads)  # the checkpoint's pages in the cache
            for name, work in (
                ("load", lambda: load_checkpoint(ctx, root, state, storage_options=storage_options)),
                ("raw read", lambda: _raw_read(reads) if fs is None else _raw_get(fs, reads)),
            ):
                if cache == "cold":
                    cold_dropped = _drop_page_cache() and cold_dropped
                _measured(work, times, peaks, f"{name} ({cache})")
        dist.barrier()
        if rank == 0:
            if fs is None:
                shutil.rmtree(where)
                os.makedirs(where)
            else:
                fs.rm(where.removeprefix("s3://"), recursive=True)
        dist.barrier()
    if rank == 0:
        if fs is None:
            shutil.rmtree(background_root)
        else:
            fs.rm(background_root.removeprefix("s3://"), recursive=True)
    figures = {
        "times": times,
        "peaks": peaks,
        "state_bytes": sum(t.numel() * t.element_size() for t in staged),
        "staged_bytes": bytes_to_copy(ctx, state),
        "cold_dropped": cold_dropped,
    }
    ctx.close()
    return figures


def _case(size_gb: float, layout: str, storage: str, rounds: int, endpoint: str | None) -> dict[str, Any]:
    from trainfold import testing

    layers = max(1, round(size_gb * 2**30 / (2 * TENSOR)))
    options = None
    if storage == "s3":
        import s3fs

        options = {
            "endpoint_url": endpoint,
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        bucket = f"limits-{layout}-{layers}"
        s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=bucket)
        where = f"s3://{bucket}/run"
        ranks = testing.run_distributed(
            _on_this_rank, layers, layout, storage, options, where, rounds, nprocs=2, timeout=7200
        )
    else:
        with tempfile.TemporaryDirectory(dir=Path.home()) as where:
            ranks = testing.run_distributed(
                _on_this_rank, layers, layout, storage, options, where, rounds, nprocs=2, timeout=7200
            )
    times = {k: statistics.median(v) for k, v in ranks[0]["times"].items()}
    times["background: blocked"] = statistics.median(
        max(r["times"]["background: blocked"][i] for r in ranks) for i in range(rounds)
    )
    peaks = {k: max(r["peaks"][k] for r in ranks) for k in ranks[0]["peaks"]}
    state_bytes = max(r["state_bytes"] for r in ranks)
    return {
        "size_gb": size_gb,
        "layers": layers,
        "layout": layout,
        "storage": storage,
        "rounds": rounds,
        "times_s": times,
        "peak_growth_bytes": peaks,
        "state_bytes_per_process": state_bytes,
        "staged_bytes_per_process": max(r["staged_bytes"] for r in ranks),
        "cold_dropped": all(r["cold_dropped"] for r in ranks),
    }


def _row(case: dict[str, Any]) -> str:
    t, p = case["times_s"], case["peak_growth_bytes"]
    bound = max(64 * MiB, 2 * TENSOR)
    state = case["state_bytes_per_process"]
    staged = case["staged_bytes_per_process"]
    cold = "cold" if case["cold_dropped"] else "cold (not dropped)"
    cells = [
        f"{case['size_gb']:g} GB",
        case["layout"],
        case["storage"],
        f"{t['save']:.2f} / {t['raw write']:.2f} = **{t['raw write'] / t['save']:.2f}**",
        f"{p['save'] / MiB:.0f} ({p['save'] / bound:.2f})",
        f"{t['background: blocked']:.2f} / {t['copy of the staged tensors']:.2f}",
        f"{(p['background: until committed'] - staged) / MiB:.0f} ({(p['background: until committed'] - staged) / bound:.2f})",
        f"{t['load (warm)']:.2f} / {t['raw read (warm)']:.2f} = **{t['raw read (warm)'] / t['load (warm)']:.2f}**",
        f"{t['load (cold)']:.2f} / {t['raw read (cold)']:.2f} = **{t['raw read (cold)'] / t['load (cold)']:.2f}** {cold}",
        f"{p['load (warm)'] / MiB:.0f} ({p['load (warm)'] / state:.2f})",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| state | layout | storage | save s / raw s = ratio | save's growth MiB (/ bound) | background blocked s / copy s "
    "| background's growth beyond its copy MiB (/ bound) | load warm s / raw s = ratio | load cold s / raw s = ratio "
    "| load's growth MiB (/ state) |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5,2,4", help="GB of state (weights and momentum), comma-separated")
    parser.add_argument("--storage", default="disk,s3")
    parser.add_argument("--layouts", default="gathered,sharded")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    server = None
    endpoint = None
    if "s3" in args.storage.split(","):
        import helpers

        server = helpers.moto_server()
        endpoint = server.__enter__().endpoint
    cases = []
    try:
        for storage in args.storage.split(","):
            for size in (float(s) for s in args.sizes.split(",")):
                for layout in args.layouts.split(","):
                    case = _case(size, layout, storage, args.rounds, endpoint)
                    cases.append(case)
                    print(_row(case), file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    print(f"2 processes; medians of {args.rounds} rounds; bound = max(64 MiB, 2 x {TENSOR // MiB} MiB)\n")
    print(HEADER)
    for case in cases:
        print(_row(case))
    if args.json:
        args.json.write_text(json.dumps(cases, indent=1) + "\n")


if __name__ == "__main__":
    main()
