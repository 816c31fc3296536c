"""The Megatron trainer: model, algorithms, update step, checkpoints and weight push."""
