"""What ``log_every(..., watch=...)`` adds to each report: throughput, utilisation, memory, and where the time went.

Owned here: :class:`Watch` (what to measure, public) and :class:`Meter` (the host counters of one
watched step). Counts are exact and cost no device synchronisation: a batch's sample count is its
shape (host metadata); tokens are the loss's own token weights, already summed on the device; both,
and the FLOPs, are summed over processes in the report's one all-reduce.
"""

from __future__ import annotations

import math
import resource
import sys
import time
import warnings
from typing import Any, Mapping

import attrs
import torch

from trainfold._src.backend.mesh import data_layout
from trainfold._src.base.checks import user_stacklevel
from trainfold._src.base.running_sums import WEIGHT
from trainfold._src.base.types import Batch
from trainfold._src.compose.stragglers import Named, per_process, say, slots
from trainfold._src.core.clock import Compute
from trainfold._src.core.context import Context
from trainfold._src.core.state import TrainState
from trainfold._src.core.types import Step

#: Dense peak FLOP/s of one device, by a fragment of its CUDA name, for 16-bit (bf16/fp16) tensor-core matmuls and for
#: float32 (TF32 tensor cores where the device has them and torch allows them; plain FP32 otherwise). Vendors' figures.
PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 67e12),
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (70e12, 35e12),
    "L4": (121e12, 30.3e12),
}

#: The running sums that count a batch's real tokens: the token weight of a token-normalised loss, or an aux ``tokens``.
TOKEN_SUMS = (f"loss{WEIGHT}", "tokens")


@attrs.frozen
class Watch:
    """What ``log_every(ctx, n, watch=Watch(...))`` reports besides the loss (``watch=True`` is ``Watch()``).

    Every report gives the interval's samples/s, updates/s and, where the loss counts tokens
    (``make_step(normalize="tokens")``, or an aux ``"tokens"``), real tokens/s; the share of its
    wall time spent waiting for data, updating, checkpointing and agreeing on a stop; and the
    peak memory. With FLOPs known, the model FLOPs utilisation (MFU).

    Attributes:
        flops_per_token: the training FLOPs of one token, for a transformer ``6 * n_parameters``
            (a figure of yours: MFU as most papers state it); needs a loss that counts tokens
            (the first report warns once if it counts none).
        flops_per_sample: the training FLOPs of one sample, as you count them.
        measure_flops: with neither figure, count the FLOPs of the first step with torch's
            ``FlopCounterMode`` (forward and backward, every matmul and convolution; this process's
            share under tensor parallelism), per sample of its batch.
        peak_flops: one device's peak FLOP/s that MFU divides by; None: from :data:`PEAKS` by the
            CUDA device's name and the mixed precision (none on a CPU: MFU is then not reported).
        memory: report peak memory (CUDA: allocated and reserved since the last report; elsewhere the
            process's peak resident memory so far), and record each epoch's (``train_memory_*_gb``).
        stragglers: on several processes, report each process's data wait, compute and collective wait (their
            median, max and the process that holds it), and name a process whose data wait or compute exceeds the
            median process's by more than this share of an update's time (``straggler_input``,
            ``straggler_compute``); None: no per-process figures.
        straggler_min_s: the least excess, in seconds per update, that names a straggler (the noise of a busy host
            stays below it).

    Examples:
        >>> from trainfold import log_every, make_step, run_epoch, testing
        >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
        >>> step = log_every(ctx, 2, watch=Watch(flops_per_sample=6.0, peak_flops=1e9))(make_step(ctx, loss_fn))
        >>> report = run_epoch(ctx, step, loader, state).extras["log_every"].values
        >>> report["samples"], report["flops"]
        (8.0, 48.0)
    """

    flops_per_token: float | None = None
    flops_per_sample: float | None = None
    measure_flops: bool = True
    peak_flops: float | None = None
    memory: bool = True
    stragglers: float | None = attrs.field(default=0.25, validator=lambda _, __, v: _share(v))
    straggler_min_s: float = attrs.field(default=0.01, validator=lambda _, __, v: _seconds(v))


def _share(value: Any) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
    ):
        raise ValueError(
            f"Watch(stragglers={value!r}): give the share of an update's time by which a process may exceed the median "
            "process before it is named (a positive number, such as 0.25), or None for no per-process figures."
        )


