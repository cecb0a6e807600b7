"""Checkpoint storages: where a checkpoint's bytes go, and how a commit and one writer are made sure of."""
