"""Deterministic mode (megatron_training.npu_deterministic, MindSpeed-RL's name; it applies on every device).

Set on each rank before its process groups and first kernels exist: the collective libraries and
cuBLAS read their settings when they start.
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch


def enable_determinism(seed: int) -> None:
    """Seeds Python, NumPy and torch and makes torch pick deterministic kernels (an error where it has none)."""
    # Ascend: HCCL reduces in a fixed order; CUDA: cuBLAS needs a fixed workspace for deterministic GEMMs.
    # An explicit setting in the environment wins. NCCL has no such switch: see docs/trainer.md.
    os.environ.setdefault("HCCL_DETERMINISTIC", "true")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
