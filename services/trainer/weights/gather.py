"""The policy's weights in Hugging Face names for a push: TP shards gathered within each stage, then stages across PP.

The bucket format they are packed into is services/common/weight_wire.py's, shared with the replicas.
"""
from __future__ import annotations

import torch


def gather_hf_weights(model, layout) -> dict[str, torch.Tensor]:
    """The full model in HF names on every rank: TP shards gathered within each stage, then stages across PP."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.trainer.modeling.checkpoint_convert import megatron_to_hf

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    stage: dict[int, dict[str, torch.Tensor]] = {t: {} for t in range(tp)}
    for name, tensor in state.items():
        if tp == 1:
            stage[0][name] = tensor.cpu()
            continue
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        for t in range(tp):
            stage[t][name] = parts[t].cpu()
    stages = [stage]
    if pp > 1:
        stages = [None] * pp
        dist.all_gather_object(stages, stage, group=parallel_state.get_pipeline_model_parallel_group())
    return megatron_to_hf({(p, t): stages[p][t] for p in range(pp) for t in range(tp)}, layout)
