"""Counts, inside vLLM's worker, the tokens each MoE layer's router sends to each expert (for EPLB).

vLLM's routers (`BaseRouter`) call a capture callback with the logical top-k expert ids of every
routed token, before any EPLB remapping (`set_capture_fn`, the hook vLLM's routing replay uses):
counting there sees exactly the experts the MoE kernel computes, whether the model calls its gate
itself (Qwen2-MoE) or hands it to the MoE runner (Qwen3-MoE, whose fused gate GEMM bypasses a
forward hook on the gate module). Each routed token adds top-k to its layer's total.
"""
from __future__ import annotations


class ExpertCounter:
    """Per MoE layer, the token count of each expert since `attach`."""

    def __init__(self):
        self.counts: dict[int, object] = {}  # layer id -> torch int64 [num_experts]

    def attach(self, model) -> tuple[int, int]:
        """Hooks every MoE layer's router of `model`; returns (MoE layers, experts per layer), (0, 0) for a dense model."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        import torch

        device = next(model.parameters()).device
        for module in model.modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                counts = torch.zeros(module.router.global_num_experts, dtype=torch.int64, device=device)
                self.counts[module.layer_id] = counts
                module.router.set_capture_fn(self._counter(counts))
        return len(self.counts), (len(next(iter(self.counts.values()))) if self.counts else 0)

    @staticmethod
    def _counter(counts):
        import torch

        def capture(topk_ids) -> None:  # [tokens, top_k] logical expert ids
            # on the model's device and without a host sync (bincount would sync to size its output)
            ids = topk_ids.flatten().long()
            counts.scatter_add_(0, ids, torch.ones_like(ids))

        return capture

    def read(self) -> list[list[int]]:
        """Counts as [MoE layer in model order][expert]."""
        return [self.counts[layer].cpu().tolist() for layer in sorted(self.counts)]
