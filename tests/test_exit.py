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

import helpers

from trainfold.testing import free_port

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

SCRIPT = Path(__file__).resolve().parent / "scripts" / "exit_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
RUNS = 3


def _run(root, *extra):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        str(root),
        *extra,
    ]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=helpers.scaled(90), env=ENV)
    except subprocess.TimeoutExpired as exc:  # the hang this guards against: fail, with what it printed
        pytest.fail(
            f"the run did not exit within 90 s:\n{(exc.stdout or b'')[-2000:]!r}\n{(exc.stderr or b'')[-3000:]!r}"
        )


def test_end_training_with_a_save_in_flight(tmp_path):
    """(A run ended by the with block alone exits in the other torchrun tests: test_kill_resume, test_signals.)"""
    for i in range(RUNS):
        done = _run(tmp_path / f"run{i}", "--end-training")
        assert 0 == done.returncode, done.stderr[-3000:]
        assert done.stdout.count("done") == 2  # both processes got past the block


def _rounds_on_this_rank():
    from accelerate import Accelerator

    from trainfold import Context, make_step, run_epoch, testing

    ctx = Context(accelerator=Accelerator(cpu=True))
    _, state, loader, loss_fn = testing.tiny_setup(accelerator=ctx.accelerator, n=64)
    run_epoch(ctx, make_step(ctx, loss_fn), loader, state)
    in_flight = ctx.runtime.interrupt._pending
    launched = in_flight is not None
    ctx.accelerator.end_training()
    return launched, ctx.runtime.interrupt._pending is None, in_flight is None or in_flight[0].is_completed()


@pytest.mark.multiprocess
def test_end_training_waits_for_the_last_round():
    """The teardown order: the signal agreement launches a round without waiting for it, so a run ends with one in
    flight on the control group; it is completed before Accelerate destroys the groups, never left running under them.
    Fifteen short runs, each bounded: ``end_training`` destroying the groups while one of gloo's worker threads still
    waited for the GIL to free a finished collective hung (found by CI: 6 of 40 calls in a loop of their own; this test
    without the fix failed one time in four), until the wrapper let go of the GIL first."""
    from trainfold import testing

    for _ in range(15):
        for launched, forgotten, completed in testing.run_distributed(_rounds_on_this_rank, nprocs=2, timeout=30):
            assert launched and forgotten and completed
