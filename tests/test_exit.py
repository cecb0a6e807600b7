"""A two-process run ends: under torchrun, many times over, every process exits 0 within a hard timeout.

Found by running the exit many times: ``accelerator.end_training()`` inside ``with Context(...)`` (Accelerate's
usual last line) destroyed the process group while a background checkpoint was still being written, and both
processes then waited forever in the save's next collective (24 of 33 runs hung). The Context now makes
``end_training`` commit the save in flight first.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainfold.testing import free_port

pytestmark = pytest.mark.multiprocess  # spawns processes: run serially, not under pytest-xdist

SCRIPT = Path(__file__).resolve().parent / "scripts" / "exit_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
RUNS = 3


def _run(root, *extra):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(SCRIPT), str(root), *extra]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=90, env=ENV)
    except subprocess.TimeoutExpired as exc:  # the hang this guards against: fail, with what it printed
        pytest.fail(f"the run did not exit within 90 s:\n{(exc.stdout or b'')[-2000:]!r}\n{(exc.stderr or b'')[-3000:]!r}")


def test_a_two_process_run_that_calls_end_training_with_a_background_save_in_flight_exits_every_time(tmp_path):
    """(A run ended by the with block alone exits in the other torchrun tests: test_kill_resume, test_signals.)"""
    for i in range(RUNS):
        done = _run(tmp_path / f"run{i}", "--end-training")
        assert 0 == done.returncode, done.stderr[-3000:]
        assert done.stdout.count("done") == 2  # both processes got past the block
