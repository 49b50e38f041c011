"""The training step's maths: batches, packing, segmented attention, the log-prob head, portable numerics."""
