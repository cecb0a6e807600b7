"""Processes that agree: the control channel, signals as stop requests, the background saver's thread, launching.

It imports :mod:`trainfold._src.base` and :mod:`trainfold._src.backend`; it knows neither
the Context nor the TrainState (the Context holds what is made here).
"""
