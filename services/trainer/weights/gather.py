"""The policy's weights in Hugging Face names for a push: experts gathered over EP, TP shards within each stage, then
stages across PP.

The bucket format they are packed into is services/common/weight_wire.py's, shared with the replicas.
"""
from __future__ import annotations

import torch


def gather_hf_weights(model, layout) -> dict[str, torch.Tensor]:
    """The full model in HF names on every rank: experts gathered over EP, TP shards within each stage, then stages across PP."""
    return gather_hf_tensors({k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, layout)


def gather_hf_tensors(state: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """`state` (this rank's tensors by megatron name: its weights, or gradients) gathered from every rank into HF names."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.trainer.modeling.checkpoint_convert import is_expert_tensor, megatron_to_hf

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        state = _gather_experts(state, layout)
    stage: dict[int, dict[str, torch.Tensor]] = {t: {} for t in range(tp)}
    for name, tensor in state.items():
        if tp == 1:
            stage[0][name] = tensor.cpu()
            continue
        # Routed experts split over the expert tensor-parallel group (megatron's default: as many ranks as TP).
        group = (parallel_state.get_expert_tensor_parallel_group() if is_expert_tensor(name)
                 else parallel_state.get_tensor_model_parallel_group())
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        for t in range(tp):
            stage[t][name] = parts[t].cpu()
    stages = [stage]
    if pp > 1:
        stages = [None] * pp
        dist.all_gather_object(stages, stage, group=parallel_state.get_pipeline_model_parallel_group())
    return megatron_to_hf({(p, t): stages[p][t] for p in range(pp) for t in range(tp)}, layout)


def _gather_experts(state: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """Every expert-parallel rank's routed experts, numbered globally, with this rank's other tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.trainer.modeling.checkpoint_convert import is_expert_tensor, merge_expert_parallel

    ep = parallel_state.get_expert_model_parallel_world_size()
    parts: list[dict[str, torch.Tensor]] = [{k: v for k, v in state.items() if not is_expert_tensor(k)}] + [{} for _ in range(ep - 1)]
    for name, tensor in state.items():
        if is_expert_tensor(name):
            gathered = [torch.empty_like(tensor) for _ in range(ep)]
            dist.all_gather(gathered, tensor.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            for rank, part in enumerate(gathered):
                parts[rank][name] = part
    return merge_expert_parallel(parts, layout)
