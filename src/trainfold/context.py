"""Context: the Accelerator and the run-wide settings, as one frozen value."""

from __future__ import annotations

from typing import Any

import attrs
from accelerate import Accelerator

from ._backend import loader_placement, wait_for_everyone
from .interrupt import Interrupt


def _require_accelerator(value: Any) -> Accelerator:
    if not isinstance(value, Accelerator):
        raise TypeError(
            f"'accelerator' must be an accelerate.Accelerator (got {value!r} that is a "
            f"{type(value).__name__}): build one with Accelerator(...) and pass it as "
            "Context(accelerator=...)."
        )
    return value


def _accumulation_steps(ctx: Context) -> int:
    # attrs runs factories before validators, so the type is checked here.
    return int(_require_accelerator(ctx.accelerator).gradient_accumulation_steps)


def _mixed_precision(ctx: Context) -> str:
    return str(ctx.accelerator.mixed_precision)


def _is_main_process(ctx: Context) -> bool:
    return bool(ctx.accelerator.is_main_process)


@attrs.frozen(eq=False)
class Context:
    """The Accelerator and the run-wide settings trainfold reads.

    trainfold keeps no global state of its own, but Accelerate does: its
    ``AcceleratorState`` and ``GradientState`` are shared by every Accelerator in
    a process. A second ``Accelerator(gradient_accumulation_steps=2)`` silently
    changes the first one's accumulation. A Context records the precision and
    accumulation it was made with, and every primitive that uses it checks them
    (:meth:`check`), so such a conflict is an error, not a wrong result.

    Args:
        accelerator: the ``accelerate.Accelerator`` that does device placement,
            mixed precision, accumulation and distribution.

    Example:
        >>> from accelerate import Accelerator
        >>> ctx = Context(accelerator=Accelerator(cpu=True))
        >>> ctx.gradient_accumulation_steps, ctx.mixed_precision
        (1, 'no')

    .. versionadded:: 0.1.0
    """

    accelerator: Accelerator
    gradient_accumulation_steps: int = attrs.field(
        init=False, default=attrs.Factory(_accumulation_steps, takes_self=True)
    )
    mixed_precision: str = attrs.field(
        init=False, default=attrs.Factory(_mixed_precision, takes_self=True)
    )
    #: True on the process that should log, print and write shared files. Read once: Accelerate's
    #: own property builds a ``PartialState`` on every read (~2.5 us, 10 times that in a cold cache).
    is_main_process: bool = attrs.field(init=False, default=attrs.Factory(_is_main_process, takes_self=True))
    #: the stop request Ctrl-C sets while ``run_epoch`` runs (see :mod:`trainfold.interrupt`)
    interrupt: Interrupt = attrs.field(init=False, factory=Interrupt, repr=False)
    #: the checkpoint roots this run writes, by path: the lock's descriptor on the main process
    #: (held until :meth:`close` or the process ends), None on the others
    checkpoint_locks: dict[str, Any] = attrs.field(init=False, factory=dict, repr=False)

    def check(self) -> None:
        """Raise if another Accelerator changed the process-wide settings this Context relies on.

        Raises:
            RuntimeError: the accumulation steps or mixed precision now in force differ from
                those this Context was made with.
        """
        now = (_accumulation_steps(self), _mixed_precision(self))
        if now != (self.gradient_accumulation_steps, self.mixed_precision):
            raise RuntimeError(
                "Accelerate's state is process-wide and another Accelerator has changed it: this "
                f"Context was made with gradient_accumulation_steps={self.gradient_accumulation_steps}"
                f" and mixed_precision={self.mixed_precision!r}, but now "
                f"gradient_accumulation_steps={now[0]} and mixed_precision={now[1]!r} are in force. "
                "Use one Accelerator per process (share one Context), or give both the same settings."
            )

    def close(self) -> None:
        """End the run: release its checkpoint locks, finish Accelerate's trackers and destroy the process group.

        A distributed run that skips this aborts at exit under torchrun. It does
        not wait for the other processes: one that destroys the group while
        another still uses it can abort too. Prefer
        ``with Context(accelerator=...) as ctx:``, which waits for every process
        (when the block ended without an exception) and closes on the way out.
        """
        from ._lock import release

        for fd in self.checkpoint_locks.values():
            if fd is not None:
                release(fd)
        self.checkpoint_locks.clear()
        self.accelerator.end_training()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.wait_for_everyone()  # no rank tears down while another still works
        self.close()

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a no-op on one process).

        ``accelerator.wait_for_everyone()``, except across CPU processes, where
        it calls torch's gloo barrier directly: Accelerate's asks for a GPU per
        process, which fails on a machine with fewer GPUs than processes.

        Example:
            >>> from accelerate import Accelerator
            >>> Context(accelerator=Accelerator(cpu=True)).wait_for_everyone()  # one process: returns at once
        """
        wait_for_everyone(self.accelerator)

    def prepare_loaders(self, *loaders: Any) -> tuple[Any, ...]:
        """Prepare data loaders for the Accelerator (device placement, sharding across processes).

        ``accelerator.prepare(*loaders)``, except on a CPU device, where the
        batches are left where the ``DataLoader`` put them (on the CPU already)
        instead of being walked and moved to the CPU on every batch.

        Args:
            *loaders: ``torch.utils.data.DataLoader`` objects.

        Returns:
            A tuple of prepared loaders, in the order given (a 1-tuple for one loader).

        Example:
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
        prepared = self.accelerator.prepare(*loaders, device_placement=loader_placement(self.accelerator, len(loaders)))
        return prepared if isinstance(prepared, tuple) else (prepared,)
