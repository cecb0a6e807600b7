"""The run as values and the step: Context, TrainState, make_step and its stages, snapshots.

It imports :mod:`trainfold._src.base`, :mod:`trainfold._src.backend` and
:mod:`trainfold._src.distributed`; nothing here knows checkpoints or loops.
"""
