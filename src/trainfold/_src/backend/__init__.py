"""The only package that reads Accelerate's internals or branches on its backend (DDP, FSDP, DeepSpeed).

It imports :mod:`trainfold._src.base` only. Decisions here are taken once, when a step
or an evaluation is built, never per batch.
"""
