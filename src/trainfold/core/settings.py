"""The Context's arguments, checked as it is made: the Accelerator, the signals, the timeouts, the launcher's processes.
"""

from __future__ import annotations

import datetime
import math
import signal
from typing import Any

from accelerate import Accelerator

#: the signals a Context turns into a stop request by default: Ctrl-C, and what SLURM,
#: Kubernetes and torchrun send before they kill a job
DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


def require_accelerator(value: Any) -> Accelerator:
    if not isinstance(value, Accelerator):
        raise TypeError(
            f"'accelerator' must be an accelerate.Accelerator (got {value!r} that is a "
            f"{type(value).__name__}): build one with Accelerator(...) and pass it as "
            "Context(accelerator=...)."
        )
    return value


def signals_of(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    found = tuple(value) if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    out = []
    for s in found:
        try:
            sig = signal.Signals(s)
        except (ValueError, TypeError):
            raise TypeError(f"'signals' must be signal numbers such as signal.SIGTERM (got {s!r}); pass signals=() to turn handling off.") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be caught by any process: it cannot be a stop request. Use SIGTERM or SIGUSR1.")
        out.append(int(sig))
    return tuple(out)


def positive_seconds(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise ValueError(f"'{attribute.name}' must be a positive, finite number of seconds (got {value!r}).")


def timeout_of(value: Any) -> datetime.timedelta | None:
    if value is None or isinstance(value, datetime.timedelta):
        if value is not None and value.total_seconds() <= 0:
            raise ValueError(f"'timeout' must be positive (got {value}).")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise TypeError(f"'timeout' must be a datetime.timedelta or a positive, finite number of seconds (got {value!r}).")
    return datetime.timedelta(seconds=value)


def check_launcher(accelerator: Accelerator) -> None:
    """Refuse a run whose launcher started several processes that the Accelerator does not join into one job.

    Under ``torchrun --nproc_per_node 2`` on a machine without GPUs, ``Accelerator()``
    (without ``cpu=True``) forms no process group: each process reports one
    process and trains the whole job on its own, twice over, silently.
    """
    import os

    launched = os.environ.get("WORLD_SIZE", "")
    if launched.isdigit() and int(launched) > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}), but this Accelerator runs 1 process "
            f"(distributed type {accelerator.distributed_type}): each process would train the whole job on its own. Accelerate "
            "joins CPU processes into one job only when told to use the CPU: build it with Accelerator(cpu=True) (or set "
            "ACCELERATE_USE_CPU=1), use a GPU per process, or launch one process."
        )


#: ParallelismConfig's dimensions trainfold refuses, with the name of each kind of parallelism: Accelerate splits each batch
#: over their processes (along its sequence) only inside ``accelerator.maybe_context_parallel(buffers=...)`` around the
#: forward and backward, which ``make_step`` does not enter.
UNSUPPORTED_DIMENSIONS = (("cp_size", "context"), ("sp_size", "sequence"))


def check_parallelism(accelerator: Accelerator) -> None:
    """Refuse an Accelerator whose ParallelismConfig has context or sequence parallelism, naming the dimension.

    Their processes must each see a slice of every batch's sequence, which Accelerate cuts only inside
    ``maybe_context_parallel`` around the forward and backward; ``make_step`` does not enter it, so every process would
    train on the whole sequence, silently. Data-parallel dimensions (``dp_replicate_size``, ``dp_shard_size``: DDP,
    FSDP2, HSDP) and tensor parallelism (``tp_size``; a tensor-parallel group's processes read the same batches, and
    trainfold counts them as one share of the data: ``backend/mesh.py``) are supported.
    """
    config = getattr(accelerator, "parallelism_config", None)  # Accelerate 1.10 and later
    for field, kind in UNSUPPORTED_DIMENSIONS:
        size = getattr(config, field, 1) or 1
        if size > 1:
            raise ValueError(
                f"the Accelerator's ParallelismConfig has {field}={size} ({kind} parallelism): Accelerate splits each batch's "
                f"sequence over the {size} processes of a {kind}-parallel group only inside accelerator.maybe_context_parallel(...) "
                "around the forward and backward, which make_step does not enter, so each of them would train on the whole "
                "sequence. trainfold supports the data-parallel dimensions (dp_replicate_size, dp_shard_size: DDP, FSDP2, "
                f"HSDP) and tensor parallelism (tp_size); use Accelerate's own loop for {kind} parallelism."
            )
