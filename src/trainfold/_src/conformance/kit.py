"""``check_resume``: a user's loader through kills and resumes on other numbers of processes, every sample counted."""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import attrs

from trainfold._src.conformance.report import (
    CaseResult,
    ResumeCase,
    ResumeCost,
    ResumeReport,
    RunLog,
    compare,
    trained,
)
from trainfold._src.conformance.run import RunSpec, train
from trainfold._src.distributed.launch import run_distributed


def default_cases(processes: Sequence[int] = (1, 2, 3), workers: Sequence[int] = (0, 2)) -> tuple[ResumeCase, ...]:
    """For each ``num_workers``: killed on the second number of processes (the first if there is one) and resumed on
    each; killed there, resumed on the first stopped inside the epoch, then resumed on the last; and stopped at the
    first epoch's end there, resumed on the last."""
    saved = processes[1] if len(processes) > 1 else processes[0]
    cases: list[ResumeCase] = []
    for w in workers:
        cases += [ResumeCase(saved, (p,), w) for p in processes]
        if len(processes) > 1:
            cases.append(ResumeCase(saved, (processes[0], processes[-1]), w))
        cases.append(ResumeCase(saved, (processes[-1],), w, at="epoch_end"))
    return tuple(cases)


def check_resume(
    loader: Callable[..., Any],
    *,
    ids: str | Callable[[Any], Iterable[int]] = "id",
    cases: Iterable[ResumeCase] | None = None,
    epochs: int = 2,
    every: int = 3,
    dataloader_config: dict[str, Any] | None = None,
    cost: bool = True,
    seed: int = 0,
    folder: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
) -> ResumeReport:
    """Train a tiny model on the loader ``loader(request)`` builds, kill it, resume it on other numbers of processes,
    and say for each case whether every sample id was trained once in each epoch.

    Args:
        loader: a module-level function of a ``LoaderRequest`` (its process count, process index and
            ``num_workers``) returning the ``DataLoader`` (or any loader ``ctx.prepare_loaders`` takes) of that
            process; each process of each run calls it once, and the loader is prepared by ``ctx.prepare_loaders``.
            Its epoch must be whole global batches on every process count of the cases, so that an uninterrupted
            run trains each sample once an epoch.
        ids: the key of a batch's sample ids, or a module-level function of a batch returning them.
        cases: the cases to run (``default_cases()`` if None).
        epochs: epochs a run trains.
        every: a checkpoint every this many updates.
        dataloader_config: keyword arguments of Accelerate's ``DataLoaderConfiguration`` (JSON values):
            ``{"use_stateful_dataloader": True}`` for torchdata's ``StatefulDataLoader``.
        cost: also measure the time to the first batch of a resume at 1% and at 90% of an epoch (one process).
        seed: the seed of the kills' moments.
        folder: where the runs' checkpoints and logs go (a temporary folder, removed after, if None).
        timeout: seconds a run may take.

    Returns:
        A ``ResumeReport``: each case ``exact``, ``refused`` (before a batch), ``wrong`` (with the ids missing
        and repeated) or ``failed``.
    """
    kit = _Kit(
        _reference(loader, "loader"),
        ids if isinstance(ids, str) else _reference(ids, "ids"),
        epochs,
        every,
        tuple((dataloader_config or {}).items()),
        timeout,
    )
    chosen = tuple(default_cases() if cases is None else cases)
    with tempfile.TemporaryDirectory(prefix="trainfold-kit-") as scratch:
        base = Path(folder) if folder is not None else Path(scratch)
        rng = random.Random(seed)
        reference = kit.uninterrupted(base / "reference")
        results = [kit.case(base / f"case-{i}", case, rng, reference) for i, case in enumerate(chosen)]
        measured = kit.cost(base / "cost", reference) if cost else None
    return ResumeReport(kit.loader, tuple(results), measured)


def _reference(fn: Any, what: str) -> str:
    """``fn`` as ``"module:qualname"``, which the kit's processes import."""
    if isinstance(fn, str) and ":" in fn:
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module is None or module == "__main__" or "<" in name:
        raise TypeError(
            f"check_resume: {what}={fn!r} must be a function defined at the top level of an importable module "
            "(not a lambda, a local function or one of __main__): the kit's processes import it by name."
        )
    return f"{module}:{name}"


