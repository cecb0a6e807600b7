"""A report as a person reads it: what ``log_every``'s line to the ``trainfold`` logger shows (the trackers get every value)."""

from __future__ import annotations

from typing import Mapping


#: counts a report sends the trackers that a line for a person leaves out (it shows their rates)
_UNSHOWN = {"interval_s", "samples", "tokens", "flops"}
#: rates and their units, in the order a line shows them
_RATES = (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"), ("updates_per_s", "updates/s"))


def report_text(values: Mapping[str, float]) -> str:
    """A report as a person reads it: the values without the trackers' ``train/`` prefix, a few digits, rates with
    their units, FLOPs per second with an SI prefix, MFU and the split of the time in percent, memory in GB.

    Examples:
        >>> report_text({"train/loss": 2.338153, "epoch": 0, "train/lr": 0.001, "train/samples_per_s": 2853.65,
        ...              "train/flops_per_s": 1.14e13, "train/mfu": 0.4123, "train/time_step": 0.823, "train/time_data": 0.041,
        ...              "train/time_update": 0.136, "train/time_stop": 0.0, "train/memory_rss_gb": 0.3392})
        'epoch 1  loss 2.338  lr 0.001  |  2,854 samples/s  11.4 TFLOP/s  MFU 41.2%  |  time: step 82%  data 4%  update 14%  |  memory rss 0.34 GB'
    """
    named = {k.removeprefix("train/"): v for k, v in values.items()}
    head = [f"epoch {int(named.pop('epoch')) + 1}"] if "epoch" in named else []  # the epoch in progress, counted from 1
    rates = [f"{named.pop(key):,.0f} {unit}" for key, unit in _RATES if key in named]
    if "flops_per_s" in named:
        rates.append(_si(named.pop("flops_per_s"), "FLOP/s"))
    if "mfu" in named:
        rates.append(f"MFU {100 * named.pop('mfu'):.1f}%")
    shares = [
        f"{k.removeprefix('time_')} {100 * named.pop(k):.0f}%" for k in [k for k in named if k.startswith("time_")]
    ]
    memory = [
        f"{k.removeprefix('memory_').removesuffix('_gb')} {named.pop(k):.2f} GB"
        for k in [k for k in named if k.startswith("memory_")]
    ]
    processes = _processes(named)
    values_ = [f"{k} {v:.4g}" for k, v in named.items() if k not in _UNSHOWN]
    parts = [
        "  ".join(head + values_),
        "  ".join(rates),
        "time: " + "  ".join(s for s in shares if not s.endswith(" 0%")) if shares else "",
        "memory " + "  ".join(memory) if memory else "",
        processes,
    ]
    return "  |  ".join(p for p in parts if p)


def _processes(named: dict[str, float]) -> str:
    """The per-process part of a line (``Watch(stragglers=...)``), taken out of ``named``: each figure's slowest process
    and the median, per update, and the stragglers named.

    Examples:
        >>> _processes({"data_s_max": 0.151, "data_s_max_process": 1.0, "data_s_median": 0.002, "compute_s_max": 0.02,
        ...             "compute_s_max_process": 0.0, "compute_s_median": 0.019, "straggler_input": 1.0})
        'slowest per update: data 0.151 s (process 1; median 0.002)  compute 0.02 s (process 0; median 0.019)  |  straggler: process 1 (input)'
    """
    parts = []
    for figure in ("data", "compute", "collective"):
        top, at, median = (named.pop(f"{figure}_s_{k}", None) for k in ("max", "max_process", "median"))
        if top is not None and figure != "collective":
            parts.append(f"{figure} {top:.3g} s (process {int(at or 0)}; median {median:.3g})")
    named_ = [
        f"process {int(named.pop(f'straggler_{kind}'))} ({kind})"
        for kind in ("input", "compute")
        if f"straggler_{kind}" in named
    ]
    line = "slowest per update: " + "  ".join(parts) if parts else ""
    return line + ("  |  straggler: " + ", ".join(named_) if named_ else "")


def _si(value: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"
