"""testing.check_resume, the resume conformance kit, on the loaders users stream with (tests/scripts/kit_loaders.py):
each case resumes exactly, or is refused by name before a batch; a loader that loses or repeats a sample at a resume
is found out, with the ids."""

import sys
import time
from pathlib import Path

import helpers
import pytest

from trainfold import testing
from trainfold.testing import ResumeCase

pytestmark = pytest.mark.multiprocess  # its runs are processes of run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import kit_loaders  # noqa: E402  (imported by name in the kit's processes too)

SDL = {"use_stateful_dataloader": True}


def _orphans_since(start: float) -> list[str]:
    """Processes started since ``start`` whose parent is gone (adopted by the system's first process) and that run a
    forkserver's child: what a killed run's loader workers became when the kill left them behind."""
    import psutil

    found = []
    for proc in psutil.process_iter(["ppid", "create_time", "cmdline"]):
        info = proc.info
        if (
            info["ppid"] == 1
            and info["create_time"] >= start
            and "multiprocessing.forkserver" in " ".join(info["cmdline"] or ())
        ):
            found.append(f"{proc.pid}: {' '.join(info['cmdline'])[:200]}")
    return found


def test_a_map_style_loader_resumes_exactly_in_every_case():
    """The kit's whole matrix: killed on 2 processes and resumed on 1, 2 and 3, a second resume inside the epoch
    (2 -> 1 -> 3), a resume at an epoch's end, each with 0 and 2 loader workers; and the resume's cost measured. A
    killed process leaves nothing behind (its loader's workers, started from a forkserver, went with it)."""
    start = time.time()
    report = testing.check_resume(kit_loaders.map_style)

    deadline = time.monotonic() + helpers.scaled(30)  # (a killed process's children end a moment after it)
    while _orphans_since(start) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [] == _orphans_since(start)

    assert report.cases == testing.default_cases() and len(report.cases) == 10
    assert {r.outcome for r in report.results} == {"exact"}, str(report)
    assert all(r.stopped_at for r in report.results)  # every case was resumed from a checkpoint it made
    assert (
        report.cost is not None and 0 < report.cost.early_update < report.cost.late_update < report.cost.epoch_updates
    )


@pytest.mark.parametrize(
    "loader, config, expected",
    [
        (
            kit_loaders.datasets_buffer,
            None,
            {(2, (1,), 0): "exact", (2, (1, 3), 0): "exact", (2, (2,), 2): "exact", (2, (3,), 2): "refused"},
        ),
        (
            kit_loaders.stateful_stream,
            None,
            {(2, (3,), 0): "exact", (2, (2,), 2): "exact", (2, (1,), 2): "refused"},
        ),
        (kit_loaders.plain_stream, None, {(2, (2,), 0): "exact", (2, (1,), 0): "refused"}),
        (kit_loaders.map_style, SDL, {(2, (1,), 0): "exact", (2, (2,), 2): "exact", (2, (3,), 2): "refused"}),
        (kit_loaders.stateful_stream, SDL, {(2, (2,), 2): "exact", (2, (3,), 2): "refused"}),
    ],
    ids=[
        "datasets-buffer",
        "own-stateful-stream",
        "stream-without-state",
        "stateful-dataloader",
        "stateful-dataloader-stream",
    ],
)
def test_each_loader_resumes_exactly_or_is_refused_by_name(loader, config, expected):
    """Each case either trains every sample once an epoch or is refused before a batch by a CheckpointError that names
    the way to resume; a refusal is reported as one, never as a pass."""
    cases = [ResumeCase(saved, resumed, workers) for saved, resumed, workers in expected]
    report = testing.check_resume(loader, cases=cases, dataloader_config=config, cost=False)

    assert [r.outcome for r in report.results] == list(expected.values()), str(report)
    for r in report.results:
        if r.outcome == "refused":  # the message says how many processes saved it, and how to resume
            assert "2 processes" in r.detail and "esume" in r.detail, r.detail
    assert report.exact == all(outcome == "exact" for outcome in expected.values())


@pytest.mark.parametrize(
    "loader, lost",
    [(kit_loaders.skips_one, "missing"), (kit_loaders.repeats_one, "repeated")],
    ids=["skips", "repeats"],
)
def test_a_stream_that_resumes_one_sample_off_is_found_out(loader, lost):
    """A stream whose loaded state starts one sample late (or early): the kit names the ids lost (or trained twice)."""
    report = testing.check_resume(loader, cases=[ResumeCase(2, (1,))], cost=False)

    (result,) = report.results
    assert result.outcome == "wrong" and len(getattr(result, lost)) >= 1, str(report)
    with pytest.raises(AssertionError, match="wrong"):
        report.assert_sound()


def test_a_loader_the_processes_cannot_import_is_refused_at_once():
    def local(request):
        return kit_loaders.map_style(request)

    with pytest.raises(TypeError, match="top level of an importable module"):
        testing.check_resume(local)


def test_a_report_keeps_what_the_resumes_warned():
    """A stream without a state is resumed by reading the consumed part again; the resume says so, and the case's
    result keeps the warning. (On one process: 24 updates an epoch, killed well inside the first.)"""
    report = testing.check_resume(kit_loaders.plain_stream, cases=[ResumeCase(1, (1,))], cost=False)

    (result,) = report.results
    assert result.outcome == "exact" and 0 < result.stopped_at[0] < 24, str(result)
    assert any("again and dropping them" in m for m in result.said), result.said
