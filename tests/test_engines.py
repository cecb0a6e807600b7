"""The engines that run jobs: a script that resumes by itself, relaunched by them with another world size.

Each launch here is a real one: torchrun agents on 127.0.0.1 (c10d rendezvous), the workers they start, the kills an
engine meets (an agent lost with its node, a launcher killed by hand).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers

from trainfold import testing

pytestmark = pytest.mark.multiprocess  # spawns processes: the multi-process part (make test-multiprocess)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _gone(pid):
    """Whether ``pid`` has ended (a zombie has: nothing may reap an orphan in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if not _gone(pid)]


def test_workers_end_when_their_launcher_is_killed(tmp_path):
    """``kill -9`` of a torchrun job's process group misses its workers (torchrun starts each in a session of its own):
    they notice their launcher is gone within a second, say so and exit, instead of training on beside the job that
    is started again."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(testing.free_port()),
        str(SCRIPTS / "signal_run.py"),
        str(tmp_path / "ckpt"),
        str(tmp_path / "out.st"),
        "--step-s",
        "0.2",  # 24 s of training: far longer than the workers may outlive their launcher
    ]
    err = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV, start_new_session=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert all(line.startswith("ready") for line in lines), lines + [(tmp_path / "stderr.log").read_text()]
        pids = [int(line.split()[2]) for line in lines]
        while not proc.stdout.readline().startswith("update 2"):  # training, with one update to spare
            assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=helpers.scaled(30))
        left = _wait_gone(pids, helpers.scaled(10))
    finally:
        for pid in pids if "pids" in locals() else ():
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        err.close()
        proc.stdout.close()

    said = (tmp_path / "stderr.log").read_text()
    assert not left, f"workers {left} trained on without their launcher:\n{said[-3000:]}"
    assert said.count("the launcher that started this process") == 2, said[-3000:]
    assert "exiting: an engine that starts the job again resumes it from its newest checkpoint" in said
    assert not (tmp_path / "out.st").exists()  # they stopped, not finished
