"""A job that writes checkpoints to a root on a store and stops itself (SIGSTOP) at one point of one save.

    python stalled_writer.py ROOT OPTIONS_JSON UPDATES STOP MARKER

Continues the run at ROOT from its newest checkpoint (if any), then trains and saves after every UPDATES updates
(``max_batches``), two saves in all. STOP is where the process stops itself, as a GC pause, a swapped-out node or a
frozen VM would stop it: ``write:ckpt-...`` after writing the first file of that checkpoint, ``commit:ckpt-...``
once every file of it is written, just before its commit, ``manifest:ckpt-...`` inside the commit, after the lease's
fence and before the manifest is written. MARKER is created first, so the test knows the process is about to stop.
The code that writes and commits runs unchanged; only the stop is placed here.
Prints "committed <name>" per save, or "refused <why>" for a CheckpointError (and exits 3).
"""

import json
import os
import signal
import sys
from pathlib import Path

from trainfold import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    make_step,
    run_epoch,
    save_checkpoint,
    testing,
)
from trainfold._src.checkpoint.storage import remote


def stop_at(where: str, name: str, marker: Path) -> None:
    """Make this process stop itself once, at ``where`` in the save of checkpoint ``name``."""
    write, commit, create_manifest = remote.RemoteStaging.write, remote.RemoteStaging.commit, remote._create_manifest

    def stop_here(point: str, checkpoint: str) -> None:
        if point == where and checkpoint == name and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    def stopping_write(self, file, chunks):
        entry = write(self, file, chunks)
        stop_here("write", self.checkpoint.name)
        return entry

    def stopping_commit(self, manifest):
        stop_here("commit", self.checkpoint.name)
        return commit(self, manifest)

    def stopping_create_manifest(ckpt, manifest):
        stop_here("manifest", ckpt.name)
        return create_manifest(ckpt, manifest)

    remote.RemoteStaging.write, remote.RemoteStaging.commit = stopping_write, stopping_commit
    remote._create_manifest = stopping_create_manifest


def main() -> int:
    root, options, updates, stop, marker = (
        sys.argv[1],
        json.loads(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        Path(sys.argv[5]),
    )
    stop_at(*stop.split(":"), marker)
    ctx, state, loader, loss_fn = testing.tiny_setup(seed=0)
    if latest_checkpoint(root, storage_options=options) is not None:
        state = load_checkpoint(ctx, root, state, storage_options=options)
    step = make_step(ctx, loss_fn)
    try:
        for _ in range(2):
            state = run_epoch(ctx, step, loader, state, max_batches=updates)
            save_checkpoint(ctx, root, state, storage_options=options)
            print("committed", f"ckpt-{state.step:010d}", flush=True)
    except CheckpointError as exc:
        print("refused", exc, flush=True)
        return 3
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
