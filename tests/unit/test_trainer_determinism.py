"""megatron_training.npu_deterministic: what `enable_determinism` turns on in a trainer rank."""
import os

import torch

from services.trainer.loop.determinism import enable_determinism


def test_enable_determinism_seeds_and_asks_for_deterministic_kernels(monkeypatch):
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own setting wins
    try:
        enable_determinism(7)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["HCCL_DETERMINISTIC"] == "true" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        first = torch.rand(3)
        enable_determinism(7)
        assert torch.equal(first, torch.rand(3)), "the seed restarts torch's generator"
    finally:
        torch.use_deterministic_algorithms(False)
