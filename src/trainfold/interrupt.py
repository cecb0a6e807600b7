"""Ctrl-C as a request to stop at the next step boundary, agreed by every process."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

import torch
from accelerate import Accelerator

#: On several processes, the processes agree on an interrupt once every this many updates.
AGREE_EVERY = 50


class Interrupt:
    """The stop request a Context carries: set by SIGINT, read at step boundaries.

    It is a signal from outside the run, not run state (it is not checkpointed).
    On one process a request is honoured after the current step. On several,
    each process may see Ctrl-C at a different step, so they agree with one
    all-reduce every ``AGREE_EVERY`` updates and stop together.
    """

    def __init__(self) -> None:
        self.requested = False
        self._decided_at: int | None = None
        self._decision = False

    def request(self) -> None:
        self.requested = True

    def agreed(self, accelerator: Accelerator, step: int) -> bool:
        """Whether the run stops after this step (the same answer on every process)."""
        if accelerator.num_processes == 1:
            return self.requested
        if self._decided_at == step or step % AGREE_EVERY:
            return self._decision
        flag = torch.tensor(float(self.requested), device=accelerator.device)
        self._decision = bool(accelerator.reduce(flag, reduction="sum") > 0)  # sync: once every AGREE_EVERY updates
        self._decided_at = step
        return self._decision


@contextlib.contextmanager
def catching_interrupts(interrupt: Interrupt) -> Iterator[None]:
    """Turn the first SIGINT into ``interrupt.request()``; a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        if interrupt.requested:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        interrupt.request()

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