@attrs.frozen
class _Kit:
    """What every run of one ``check_resume`` shares."""

    loader: str
    ids: str
    epochs: int
    every: int
    config: tuple[tuple[str, Any], ...]
    timeout: float

    def spec(self, root: Path, log: Path, workers: int, **kwargs: Any) -> RunSpec:
        return RunSpec(
            self.loader, self.ids, str(root), str(log), workers, self.epochs, self.every, self.config, **kwargs
        )

    def run(self, spec: RunSpec, processes: int) -> RunLog:
        """A run to its end in processes of ``run_distributed``; a refusal is in its log."""
        outs = run_distributed(train, spec.to_json(), nprocs=processes, timeout=self.timeout)
        said = dict.fromkeys(message for out in outs for message in out["said"])  # each once, in order
        return attrs.evolve(RunLog.read(Path(spec.log)), said=tuple(said))

    def uninterrupted(self, folder: Path) -> RunLog:
        """The run on one process, never stopped: each epoch's sample ids, and its batches' size."""
        return self.run(self.spec(folder / "root", folder / "log", 0), 1)

    def case(self, folder: Path, case: ResumeCase, rng: random.Random, reference: RunLog) -> CaseResult:
        root = folder / "root"
        try:
            if case.at == "kill":
                spec = self.spec(root, folder / "run-0", case.workers, slow_s=0.02, announce=True)
                first = self.killed(spec, case.saved_on, rng)
            else:
                first = self.run(self.spec(root, folder / "run-0", case.workers, epoch_end=True), case.saved_on)
            runs, stopped = [first], []
            for i, processes in enumerate(case.resumed_on, start=1):
                at = _newest_step(root)
                stopped.append(at)
                stop = None
                if i < len(case.resumed_on):  # stopped again inside the epoch, its rest whole batches on the next
                    stop = at + _updates_to_whole_rest(runs, at, reference, processes, case.resumed_on[i])
                runs.append(self.run(self.spec(root, folder / f"run-{i}", case.workers, stop_after=stop), processes))
                if runs[-1].refused is not None:
                    break
        except (RuntimeError, TimeoutError, OSError) as exc:
            return CaseResult(case, "failed", detail=str(exc)[-4000:])
        return compare(case, runs, reference, tuple(stopped))

    def killed(self, spec: RunSpec, processes: int, rng: random.Random) -> RunLog:
        """The run, SIGKILLed (every process at once) a random moment after its first new checkpoint."""
        root, log = Path(spec.root), Path(spec.log)
        run = lambda: run_distributed(train, spec.to_json(), nprocs=processes, timeout=self.timeout)  # noqa: E731
        kill_after_a_new_checkpoint(run, log, processes, lambda: _newest(root), rng.uniform(0.05, 0.3))
        return RunLog.read(log)

    def cost(self, folder: Path, reference: RunLog, rounds: int = 3) -> ResumeCost:
        """Stopped (and saved) at 1% and 90% of the first epoch on one process, then resumed ``rounds`` times from a
        copy of each checkpoint: the median time of each from its load to its first batch."""
        n = reference.updates_of_epoch(0)
        early, late = max(1, round(0.01 * n)), max(1, round(0.9 * n))
        medians = []
        for name, at in (("early", early), ("late", late)):
            saved = folder / name / "root"
            self.run(self.spec(saved, folder / name / "stop", 0, stop_after=at), 1)
            times = []
            for r in range(rounds):
                root = shutil.copytree(saved, folder / name / f"root-{r}")
                resumed = self.run(self.spec(root, folder / name / f"resume-{r}", 0, stop_after=at + 1), 1)
                if resumed.first_s is None:
                    raise RuntimeError(f"check_resume: the resume at update {at} trained no batch ({resumed.refused})")
                times.append(resumed.first_s)
            medians.append(statistics.median(times))
        return ResumeCost(n, early, medians[0], late, medians[1])


def _updates_to_whole_rest(runs: list[RunLog], at: int, reference: RunLog, processes: int, then: int) -> int:
    """How many updates on ``processes`` processes from update ``at`` leave the rest of the epoch whole global batches
    on ``then`` processes (Accelerate completes a last global batch that is not whole with samples trained twice),
    the fewest that do; 2 where none does inside the epoch."""
    batch = len(reference.batches[0].ids)
    epoch_size = sum(len(b.ids) for b in reference.batches if b.epoch == 0)
    kept = [b for b in trained(runs) if b.update < at]
    epoch = kept[-1].epoch if kept else 0
    done = sum(len(b.ids) for b in kept if b.epoch == epoch) % epoch_size
    for k in range(1, epoch_size // (batch * processes) + 1):
        rest = epoch_size - done - k * batch * processes
        if rest > 0 and rest % (batch * then) == 0:
            return k
    return 2


def _newest(root: Path) -> str | None:
    from trainfold._src.checkpoint.root import latest_checkpoint

    found = latest_checkpoint(root) if root.exists() else None
    return None if found is None else str(found)


def _newest_step(root: Path) -> int:
    from trainfold._src.checkpoint.root import latest_checkpoint, verify_checkpoint

    found = latest_checkpoint(root)
    if found is None:
        raise RuntimeError(f"check_resume: the run saved no checkpoint in {root}")
    return int(verify_checkpoint(found)["step"])


def kill_after_a_new_checkpoint(
    run: Callable[[], Any], log: Path, processes: int, newest: Callable[[], Any], delay: float
) -> None:
    """``run()`` (a run of ``run_distributed`` whose ``processes`` processes each lead a process group and write
    ``pid-<rank>`` in ``log`` once set up), SIGKILLed, every process at once with what it started (a loader's workers
    are not its children where it starts them from a forkserver, and would wait for it forever), ``delay`` s after ``newest()`` (the newest committed checkpoint)
    changed. A run that ended first is not killed."""
    before, ended = newest(), threading.Event()

    def start() -> None:
        try:
            run()
        except (RuntimeError, TimeoutError):  # the ranks killed: run_distributed finds no result of theirs
            pass
        finally:
            ended.set()

    thread = threading.Thread(target=start, name="trainfold-kit-run", daemon=True)
    thread.start()
    while not ended.is_set() and (len(list(log.glob("pid-*"))) < processes or newest() == before):
        ended.wait(0.02)  # training: the first new checkpoint is the event the kill counts from
    if not ended.wait(delay):
        for path in log.glob("pid-*"):  # each process with its loader's workers (its process group)
            try:
                os.killpg(int(path.read_text()), signal.SIGKILL)
            except ProcessLookupError:  # it had ended already
                pass
    thread.join()
