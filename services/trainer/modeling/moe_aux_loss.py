"""The routers' load-balancing loss of megatron-core's MoE layers, weighted and read back as the policy loss is.

megatron-core adds each MoE layer's auxiliary loss to the gradient inside the backward pass
(`MoEAuxLossAutoScaler`), scaled by one global factor, and sums its value per layer in
`get_moe_layer_wise_logging_tracker()`. The update sets that factor to each micro-batch's weight
when its backward reaches a stage's output, before any of the stage's MoE layers, so the
load-balancing gradient is the mini-batch's token-weighted mean like the policy loss's (and the same
over any data-, expert- or pipeline-parallel split), and reads the value after each forward for the
`moe_aux_loss` metric. Under a pipeline schedule a factor set before the backward's start would not
do: megatron's 1F1B runs micro-batch i's backward after later micro-batches' forwards, and sets its
own uniform factor after every forward.
"""
from __future__ import annotations

import torch

from services.trainer.modeling.data_parallel import sum_over
from services.trainer.modeling.model import compute_device

TRACKER_NAME = "load_balancing_loss"  # the name megatron's router logs the aux_loss type under


def set_weight(weight: float) -> None:
    """The factor on the load-balancing gradient of the micro-batch about to run backward."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(weight), device=compute_device()))


def weigh_backward(output: torch.Tensor, weight: float) -> None:
    """Makes `weight` the load-balancing gradient's factor from the moment the backward pass reaches `output` (a
    pipeline stage's output, or the model's): every MoE layer of that stage runs its backward after it."""
    if output.requires_grad:
        output.register_hook(lambda grad: set_weight(weight))


def sum_over_stages(value: torch.Tensor) -> torch.Tensor:
    """Sums `value` (CPU), each stage's share of the load-balancing loss from its own layers, over the pipeline stages."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        sum_over(value, parallel_state.get_pipeline_model_parallel_group())
    return value


def take(coeff: float) -> float:
    """The load-balancing loss of the forward passes since the last call (coeff x its sum over layers, what the
    objective gains), and clears megatron's tracker for the next. With coeff > 0 a collective over the tensor- and
    context-parallel ranks, which all take it at the same point.

    Under TP or CP each rank's router scores its own tokens against the expert counts of all of them, so its tracked
    value is a part: megatron sums the parts over the group it records (tp_cp), as its own logging does."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(TRACKER_NAME)
    if entry is None:
        return 0.0
    values = entry["values"].detach().clone()
    clear_aux_losses_tracker()
    if coeff == 0:
        return 0.0
    group = entry.get("reduce_group")
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(values, group=group)
    return float(values.sum()) * coeff
