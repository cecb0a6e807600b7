"""The run as values and the step: Context, TrainState, make_step and its stages, snapshots.

It imports :mod:`trainfold.base`, :mod:`trainfold.backend` and
:mod:`trainfold.distributed`; nothing here knows checkpoints or loops.
"""
