"""Context: the Accelerator and the run-wide settings, as one frozen value; its arguments, checked as it is made
(the Accelerator, the signals, the timeouts, the launcher's processes, the parallelism).
"""

from __future__ import annotations

import datetime
import logging
import math
import signal
import weakref
from typing import Any

import attrs
from accelerate import Accelerator

from trainfold._src.backend.engine import wait_for_everyone
from trainfold._src.backend.loaders import fill_deepspeed_micro_batch, loader_placement, mark_own_shard
from trainfold._src.backend.streams import keep_given_stream, keep_shuffle_buffers
from trainfold._src.core.runtime import Runtime
from trainfold._src.distributed.control import current_timeout, set_timeout
from trainfold._src.distributed.teardown import settle_collectives

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
            raise TypeError(
                f"'signals' must be signal numbers such as signal.SIGTERM (got {s!r}); pass signals=() to turn handling off."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"{sig.name} cannot be caught by any process: it cannot be a stop request. Use SIGTERM or SIGUSR1."
            )
        out.append(int(sig))
    return tuple(out)


def positive_seconds(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise ValueError(f"'{attribute.name}' must be a positive, finite number of seconds (got {value!r}).")


def positive_seconds_or_none(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        positive_seconds(instance, attribute, value)


def timeout_of(value: Any) -> datetime.timedelta | None:
    if value is None or isinstance(value, datetime.timedelta):
        if value is not None and value.total_seconds() <= 0:
            raise ValueError(f"'timeout' must be positive (got {value}).")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise TypeError(
            f"'timeout' must be a datetime.timedelta or a positive, finite number of seconds (got {value!r})."
        )
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


def _accumulation_steps(ctx: Context) -> int:
    # attrs runs factories before validators, so the type is checked here.
    return int(require_accelerator(ctx.accelerator).gradient_accumulation_steps)


def _mixed_precision(ctx: Context) -> str:
    return str(ctx.accelerator.mixed_precision)


def _is_main_process(ctx: Context) -> bool:
    return bool(ctx.accelerator.is_main_process)  # sync: none: a flag


def _runtime(ctx: Context) -> Runtime:
    return Runtime(
        ctx.accelerator.num_processes,
        ctx.stop_check_s,
        ctx.signals,
        ctx.stop_deadline_s,
        exit_with_launcher=ctx.exit_with_launcher,
    )


def context_of(accelerator: Any) -> Context | None:
    """The live Context made last over ``accelerator`` (what a loop combinator finds through ``state.accelerator``), or None.

    The link is a weak reference on the Accelerator instance, set when a Context is
    made: :meth:`Context.with_accumulation` makes the new Context the one found.
    """
    ref = getattr(accelerator, "_trainfold_context", None)
    return ref() if ref is not None else None


def _finish_saves_before_end_training(ctx: Context) -> None:
    """Make ``ctx.accelerator.end_training()`` wait for this Context's background save before it destroys the process group.

    ``end_training`` (the usual last line of an Accelerate script, often inside
    ``with Context(...)``) destroys every process group, the background saver's
    too. A save still running there would wait forever in its next collective,
    on every process, and the job would hang at exit. So the Accelerator's
    method is wrapped, on this instance: the save in flight is committed first
    (its error raised once the group is gone) and the signal agreement's last
    round, still in flight on the control group, is waited for (a few seconds at
    most: a dead peer never joins it), so that no collective runs on a group being
    destroyed; then Accelerate's own method runs. The wrapper holds the Context weakly.
    """
    accelerator = ctx.accelerator
    end_training = accelerator.end_training
    context = weakref.ref(ctx)

    def finishing_saves_first() -> None:
        live = context()
        try:
            if live is not None:
                live.wait_for_checkpoints()
        finally:
            if live is not None:
                live.runtime.interrupt.drain(
                    5.0
                )  # the stop agreement's last round, on the control group destroyed next
                live.runtime.saver.forget()  # its group is destroyed next (the process group registry still holds it)
                live.runtime.control.forget()
            settle_collectives()  # gloo's worker threads let go of finished collectives before the groups are destroyed
            end_training()

    finishing_saves_first.__doc__ = end_training.__doc__
    accelerator.end_training = finishing_saves_first


@attrs.frozen(eq=False)
class Context:
    """The Accelerator and the run-wide settings trainfold reads, and the run's :class:`~trainfold.Runtime`.

    trainfold keeps no global state of its own, but Accelerate does: its
    ``AcceleratorState`` and ``GradientState`` are shared by every Accelerator in
    a process. A second ``Accelerator(gradient_accumulation_steps=2)`` silently
    changes the first one's accumulation. A Context records the precision and
    accumulation it was made with, and every primitive that uses it checks them
    (:meth:`check`), so such a conflict is an error, not a wrong result.

    Attributes:
        accelerator: the ``accelerate.Accelerator`` that does device placement,
            mixed precision, accumulation and distribution.
        signals: the signals that, from the Context's creation until :meth:`close`, are a request
            to stop at the next step boundary, the end of an evaluation or the next epoch of a
            loop, wherever they arrive (the saving you composed writes a final checkpoint; a
            launcher's echo of the signal changes nothing; the signal comes again a second or
            more later, or nothing acts on it within ``stop_deadline_s``: it acts as without
            trainfold; see :class:`~trainfold.Runtime`). SIGINT and SIGTERM by default; ``signals=()``
            leaves every signal to the host application. Made outside the main thread, a
            Context installs no handler (Python delivers signals to the main thread).
        stop_check_s: on several processes, the length of an agreement round in
            seconds: a stop requested on any process stops all of them within two
            rounds and the optimizer update in progress.
        stop_deadline_s: how long a stop request may wait for a step boundary, an evaluation's
            end or a loop's next epoch to act on it (300 s by default; None: for ever). Past it
            (no epoch running, a step hung in a tracker's log) the signal acts as it would
            without trainfold (SIGTERM ends the process), and the log says so. An evaluation
            agrees on a stop at its end: give one that runs longer a longer deadline.
        timeout: how long a collective waits for the other processes before it fails
            (a ``datetime.timedelta`` or seconds), set on the process group now. By
            default the group keeps what it was made with: torch's 30 minutes for
            gloo, 10 for NCCL, or Accelerate's ``InitProcessGroupKwargs(timeout=...)``.
        exit_with_launcher: in a process started by torchrun (or ``accelerate launch``), exit
            within a second once the launcher is gone (killed with ``kill -9``, its node lost),
            saying so on stderr, instead of training on beside the job started in its place
            (True by default; ``False`` for a host application that watches its processes itself).
        runtime: what the runs on this Context hold and change (locks, the background saver, the
            processes' control channel, the signal handlers, warnings given): a :class:`~trainfold.Runtime`,
            the one mutable part, made with the Context. Made, the Context also wraps its Accelerator's
            ``end_training`` so that it first commits the save in flight (see :meth:`close`).

    Raises:
        TypeError: ``accelerator`` is not an Accelerator; a bad ``signals`` or ``timeout``.
        RuntimeError: the launcher started several processes that this Accelerator does not join into one job.
        ValueError: the Accelerator's ParallelismConfig has context or sequence parallelism (``cp_size`` or
            ``sp_size`` above 1, named): trainfold supports its data-parallel dimensions (``dp_replicate_size``,
            ``dp_shard_size``: DDP, FSDP2, HSDP) and tensor parallelism (``tp_size``).

    Examples:
        >>> from accelerate import Accelerator
        >>> ctx = Context(accelerator=Accelerator(cpu=True))
        >>> ctx.gradient_accumulation_steps, ctx.mixed_precision
        (1, 'no')
    """

    accelerator: Accelerator
    gradient_accumulation_steps: int = attrs.field(
        init=False, default=attrs.Factory(_accumulation_steps, takes_self=True)
    )
    mixed_precision: str = attrs.field(init=False, default=attrs.Factory(_mixed_precision, takes_self=True))
    #: True on the process that should log, print and write shared files. Read once: Accelerate's
    #: own property builds a ``PartialState`` on every read (~2.5 us, 10 times that in a cold cache).
    is_main_process: bool = attrs.field(init=False, default=attrs.Factory(_is_main_process, takes_self=True))
    signals: tuple[int, ...] = attrs.field(kw_only=True, default=DEFAULT_SIGNALS, converter=signals_of)
    stop_check_s: float = attrs.field(kw_only=True, default=1.0, validator=positive_seconds)
    stop_deadline_s: float | None = attrs.field(kw_only=True, default=300.0, validator=positive_seconds_or_none)
    timeout: datetime.timedelta | None = attrs.field(kw_only=True, default=None, converter=timeout_of)
    exit_with_launcher: bool = attrs.field(kw_only=True, default=True, validator=attrs.validators.instance_of(bool))
    runtime: Runtime = attrs.field(init=False, default=attrs.Factory(_runtime, takes_self=True), repr=False)

    def __attrs_post_init__(self) -> None:
        check_launcher(self.accelerator)
        check_parallelism(self.accelerator)
        if self.timeout is not None and self.accelerator.num_processes > 1:
            set_timeout(self.timeout)
        _finish_saves_before_end_training(self)
        self.accelerator._trainfold_context = weakref.ref(self)

    def __getattr__(self, name: str) -> Any:
        """Only for a name the Context lacks: one of its Runtime's is named there (``ctx.saver``: ``ctx.runtime.saver``)."""
        try:
            runtime = None if name.startswith("__") else object.__getattribute__(self, "runtime")
        except AttributeError:  # not made yet (inside __init__)
            runtime = None
        if runtime is not None and hasattr(runtime, name):
            raise AttributeError(
                f"'Context' object has no attribute {name!r}: what a run holds and changes is the Context's "
                f"runtime: ctx.runtime.{name}.",
                name=name,
                obj=self,
            )
        raise AttributeError(f"'Context' object has no attribute {name!r}", name=name, obj=self)

    def collective_timeout(self) -> datetime.timedelta | None:
        """How long a collective waits for the other processes before it fails (None on one process)."""
        return current_timeout() if self.accelerator.num_processes > 1 else None

    def check(self) -> None:
        """Raise if another Accelerator changed the process-wide settings this Context relies on.

        Raises:
            RuntimeError: the Context was closed, or the accumulation steps or mixed precision
                now in force differ from those this Context was made with.
        """
        if self.runtime.closed:
            raise RuntimeError(
                "this Context was closed (ctx.close(), or the end of 'with Context(...)'): its process group and trackers are "
                "gone. Make a new Accelerator and Context for another run."
            )
        now = (_accumulation_steps(self), _mixed_precision(self))
        if now != (self.gradient_accumulation_steps, self.mixed_precision):
            raise RuntimeError(
                "Accelerate's state is process-wide and another Accelerator has changed it: this "
                f"Context was made with gradient_accumulation_steps={self.gradient_accumulation_steps}"
                f" and mixed_precision={self.mixed_precision!r}, but now "
                f"gradient_accumulation_steps={now[0]} and mixed_precision={now[1]!r} are in force. "
                "Use one Accelerator per process (share one Context), or give both the same settings; after "
                "ctx.with_accumulation(n) (or inside find_batch_size), use the Context it returned."
            )

    def close(self) -> None:
        """End the run: release its checkpoint locks, put its signal handlers back, finish Accelerate's trackers and destroy the process group.

        A distributed run that skips this aborts at exit under torchrun. It does
        not wait for the other processes: one that destroys the group while
        another still uses it can abort too. Prefer
        ``with Context(accelerator=...) as ctx:``, which waits for every process
        (when the block ended without an exception) and closes on the way out.
        Calling it after ``accelerator.end_training()`` (the usual Accelerate
        ending, inside the ``with`` block too) is harmless. A checkpoint being
        written in the background is waited for first; if it failed, its error
        is raised once the run is closed.
        """
        failed: BaseException | None = None
        try:
            self.wait_for_checkpoints()
        except BaseException as exc:  # raised once the run is closed: a lost checkpoint is never silent
            failed = exc
        settle_collectives()  # before any group is freed: the saver's and control channel's, then Accelerate's
        self.runtime.close()
        self.accelerator.end_training()
        if failed is not None:
            raise failed

    def with_accumulation(self, steps: int) -> Context:
        """A Context for the same Accelerator with ``steps`` gradient accumulation steps; this one is retired.

        Accelerate keeps the accumulation steps process-wide, so this sets them on
        the Accelerator (``accelerator.gradient_accumulation_steps = steps``) and
        returns a new Context that records them, with this one's settings. This
        Context then refuses to work (its :meth:`check` sees another accumulation):
        use the new one from here on. Build states and steps after the change
        (``make_step`` reads the accumulation when it builds the step).
        :func:`~trainfold.find_batch_size` uses it for each attempt.

        Raises:
            ValueError: ``steps`` is not a positive int, or the run is under DeepSpeed,
                whose accumulation is in its config.

        Examples:
            >>> from accelerate import Accelerator
            >>> ctx = Context(accelerator=Accelerator(cpu=True))
            >>> ctx.with_accumulation(4).gradient_accumulation_steps
            4
        """
        from trainfold._src.backend.engine import is_deepspeed
        from trainfold._src.base.checks import positive_int

        positive_int("gradient_accumulation_steps", steps)
        if is_deepspeed(self.accelerator):
            raise ValueError(
                "under DeepSpeed the accumulation steps are the DeepSpeed config's (gradient_accumulation_steps there)."
            )
        self.accelerator.gradient_accumulation_steps = steps
        return Context(
            accelerator=self.accelerator,
            signals=self.signals,
            stop_check_s=self.stop_check_s,
            stop_deadline_s=self.stop_deadline_s,
            timeout=self.timeout,
            exit_with_launcher=self.exit_with_launcher,
        )

    def release(self, state: Any, *loaders: Any) -> None:
        """Let a finished run's model, optimizer, scheduler and loaders be freed: drop the Accelerator's references to them.

        ``accelerator.prepare`` keeps every object it prepared in lists on the
        Accelerator, so a host that trains many states on one Context (folds of a
        cross-validation, trials of a search) keeps every one of them alive, with
        its parameters and optimizer moments. This removes this state's objects
        and the given loaders (and the loader of the state's last epoch) from those
        lists, and only those: unlike Accelerate's ``free_memory()``, which forgets
        everything it prepared, other live states keep working. A DeepSpeed engine
        of this state is destroyed. Then Python's garbage collector runs and the
        device's cache is emptied. Drop your own references (``del state``) for the
        memory to go.

        The state is finished after this: ``run_epoch``, ``evaluate`` and the other
        loops refuse it (under FSDP, Accelerate finds the model to clip in those
        lists). Its values, and a checkpoint of it, stay good.

        Examples:
            >>> from trainfold import testing
            >>> ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
            >>> ctx.release(state, loader)
            >>> state.model in ctx.accelerator._models
            False
        """
        from trainfold._src.backend.engine import (
            release_prepared,  # what Accelerate keeps, in the module that knows its internals
        )

        cursor_loader = getattr(getattr(state, "cursor", None), "loader", None)
        if getattr(state, "model", None) is not None:
            self.runtime.release(state.model)
        release_prepared(self.accelerator, state, (*loaders, cursor_loader) if cursor_loader is not None else loaders)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:  # the block's own error is the one raised; a failed background save is logged
            try:
                self.wait_for_checkpoints()
            except Exception:
                logging.getLogger("trainfold").exception("the checkpoint being written in the background failed")
            self.close()
            return
        try:
            self.wait_for_checkpoints()
            if self._group_alive():
                self.wait_for_everyone()  # no rank tears down while another still works
        finally:
            self.close()

    def wait_for_checkpoints(self) -> None:
        """Block until the checkpoint being written in the background (``async_save=True``) is committed.

        At most one is in flight: the next save, ``load_checkpoint`` and
        :meth:`close` wait for it too; call this where a run must know its last
        checkpoint is on disk (before it reports being done, say).

        Raises:
            OSError, CheckpointError: that save failed (nothing was committed; the
                previous checkpoints are intact).
        """
        self.runtime.saver.wait()

    def _group_alive(self) -> bool:
        """Whether the processes can still meet (False once ``accelerator.end_training()`` destroyed the group)."""
        import torch.distributed as dist

        return self.accelerator.num_processes == 1 or (dist.is_available() and dist.is_initialized())

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a no-op on one process).

        ``accelerator.wait_for_everyone()``, except across CPU processes, where
        it calls torch's gloo barrier directly: Accelerate's asks for a GPU per
        process, which fails on a machine with fewer GPUs than processes.

        Examples:
            >>> from accelerate import Accelerator
            >>> Context(accelerator=Accelerator(cpu=True)).wait_for_everyone()  # one process: returns at once
        """
        wait_for_everyone(self.accelerator)

    def prepare_loaders(self, *loaders: Any) -> tuple[Any, ...]:
        """Prepare data loaders for the Accelerator (device placement, sharding across processes).

        ``accelerator.prepare(*loaders)``, except on a CPU device, where the
        batches are left where the ``DataLoader`` put them (on the CPU already)
        instead of being walked and moved to the CPU on every batch.

        A ``datasets`` stream shuffled through a buffer (``shuffle(seed, buffer_size)``) has its buffer
        given a state that holds it, so that a resume continues it in O(1) (the guide "Streamed data").

        Args:
            *loaders: ``torch.utils.data.DataLoader`` objects.

        Returns:
            A tuple of prepared loaders, in the order given (a 1-tuple for one loader).

        Examples:
            >>> import torch
            >>> from accelerate import Accelerator
            >>> ctx = Context(accelerator=Accelerator(cpu=True))
            >>> (train_dl,) = ctx.prepare_loaders(torch.utils.data.DataLoader(range(4), batch_size=2))
            >>> [b.tolist() for b in train_dl]
            [[0, 1], [2, 3]]
        """
        if not loaders:
            raise TypeError("prepare_loaders() needs at least one DataLoader.")
        self.check()
        fill_deepspeed_micro_batch(
            self.accelerator, loaders
        )  # before TrainState.create, which prepares the model alone
        for loader in loaders:
            keep_shuffle_buffers(loader)  # before Accelerate splits a datasets stream by process
        prepared = self.accelerator.prepare(*loaders, device_placement=loader_placement(self.accelerator, len(loaders)))
        prepared = prepared if isinstance(prepared, tuple) else (prepared,)
        for given, ready in zip(loaders, prepared):
            keep_given_stream(given, ready)
        return prepared

    def own_shards(self, *loaders: Any) -> tuple[Any, ...]:
        """Mark loaders that already yield only this process's share of the data, and return them.

        On several processes ``run_epoch``, ``evaluate`` and ``predict`` refuse a
        loader that was not prepared (``prepare_loaders``): each process would
        read the whole dataset. A loader that shards itself (its own sampler per
        process, a stream per rank) is marked with this instead; one whose
        sampler is torch's ``DistributedSampler`` needs no mark. The loaders are
        returned unchanged (the mark is an attribute on each).

        Examples:
            >>> import torch
            >>> from accelerate import Accelerator
            >>> ctx = Context(accelerator=Accelerator(cpu=True))
            >>> (mine,) = ctx.own_shards(torch.utils.data.DataLoader(range(4), batch_size=2))
            >>> [b.tolist() for b in mine]
            [[0, 1], [2, 3]]
        """
        if not loaders:
            raise TypeError("own_shards() needs at least one loader.")
        return tuple(mark_own_shard(loader) for loader in loaders)
