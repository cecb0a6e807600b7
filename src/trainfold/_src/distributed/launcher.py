"""A worker whose launcher is gone ends: it does not train on beside the job that is started again.

torchrun (and ``accelerate launch``, which runs it) starts each worker in a session of its own, so a
``kill -9`` of the launcher's process group, or of the launcher alone, leaves its workers running:
they go on training and saving next to whatever is launched in its place. A worker started by
torchrun's elastic agent (``TORCHELASTIC_RUN_ID`` is set) so watches, from a thread of its own, the
process that started it, and when it is gone says so and exits at once, with status 1.

It exits rather than asking for a stop: a stop is agreed with every process and ends each with
status 0, and the workers of another node, whose launcher lives, would then report a finished job
to it. Exiting is what the node's loss makes of every process: the others' next collective fails,
their launchers restart them (or end the job), and the job goes on from its newest checkpoint.
Nothing is half written: a save in progress is never committed, and the kernel drops the root's lock.
"""

from __future__ import annotations

import os
import threading

#: how often the launcher is looked for (``os.getppid``, a system call)
INTERVAL_S = 0.5


def started_by_launcher() -> bool:
    """Whether torchrun's elastic agent (torchrun, ``accelerate launch``, Kubeflow's torch runtime) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class LauncherWatch:
    """Watch the process that started this one; exit when it is gone. :meth:`stop` ends the watch.

    Args:
        interval_s: seconds between two looks.
    """

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self._launcher = os.getppid()
        self._interval = interval_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if self._launcher > 1:  # an orphan already at its start has no launcher left to watch
            self._thread = threading.Thread(target=self._watch, name="trainfold-launcher-watch", daemon=True)
            self._thread.start()

    @property
    def watching(self) -> bool:
        """Whether the watch runs (it does from its start until :meth:`stop`, where the launcher was there to watch)."""
        return self._thread is not None and not self._stopped.is_set()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(self._interval):
            if os.getppid() != self._launcher:
                _exit(self._launcher)


def _exit(launcher: int) -> None:
    """Say why on stderr (one write: logging may be unset, or held by the main thread) and end the process now."""
    os.write(
        2,
        f"trainfold: the launcher that started this process (pid {launcher}) is gone; exiting: an engine that starts "
        "the job again resumes it from its newest checkpoint.\n".encode(),
    )
    os._exit(1)
