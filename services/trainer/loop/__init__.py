"""The training loop: the driver, rank 0's dock and replica work, the session on every rank, run records, evaluation and the control service."""
