"""Plain values and checks: batches, histories, running sums, records, random states, argument checks.

The bottom layer: its modules import nothing else of trainfold's (neither the
Context, nor the TrainState, nor Accelerate's internals).
"""
