"""Finishes a weight reload of a mixture-of-experts model on vLLM's CPU backend.

vLLM 0.32 prepacks each MoE layer's routed experts (`w13_weight`, `w2_weight`) into its CPU
grouped-GEMM layout at load (`CPUUnquantizedExperts.process_weights_after_loading`), but on a
weight update (`UnquantizedFusedMoEMethod._setup_kernel` with its kernel already built) it
copies the new weights in HF layout and skips that step, so the CPU kernel reads unpacked
weights as packed: reloading a tiny Qwen2-MoE's own weights moved its log-probs by 3.5 nats
(docs/moe.md). Running the experts' own prepack after the reload restores them exactly.
"""
from __future__ import annotations

from typing import Iterable

ROUTED_EXPERT_MARK = ".mlp.experts."  # HF names of routed experts: model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight


def reloads_routed_experts(names: Iterable[str]) -> bool:
    """Whether a reload of `names` rewrites routed expert weights (a shared expert is a plain MLP, repacked by vLLM)."""
    return any(ROUTED_EXPERT_MARK in name for name in names)


def repack_cpu_moe_experts(model) -> int:
    """Prepacks every MoE layer's reloaded routed experts for vLLM's CPU kernel; returns how many layers.

    Call once after a reload that rewrote all routed experts: the prepack of already packed weights
    would scramble them. Does nothing off the CPU backend, whose experts vLLM re-processes itself.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    layers = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)
            layers += 1
    return layers
