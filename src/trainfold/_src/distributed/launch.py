"""Run a function on N local processes with gloo: the engine of testing.run_distributed."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from trainfold._src.distributed.teardown import settle_collectives


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now.

    Examples:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: how long the processes may take to start (a fresh interpreter importing torch and the function's module: seconds on a
#: quiet machine, minutes on a loaded one) before ``timeout`` starts counting
STARTUP_S = 600.0


def load_factor() -> float:
    """How many times longer than on a quiet machine CPU-bound work may take here now: the 1-minute load average
    per core this process may run on, or 1 where the machine is not overloaded (or says nothing of its load).

    A time limit that is a hang-guard is stretched by it (:func:`run_distributed`'s ``timeout``, the test suite's
    limits), so a machine at a load of 16 on 2 cores waits 8 times as long rather than failing a correct run.

    Examples:
        >>> load_factor() >= 1.0
        True
    """
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1.0, os.getloadavg()[0] / max(1, cores))
    except OSError:
        return 1.0


#: what the processes' server imports once, so that each process starts with them imported (see :func:`_context`):
#: trainfold and what a process of it imports on first use, ~4 s of a fresh process's CPU in all: FSDP2 and DTensor
#: (Accelerate's FSDP plugin imports them when it is built), distributed checkpointing, dynamo (an optimizer's
#: constructor imports it), and ``datasets`` where it is installed (Accelerate's ``prepare_data_loader`` imports it then);
#: DeepSpeed, transformers (Accelerate's DeepSpeed path imports it) and peft where they are installed, ~3 s more a process.
#: A module that is not installed is passed over.
PRELOAD = (
    "torch",
    "accelerate",
    "trainfold",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "datasets",
    "deepspeed",
    "transformers",
    "peft",
)


def _context() -> Any:
    """Where the processes come from: forked from a server that has imported :data:`PRELOAD`, where there is one.

    A fresh interpreter spends ~3 s of CPU importing torch and Accelerate, and ~4 s
    more on what a run imports on first use; a process forked from multiprocessing's
    forkserver starts with them imported, in ~0.1 s. The server imports them and
    nothing else runs in it (no process group, no Accelerate state, no thread pool of
    torch's; pyarrow, under ``datasets``, starts its allocator's background thread,
    which its fork handlers take care of), so each process starts as clean as a
    spawned one; the caller's environment, which the server does not follow, is
    handed to each (:func:`_worker`). Spawned interpreters where there is no
    forkserver (Windows).
    """
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def _take_environment(environ: dict[str, str]) -> None:
    """The caller's environment at the call, as a spawned process would have it, and its thread count.

    The forkserver's processes inherit the environment the server started with.
    torch's OpenMP read ``OMP_NUM_THREADS`` when the server imported it, so a value
    set since (Accelerate sets 1 on a CPU) is applied to torch here too; and fsspec
    (which ``datasets`` imports) read its ``FSSPEC_*`` settings (an S3 endpoint), read
    again here.
    """
    if environ == os.environ:
        return
    os.environ.clear()
    os.environ.update(environ)
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    fsspec_config = sys.modules.get("fsspec.config")
    if (
        fsspec_config is not None
    ):  # fsspec read its FSSPEC_* settings when the server imported it (under datasets): again
        fsspec_config.conf.clear()
        fsspec_config.set_conf_files(
            environ.get("FSSPEC_CONFIG_DIR", fsspec_config.default_conf_dir), fsspec_config.conf
        )
        fsspec_config.set_conf_env(fsspec_config.conf)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    environ: dict[str, str],
) -> None:
    _take_environment(environ)
    Path(out, f"ready-{rank}").touch()  # started: the function's module (and torch) imported
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as accelerate's debug_launcher does
    result: dict[str, Any]
    try:
        result = {"ok": fn(*args, **kwargs)}
    except BaseException as exc:  # reported to the parent, which re-raises
        result = {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    if "error" in result:
        # as a failed torchrun worker: exit now, without waiting on peers that may be stuck in a collective
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Rank 0 holds the group's TCP store, which the others may still be using (setting up a sub-group of a mesh):
    # nobody leaves before every rank has its result. A rank that dies instead is the parent's to stop.
    while not all(Path(out, f"{r}.pkl").exists() for r in range(world)):
        time.sleep(0.01)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        settle_collectives()
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], *args: Any, nprocs: int = 2, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` fresh processes wired for ``torch.distributed``.

    The processes are forked from multiprocessing's forkserver, which has imported
    torch, Accelerate, trainfold and what they import on first use (:data:`PRELOAD`) and
    done nothing else (0.1 s to start instead of ~7 s of CPU for a new interpreter;
    spawned interpreters where there is no forkserver). The
    server starts at the first call and stays for the life of the calling process.
    Each starts with the caller's environment as it is at the call, plus what torchrun
    would give it (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a free local port), so
    ``Accelerator(cpu=True)`` inside ``fn`` joins a gloo group. ``fn`` must be
    importable (a module-level function) and return picklable values. The
    process group is destroyed when ``fn`` returns. A process may start processes of
    its own (a ``DataLoader``'s workers): they are not daemons, and every one is
    stopped before the call returns, an interrupted call's too.

    Returns:
        Each rank's return value, in rank order.

    ``timeout`` counts from the moment every process has started (its interpreter
    up, the function's module imported), so a loaded machine's slow start-up
    (up to :data:`STARTUP_S`) does not eat into it; both are stretched by the
    machine's load (:func:`load_factor`, the most seen while waiting), so they
    guard against a hang, not against a busy machine.

    Raises:
        RuntimeError: a rank raised (its error and traceback are in the message;
            the other ranks are stopped rather than left hanging).
        TimeoutError: the ranks did not start within ``STARTUP_S`` seconds, or did not
            finish within ``timeout`` seconds of starting (each times the load factor).

    Example (``fn`` must be importable, so it lives in a module):

        # my_tests.py
        def per_rank():
            from accelerate import Accelerator
            return Accelerator(cpu=True).process_index

        def test_two_ranks():
            assert [0, 1] == testing.run_distributed(per_rank, nprocs=2)
    """
    context = _context()
    port = free_port()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="trainfold-dist-") as out:
        procs = [
            context.Process(target=_worker, args=(fn, r, nprocs, port, out, args, kwargs, environ), daemon=False)
            for r in range(nprocs)
        ]
        try:
            for p in procs:
                p.start()
            started, stretch = _wait(procs, out, timeout)
        finally:  # an interrupted caller (Ctrl-C) too: no process is left behind, nor waited for at exit
            for p in procs:
                if p.is_alive():
                    p.kill()
                if p.pid is not None:
                    p.join()
        results = [_read(out, r) for r in range(nprocs)]
    errors = [r for r in results if r is not None and "error" in r]
    if errors:
        raise RuntimeError("\n".join(f"{e['error']}\n{e['traceback']}" for e in errors))
    if any(r is None for r in results):
        missing = [i for i, r in enumerate(results) if r is None]
        raise TimeoutError(
            f"ranks {missing} did not finish within {timeout * stretch:.0f}s of starting (killed)"
            if started
            else f"ranks {missing} did not start within {STARTUP_S * stretch:.0f}s (killed)"
        )
    return [r["ok"] for r in results]  # type: ignore[index]


def _wait(procs: list[Any], out: str, timeout: float) -> tuple[bool, float]:
    """Wait until every process has ended, one failed (and the others had a moment), or a limit passed; whether every
    process started, and the stretch the limits had."""
    nprocs = len(procs)
    begun = time.monotonic()
    started_at: float | None = None
    failed_at: float | None = None
    stretch, measured_at = load_factor(), begun
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if now - measured_at > 1.0:  # the most loaded the machine has been since the start stretches the limits
            stretch, measured_at = max(stretch, load_factor()), now
        if started_at is None and all(Path(out, f"ready-{r}").exists() for r in range(nprocs)):
            started_at = now  # the time asked for counts from here
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now  # give the others a moment, then stop them rather than wait on a hang
        late = now - begun > STARTUP_S * stretch if started_at is None else now - started_at > timeout * stretch
        if late or (failed_at is not None and now - failed_at > 5.0 * stretch):
            break
        time.sleep(0.05)
    return started_at is not None, stretch


def _read(out: str, rank: int) -> dict[str, Any] | None:
    path = Path(out, f"{rank}.pkl")
    return pickle.loads(path.read_bytes()) if path.exists() else None
