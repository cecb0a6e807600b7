"""What the resume kit found: a case's outcome from the logs of its runs, and the report of every case."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

import attrs

Outcome = Literal["exact", "refused", "wrong", "failed"]


@attrs.frozen
class ResumeCase:
    """A way to interrupt and resume a run: trained on ``saved_on`` processes and stopped (``at``), then resumed on
    each number of ``resumed_on`` in turn (two: the first resume is itself stopped inside the epoch it resumed)."""

    saved_on: int
    resumed_on: tuple[int, ...]
    workers: int = 0
    #: "kill": SIGKILL to every process at a random update after a checkpoint; "epoch_end": stopped (and saved) at
    #: the first epoch's end
    at: Literal["kill", "epoch_end"] = "kill"

    def __str__(self) -> str:
        how = "killed" if self.at == "kill" else "stopped at the epoch's end"
        then = " then ".join(map(str, self.resumed_on))
        return f"num_workers={self.workers}: {how} on {self.saved_on}, resumed on {then}"


@attrs.frozen
class CaseResult:
    """A case's outcome. ``exact``: every sample id once in each epoch, as in the uninterrupted run; ``refused``: a
    ``CheckpointError`` refused a resume before it trained a batch (``detail`` is its message); ``wrong``: ids
    ``missing`` or ``repeated`` (or a refusal after batches were trained); ``failed``: a run ended in another error
    (``detail`` holds its end)."""

    case: ResumeCase
    outcome: Outcome
    missing: tuple[int, ...] = ()
    repeated: tuple[int, ...] = ()
    detail: str = ""
    #: the update each run before the last stopped at (the checkpoint it was resumed from)
    stopped_at: tuple[int, ...] = ()
    #: what the resumed runs warned (each message once): a stream read again says so
    said: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.case}: {self.outcome}"
        if self.stopped_at:
            text += f" (resumed from update {', '.join(map(str, self.stopped_at))})"
        if self.missing or self.repeated:
            text += f"; missing {_few(self.missing)}, repeated {_few(self.repeated)}"
        if self.detail:
            text += f"\n    {self.detail.strip().splitlines()[-1] if self.outcome == 'failed' else self.detail.strip()}"
        return text


@attrs.frozen
class ResumeCost:
    """The time from a resume's start (its load) to its first batch, resumed early in an epoch and late in it, on one
    process: a loader that can say where it is takes as long at both; one read again takes longer the later it is."""

    epoch_updates: int
    early_update: int
    early_s: float
    late_update: int
    late_s: float

    @property
    def ratio(self) -> float:
        return self.late_s / self.early_s

    def __str__(self) -> str:
        return (
            f"resume at update {self.late_update} of {self.epoch_updates}: {self.late_s:.3f} s to its first batch, "
            f"{self.ratio:.2f}x the resume at update {self.early_update} ({self.early_s:.3f} s)"
        )


@attrs.frozen
class ResumeReport:
    """Every case's result, and the resume's cost (None where it was not measured)."""

    loader: str
    results: tuple[CaseResult, ...]
    cost: ResumeCost | None = None

    @property
    def cases(self) -> tuple[ResumeCase, ...]:
        return tuple(r.case for r in self.results)

    @property
    def exact(self) -> bool:
        """Whether every case resumed exactly (a refusal is not exact)."""
        return all(r.outcome == "exact" for r in self.results)

    def result(self, case: ResumeCase) -> CaseResult:
        return next(r for r in self.results if r.case == case)

    def outcomes(self) -> dict[ResumeCase, Outcome]:
        return {r.case: r.outcome for r in self.results}

    def assert_sound(self) -> None:
        """Raise ``AssertionError`` with the report if a case lost or repeated samples or failed: each resumed exactly
        or was refused before a batch."""
        if any(r.outcome in ("wrong", "failed") for r in self.results):
            raise AssertionError(str(self))

    def __str__(self) -> str:
        lines = [f"resume conformance of {self.loader}:", *(f"  {r}" for r in self.results)]
        if self.cost is not None:
            lines.append(f"  cost: {self.cost}")
        return "\n".join(lines)


def _few(ids: tuple[int, ...], most: int = 8) -> str:
    if not ids:
        return "none"
    shown = ", ".join(map(str, ids[:most]))
    return f"{len(ids)} ({shown}{', ...' if len(ids) > most else ''})"


@attrs.frozen
class Batch:
    epoch: int
    update: int
    ids: tuple[int, ...]


@attrs.frozen
class RunLog:
    """One run's log, every rank's: the update it resumed from, its batches, its first batch's time, a refusal."""

    resumed: int
    batches: tuple[Batch, ...]
    first_s: float | None
    refused: str | None
    #: the messages of the warnings its processes gave (each once)
    said: tuple[str, ...] = ()

    @classmethod
    def read(cls, folder: Path) -> RunLog:
        resumed, batches, first, refused = 0, [], None, None
        for path in sorted(folder.glob("trained-*.txt")):
            for line in path.read_text().splitlines():
                words = line.split()
                if not words:
                    continue
                if words[0] == "resumed":
                    resumed = int(words[1])
                elif words[0] == "first":
                    first = max(first or 0.0, float(words[1]))
                elif len(words) >= 2:
                    batches.append(Batch(int(words[0]), int(words[1]), tuple(int(w) for w in words[2:])))
        for path in sorted(folder.glob("refused-*.txt")):
            refused = path.read_text()
        return cls(resumed, tuple(batches), first, refused)

    def updates_of_epoch(self, epoch: int) -> int:
        return len({b.update for b in self.batches if b.epoch == epoch})


def trained(runs: list[RunLog]) -> list[Batch]:
    """What a sequence of runs trained, as it counts: a run resumed from update ``u`` replaces what the runs before it
    trained from ``u`` on (those batches' updates were lost with the process)."""
    kept: list[Batch] = []
    for run in runs:
        kept = [b for b in kept if b.update < run.resumed] + list(run.batches)
    return kept


def compare(case: ResumeCase, runs: list[RunLog], reference: RunLog, stopped_at: tuple[int, ...]) -> CaseResult:
    """The case's result: its runs' batches, epoch by epoch, against the uninterrupted run's sample ids."""
    said = tuple(dict.fromkeys(m for run in runs[1:] for m in run.said))
    for i, run in enumerate(runs[1:], start=1):
        if run.refused is not None:
            if run.batches:
                detail = f"refused after training: {run.refused}"
                return CaseResult(case, "wrong", detail=detail, stopped_at=stopped_at, said=said)
            return CaseResult(case, "refused", detail=run.refused, stopped_at=stopped_at[:i], said=said)
    got, missing, repeated = trained(runs), [], []
    for epoch in sorted({b.epoch for b in reference.batches}):
        want = Counter(i for b in reference.batches if b.epoch == epoch for i in b.ids)
        have = Counter(i for b in got if b.epoch == epoch for i in b.ids)
        missing += sorted((want - have).elements())
        repeated += sorted((have - want).elements())
    outcome: Outcome = "wrong" if missing or repeated else "exact"
    return CaseResult(case, outcome, tuple(missing), tuple(repeated), stopped_at=stopped_at, said=said)
