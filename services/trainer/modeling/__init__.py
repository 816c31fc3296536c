"""The model and its parallelism: megatron-core GPTModel from HF layouts, CPU shims, TP/PP, log-prob passes, checkpoints and HF conversion."""
