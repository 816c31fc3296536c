"""The data dock: a Redis-backed pool of samples shared by the trainer, rollout and reward workers."""
