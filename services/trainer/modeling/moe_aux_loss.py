"""The routers' load-balancing loss of megatron-core's MoE layers, weighted and read back as the policy loss is.

megatron-core adds each MoE layer's auxiliary loss to the gradient inside the backward pass
(`MoEAuxLossAutoScaler`), scaled by one global factor, and sums its value per layer in
`get_moe_layer_wise_logging_tracker()`. The update sets that factor to each micro-batch's weight
before its backward, so the load-balancing gradient is the mini-batch's token-weighted mean like
the policy loss's (and the same over any data- or expert-parallel split), and reads the value
after each forward for the `moe_aux_loss` metric.
"""
from __future__ import annotations

import torch

from services.trainer.modeling.model import compute_device

TRACKER_NAME = "load_balancing_loss"  # the name megatron's router logs the aux_loss type under


def set_weight(weight: float) -> None:
    """The factor on the load-balancing gradient of the micro-batch about to run backward."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(weight), device=compute_device()))


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
