"""Checkpoint formats: gathered, sharded (DCP) and DeepSpeed, three implementations of one interface."""
