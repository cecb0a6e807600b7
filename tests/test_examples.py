"""Every example runs end to end in its reduced (smoke) size, so none of them rots."""

import subprocess
import sys
from pathlib import Path

import pytest

import helpers

pytestmark = (
    pytest.mark.multiprocess
)  # spawns processes: the multi-process part (make test-multiprocess), not the in-process one

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "script,expect",
    [
        ("digits.py", "test accuracy"),
        ("quickstart.py", "test accuracy"),
        ("char_lm.py", "A sample:"),
        ("hparam_search.py", "best lr"),
        ("cross_validation.py", "cross-validated accuracy"),
    ],
)
def test_example_runs_in_smoke_mode(script, expect):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--smoke"], capture_output=True, text=True, timeout=helpers.scaled(300)
    )

    assert 0 == result.returncode, result.stderr[-3000:]
    assert expect in result.stdout


def test_the_copyable_test_file_passes():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES / "test_my_training.py")],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(300),
        cwd=EXAMPLES,
    )

    assert 0 == result.returncode, result.stdout[-3000:]
    assert "4 passed" in result.stdout


def test_the_benchmark_ab_script_compares_two_versions_in_one_process():
    """benchmarks/ab.py: the last commit (read with git archive) against the working tree (a directory)."""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "ab.py"),
            "HEAD",
            str(root),
            "--configs",
            "plain",
            "--processes",
            "1",
            "--rounds",
            "1",
            "--optimizer",
            "adamw",
        ],
        capture_output=True,
        text=True,
        timeout=helpers.scaled(300),
    )

    assert 0 == result.returncode, result.stderr[-3000:]
    assert "optimizer: adamw, built as AdamW\n" in result.stdout  # what the timed processes built
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.strip()}
    assert float(rows["trainfold_a:plain"][0]) > 0 and float(rows["trainfold_b:plain"][0]) > 0
    assert "rounds," in " ".join(rows["plain"])