def _seconds(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(
            f"Watch(straggler_min_s={value!r}): give the least excess that names a straggler, in seconds per update (a "
            "number >= 0, such as 0.01)."
        )


def as_watch(watch: bool | Watch) -> Watch | None:
    if isinstance(watch, Watch):
        return watch
    if watch is True:
        return Watch()
    if watch is False:
        return None
    raise TypeError(f"log_every(..., watch=...) takes True, False or a trainfold.Watch, not {type(watch).__name__}.")


def peak_of(ctx: Context, watch: Watch) -> float | None:
    """One device's peak FLOP/s for MFU: the given one, else the table's for this CUDA device and precision."""
    if watch.peak_flops is not None:
        return float(watch.peak_flops)  # sync: none, a number of the user's
    device = ctx.accelerator.device
    if getattr(device, "type", None) != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    sixteen = ctx.mixed_precision in ("bf16", "fp16")
    for fragment, (half, single) in PEAKS.items():
        if fragment in name:
            return half if sixteen else single
    return None


def samples_in(batch: Batch) -> int:
    """The samples of a batch: the first dimension of its first tensor (host metadata: no sync), as Accelerate's
    ``find_batch_size`` finds it; 0 where it has no tensor to tell.

    Examples:
        >>> samples_in({"x": torch.zeros(8, 3), "y": torch.zeros(8)}), samples_in((torch.zeros(5, 2), [1, 2])), samples_in("text")
        (8, 5, 0)
        >>> samples_in([[torch.zeros(3, 1)], 7]), samples_in(torch.tensor(1.0))
        (3, 0)
    """
    kind = type(batch)  # the usual batches first: a tensor, or one in a list, tuple or dict (this runs per step)
    if (kind is list or kind is tuple) and batch:
        first = batch[0]
    elif kind is dict and batch:
        first = next(iter(batch.values()))
    else:
        first = batch
    if type(first) is torch.Tensor:
        return int(first.shape[0]) if first.ndim else 0
    for _ in range(8):  # nested ones, without the abstract-class checks of the general walk
        kind = type(batch)
        if kind is torch.Tensor:
            return int(batch.shape[0]) if batch.ndim else 0
        if (kind is tuple or kind is list) and batch:
            batch = batch[0]
        elif kind is dict and batch:
            batch = next(iter(batch.values()))
        else:
            break
    from accelerate.utils import find_batch_size

    try:
        return int(find_batch_size(batch))
    except (TypeError, ValueError, IndexError):
        return 0


class Meter:
    """One watched step's host counters between reports: samples, FLOPs, and when the interval began.

    Not run state (a resumed run's first interval starts at its first step): a display's
    bookkeeping, like a progress bar's, kept in the step that ``log_every`` returns. A step
    adds its batch's samples to the clock's count (one integer addition); the interval's
    samples and FLOPs are read from it at the report.
    """

    def __init__(self, ctx: Context, watch: Watch) -> None:
        self.ctx, self.watch = ctx, watch
        self.clock = ctx.runtime.clock
        self.flops_per_sample: float | None = watch.flops_per_sample
        self.measuring = watch.measure_flops and watch.flops_per_sample is None and watch.flops_per_token is None
        self.started: float | None = None
        self.from_update = 0  # the update the interval began after
        self.from_samples = 0  # the clock's sample count then
        self.last: TrainState | None = None  # the state the last step returned (a value: nothing is copied)
        self.carried: torch.Tensor | float = 0.0  # tokens of epochs that ended since the last report, after it
        self.clock.on = True
        if watch.memory and self.clock.peaks is None:
            self.clock.peaks = Peaks()
        acc = ctx.accelerator
        self.processes, self.rank = acc.num_processes, acc.process_index
        self.compute = None if watch.stragglers is None or self.processes < 2 else self.clock.compute or Compute()
        if self.compute is not None:
            self.clock.compute, self.clock.named = self.compute, self.clock.named or Named()

    def step(self, step: Step, state: TrainState, batch: Batch) -> TrainState:
        """Run ``step``, counting its batch's samples (and, the first time, its FLOPs)."""
        last = self.last
        if last is None:
            self.started, self.from_update, self.from_samples = time.perf_counter(), state.step, self.clock.samples
            self.clock.take()  # the interval begins here
        elif state.epoch != last.epoch:
            self._carry(state, last)
        samples = samples_in(batch)
        new = self._measured(step, state, batch, samples) if self.measuring else step(state, batch)
        self.last = new
        self.clock.samples += samples
        return new

    def _measured(self, step: Step, state: TrainState, batch: Batch, samples: int) -> TrainState:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:  # a dispatch mode that counts: the same kernels run, the numbers are the same
            new = step(state, batch)
        self.measuring = False
        if samples:
            self.flops_per_sample = counter.get_total_flops() / samples
        return new

    def _carry(self, state: TrainState, last: TrainState) -> None:
        """An epoch ended since the last step: the tokens its running sums gathered after the last report (which the
        next epoch's sums no longer hold) are carried into this interval, on the device."""
        sums = last.sums.folded()  # (once: its names and values both are read)
        final = sums.as_dict()
        since = sums.interval(last.epoch, state.extras.get("log_every"))[0] or {}
        for name in TOKEN_SUMS:
            if name in final:
                self.carried = self.carried + (final[name] - since[name] if name in since else final[name])
                break

    def totals(self) -> dict[str, torch.Tensor | float]:
        """This process's counts since the last report, for the report's one all-reduce."""
        samples = float(self.clock.samples - self.from_samples)  # sync: none: host ints
        per_sample = self.flops_per_sample
        flops = per_sample * samples if per_sample is not None else 0.0  # sync: none: host numbers
        # sync: none here; the carried tokens a device tensor the report's one all-reduce reads
        out = {"watch:samples": samples, "watch:flops": flops, "watch:tokens": self.carried}  # sync: none
        if self.compute is not None:  # every process's figures, each in its own slots of one summed vector
            compute, collective = self.compute.seconds, self.compute.collective
            out["watch:processes"] = slots(self.rank, self.processes, (self.clock.spent("data"), compute, collective))
        return out

    def report(self, state: TrainState, totals: Mapping[str, Any]) -> dict[str, float]:
        """The interval's figures (at a report, after its all-reduce), and a new interval."""
        now = time.perf_counter()
        seconds = max(now - (self.started or now), 1e-9)
        acc = self.ctx.accelerator
        copies = _copies(acc)
        samples = totals["watch:samples"] / copies
        out = {
            "interval_s": seconds,
            "samples": samples,
            "samples_per_s": samples / seconds,
            "updates_per_s": (state.step - self.from_update) / seconds,
        }
        tokens = next((totals[f"sum:{name}"] for name in TOKEN_SUMS if f"sum:{name}" in totals), None)
        if tokens is not None:
            tokens = (tokens + totals["watch:tokens"]) / copies
            out["tokens"], out["tokens_per_s"] = tokens, tokens / seconds
        flops = self._flops(totals, tokens, copies)
        peak = peak_of(self.ctx, self.watch)
        if flops is not None:
            out["flops"], out["flops_per_s"] = flops, flops / seconds
            if peak is not None:
                out["mfu"] = flops / (seconds * peak * acc.num_processes)
        shares = {f"time_{part}": spent / seconds for part, spent in self.ctx.runtime.clock.take().items()}
        out["time_step"] = max(0.0, 1.0 - sum(shares.values()))  # the rest: forward, backward, the loop's own work
        out.update(shares)
        if self.watch.memory:  # (the clock holds the Peaks this meter's __init__ gave it)
            out.update(self.clock.peaks.take(acc.device, "report"))
        if self.compute is not None and "watch:processes" in totals:
            self.compute.take()
            share, floor = float(self.watch.stragglers or 0.0), self.watch.straggler_min_s  # sync: none: settings
            figures = per_process(
                totals["watch:processes"], self.processes, state.step - self.from_update, seconds, share, floor
            )
            out.update(figures)
            self.clock.named.note(figures)
            if self.ctx.is_main_process:
                say(figures, state.step, share)
        self.carried, self.started, self.from_update, self.from_samples = (
            0.0,
            time.perf_counter(),
            state.step,
            self.clock.samples,
        )
        return out

    def _flops(self, totals: Mapping[str, float], tokens: float | None, copies: int) -> float | None:
        """The interval's training FLOPs: by the given figure per token or per sample (the whole model's: a
        tensor-parallel group's copies counted once), or as counted per sample on each process (its own share of the
        model, under tensor parallelism) and summed."""
        if self.watch.flops_per_token is not None:
            if tokens is None:
                self._warn_no_tokens()
                return None
            return self.watch.flops_per_token * tokens
        if self.watch.flops_per_sample is not None:
            return totals["watch:flops"] / copies
        return totals["watch:flops"] if self.flops_per_sample is not None else None

    def _warn_no_tokens(self) -> None:
        if self.ctx.is_main_process and self.ctx.runtime.warn_once("watch:flops_per_token"):
            warnings.warn(
                "Watch(flops_per_token=...): the loss counts no tokens, so the reports carry no flops and no mfu. Count "
                'them with make_step(..., normalize="tokens") or an aux "tokens" (a sum of real tokens per batch), or '
                "give Watch(flops_per_sample=...) instead. Said once.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def _copies(accelerator: Any) -> int:
    """How many processes read each batch: a tensor-parallel group's (1 without tensor parallelism)."""
    return int(accelerator.num_processes // max(data_layout(accelerator).size, 1))


def epoch_totals(ctx: Context, samples: int) -> dict[str, float]:
    """This process's count for an epoch's record and, where memory is watched, its peak memory during the epoch, to
    ride in the epoch's one all-reduce (:func:`epoch_figures`)."""
    totals = {"watch:samples": float(samples)}  # sync: none: a host int
    peaks = ctx.runtime.clock.peaks
    if peaks is not None:
        totals.update((f"watch:{name}", value) for name, value in peaks.take(ctx.accelerator.device, "epoch").items())
    return totals


def epoch_figures(ctx: Context, seconds: float, totals: Mapping[str, float]) -> dict[str, float]:
    """A watched epoch's throughput, from its one all-reduce: ``epoch_s`` (this process's wall time from the epoch's
    first batch to its end), ``samples_per_s`` and, where the loss counts tokens, ``tokens_per_s`` (every process's, a
    tensor-parallel group's batch once, over that time); where memory is watched, the processes' mean of each one's
    peak memory in the epoch (``memory_allocated_gb`` and ``memory_reserved_gb`` on CUDA, ``memory_rss_gb`` elsewhere:
    the process's peak so far)."""
    copies = _copies(ctx.accelerator)
    out = {"epoch_s": seconds, "samples_per_s": totals["watch:samples"] / copies / seconds}
    tokens = next((totals[f"sum:{name}"] for name in TOKEN_SUMS if f"sum:{name}" in totals), None)
    if tokens is not None:
        out["tokens_per_s"] = tokens / copies / seconds
    processes = ctx.accelerator.num_processes
    out.update(
        (name.removeprefix("watch:"), value / processes)
        for name, value in totals.items()
        if name.startswith("watch:memory_")
    )
    return out


class Peaks:
    """The peak device memory of one process since the last report and since the open epoch began.

    CUDA keeps one peak, which a reading resets: each reading (a report's, an epoch's end) is folded
    into both, and each takes its own, so a report's interval and an epoch that overlap each see
    every peak inside them. Elsewhere the reading is the process's peak resident memory so far.
    """

    def __init__(self) -> None:
        self.since: dict[str, dict[str, float]] = {"report": {}, "epoch": {}}

    def take(self, device: Any, mark: str) -> dict[str, float]:
        """The peaks since ``mark`` (``"report"`` or ``"epoch"``) was last taken, read now."""
        return self.fold(_memory(device), mark)

    def fold(self, read: Mapping[str, float], mark: str) -> dict[str, float]:
        """Fold ``read`` (the peaks since the last reading) into both, and take those since ``mark``.

        Examples:
            >>> peaks = Peaks()
            >>> peaks.fold({"memory_allocated_gb": 5.0}, "report"), peaks.fold({"memory_allocated_gb": 3.0}, "report")
            ({'memory_allocated_gb': 5.0}, {'memory_allocated_gb': 3.0})
            >>> peaks.fold({"memory_allocated_gb": 4.0}, "epoch")  # the epoch saw the first report's 5
            {'memory_allocated_gb': 5.0}
        """
        for held in self.since.values():
            for name, value in read.items():
                held[name] = max(held.get(name, value), value)
        taken, self.since[mark] = self.since[mark], {}
        return taken


def _memory(device: Any) -> dict[str, float]:
    """Peak memory in GB: CUDA allocated and reserved since the last reading (the peaks are reset: :class:`Peaks`
    folds each reading into a report's and an epoch's); elsewhere the process's peak resident memory so far
    (``getrusage``, which cannot be reset)."""
    if getattr(device, "type", None) == "cuda":
        out = {
            "memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return out
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"memory_rss_gb": peak * (1 if sys.platform == "darwin" else 1024) / 1e9}
