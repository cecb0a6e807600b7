"""The errors trainfold raises of its own (``from trainfold import CheckpointError``, or from here)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, or does not fit the run it is loaded into.

    Nothing was changed when it is raised: every check of a load runs before the
    live model, optimizer and random states are touched.
    """
