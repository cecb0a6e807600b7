"""SIGKILL a training process at random moments, resume it each time: the end is bit-identical."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
import torch
from safetensors.torch import load_file

from trainfold import latest_checkpoint, testing, verify_checkpoint

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

SCRIPT = Path(__file__).resolve().parent / "scripts" / "resumable_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import resumable_run  # noqa: E402  (its main(argv), run by testing.run_distributed)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _to_end(root, out, extra, processes, monkeypatch):
    """resumable_run.py's run, to its end, on ``processes`` processes of ``testing.run_distributed`` (forked with torch
    and Accelerate imported: seconds less than torchrun's new interpreters; the killed runs are real launches)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    testing.run_distributed(resumable_run.main, [str(root), str(out), *extra], nprocs=processes, timeout=600)
    return load_file(str(out))


def _run_to_end(root, out, *extra, monkeypatch):
    return _to_end(root, out, extra, 1, monkeypatch)


def _run_and_kill(root, out, delay, *extra):
    with subprocess.Popen(
        [sys.executable, str(SCRIPT), str(root), str(out), "--slow-saves", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    ) as proc:
        ready = proc.stdout.readline().strip()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=helpers.scaled(30))
    assert ready.startswith("ready"), err[-3000:]
    return proc.returncode


@pytest.fixture
def memory_root(tmp_path):
    """A checkpoint root in /dev/shm (a memory tier's), removed after."""
    import shutil

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    root = Path("/dev/shm") / f"trainfold-test-{os.getpid()}-{testing.free_port()}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    "extra, where", [((), "disk"), (("--lora",), "disk"), ((), "memory")], ids=["full", "lora", "memory"]
)
def test_kill_and_resume(tmp_path, extra, where, request, monkeypatch):
    """One process, a checkpoint after every update; with --lora a frozen base under LoRA adapters (adapter checkpoints:
    the base by fingerprint, checked at each resume), whose base must come out untouched; in /dev/shm, as a memory tier
    is (kills inside its writes leave the checkpoint before them)."""
    expected = _run_to_end(tmp_path / "clean", tmp_path / "clean.safetensors", *extra, monkeypatch=monkeypatch)

    rng = random.Random(1234)
    root = request.getfixturevalue("memory_root") if where == "memory" else tmp_path / "killed"
    kills = 0
    for _ in range(5):
        code = _run_and_kill(root, tmp_path / "killed.safetensors", rng.uniform(0.02, 0.4), *extra)
        kills += code == -signal.SIGKILL
    resumed = _run_to_end(root, tmp_path / "killed.safetensors", *extra, monkeypatch=monkeypatch)

    assert kills >= 3  # most runs really were killed mid-training
    testing.assert_params_equal(expected, resumed)
    if extra:
        assert "frozen" in (latest_checkpoint(root) / "state.json").read_text()
        base = {n: p for n, p in helpers.lora_mlp(width=64).named_parameters() if not p.requires_grad}
        assert base and all(torch.equal(base[n], resumed[n]) for n in base)


def _torchrun(root, out, *extra):
    """The 2-process job: under FSDP2 unless ``extra`` says ``--ddp``."""
    from trainfold.testing import free_port

    engine = [] if "--ddp" in extra else ["--fsdp2"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        str(root),
        str(out),
        *engine,
        *[e for e in extra if e != "--ddp"],
    ]


def _fsdp2_to_end(root, out, *extra, monkeypatch):
    """The 2-process job (FSDP2 unless ``extra`` says ``--ddp``), to its end."""
    engine = () if "--ddp" in extra else ("--fsdp2",)
    return _to_end(root, out, (*engine, *[e for e in extra if e != "--ddp"]), 2, monkeypatch)


def _newest(root):
    return latest_checkpoint(root) if root.exists() else None


def _fsdp2_killed(root, out, delay, *extra):
    """Start the 2-process FSDP2 job, SIGKILL the launcher and both workers ``delay`` s after it committed a new checkpoint."""
    return helpers.kill_after_a_new_checkpoint(_torchrun(root, out, *extra), ENV, lambda: _newest(root), delay)


@pytest.mark.parametrize(
    "extra",
    [("--async-saves",), ("--async-saves", "--lora"), ("--ddp", "--lora")],
    ids=["async", "async-lora", "ddp-lora"],
)
def test_two_process_kill_and_resume(tmp_path, extra, monkeypatch):
    """torchrun, 2 CPU processes under FSDP2, sharded checkpoints after every update, written in the background (the
    blocking path is the same write-and-commit, run inline; pass () here to run it too): killed (launcher and workers,
    SIGKILL) at random moments, restarted each time, it ends bit for bit as a clean run. The same with a LoRA model
    (adapter checkpoints: each process its pieces of the adapters, the base by fingerprint), and under DDP with
    blocking saves."""
    expected = _fsdp2_to_end(tmp_path / "clean", tmp_path / "clean.safetensors", *extra, monkeypatch=monkeypatch)

    rng = random.Random(99)
    root = tmp_path / "killed"
    slow = (
        *extra,
        "--slow-saves",
    )  # 50 ms a micro-batch: the job trains for about two seconds, and the kills land inside
    kills = sum(
        _fsdp2_killed(root, tmp_path / "killed.safetensors", rng.uniform(0.1, 0.8), *slow) == -signal.SIGKILL
        for _ in range(3)
    )
    progress = verify_checkpoint(latest_checkpoint(root))["step"]  # the kills left the run part-way
    resumed = _fsdp2_to_end(root, tmp_path / "killed.safetensors", *extra, monkeypatch=monkeypatch)

    assert kills >= 2
    assert 0 < progress < verify_checkpoint(latest_checkpoint(root))["step"]
    testing.assert_params_equal(expected, resumed)
