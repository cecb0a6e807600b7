"""SIGKILL a training process at random moments, resume it each time: the end is bit-identical."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from trainfold import testing

SCRIPT = Path(__file__).resolve().parent / "scripts" / "resumable_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run_to_end(root, out):
    result = subprocess.run([sys.executable, str(SCRIPT), str(root), str(out)], capture_output=True, text=True, timeout=120, env=ENV)
    assert 0 == result.returncode, result.stderr[-3000:]
    return load_file(str(out))


def _run_and_kill(root, out, delay):
    with subprocess.Popen([sys.executable, str(SCRIPT), str(root), str(out), "--slow-saves"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) as proc:
        ready = proc.stdout.readline().strip()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert "ready" == ready, err[-3000:]
    return proc.returncode


def test_killed_at_random_moments_and_resumed_ends_with_the_same_parameters(tmp_path):
    expected = _run_to_end(tmp_path / "clean", tmp_path / "clean.safetensors")

    rng = random.Random(1234)
    root = tmp_path / "killed"
    kills = 0
    for _ in range(5):
        code = _run_and_kill(root, tmp_path / "killed.safetensors", rng.uniform(0.02, 0.4))
        kills += code == -signal.SIGKILL
    resumed = _run_to_end(root, tmp_path / "killed.safetensors")

    assert kills >= 3  # most runs really were killed mid-training
    testing.assert_params_equal(expected, resumed)
