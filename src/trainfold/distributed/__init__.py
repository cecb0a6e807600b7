"""Processes that agree: the control channel, signals as stop requests, the background saver's thread, launching.

It imports :mod:`trainfold.base` and :mod:`trainfold.backend`; it knows neither
the Context nor the TrainState (the Context holds what is made here).
"""
