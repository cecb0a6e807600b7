"""The errors trainfold raises of its own (``from trainfold import CheckpointError``, or from here)."""

from __future__ import annotations

__all__ = ["CheckpointError", "DamagedCheckpoint"]


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, or does not fit the run it is loaded into.

    Raised by a load, nothing was changed: every check of a load runs before the
    live model, optimizer and random states are touched. Raised by ``run_epoch`` on
    a loaded state (a stream's saved position that the loader cannot take), it comes
    before the epoch reads its first batch.
    """


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose bytes are not what its manifest vouches for: a file missing, truncated, or
    of another digest (a bit flipped on disk), or a manifest that is not JSON.

    ``load_checkpoint`` of a root falls back from such a checkpoint to the newest one that loads
    (warning about the damaged one); any other refusal stops the load.
    """
