"""The errors trainfold raises of its own (``from trainfold import CheckpointError``, or from here)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, or does not fit the run it is loaded into.

    Raised by a load, nothing was changed: every check of a load runs before the
    live model, optimizer and random states are touched. Raised by ``run_epoch`` on
    a loaded state (a stream's saved position that the loader cannot take), it comes
    before the epoch reads its first batch.
    """
