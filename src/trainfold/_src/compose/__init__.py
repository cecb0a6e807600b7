"""What users compose: epochs, evaluation, epoch functions, loops, step transformers, fit.

The top layer: it may import every other package; none imports it.
"""
