"""Data-parallel ranks split an iteration's rows: this rank's share of them, and per-row results made whole on every rank.

Every rank holds the whole batch (token ids are small; rank 0 broadcasts it). Each forward or
backward pass runs only on this rank's share of the rows; a no-grad pass's per-row results are
summed over the data-parallel group into a zero-filled [B, L] matrix, so every rank ends with all
rows (what advantages, GAE and the metrics need) at the cost of one all-reduce of B x L floats.
"""
from __future__ import annotations

import torch

from services.trainer.modeling.model import compute_device


def data_parallel_rank_size() -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size); (0, 1) before megatron's groups exist."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def my_rows(rows: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's contiguous share of `rows` (shares differ by at most one row)."""
    rank, size = data_parallel_rank_size()
    return rows.tensor_split(size)[rank] if size > 1 else rows


def sum_over(values: torch.Tensor, group) -> torch.Tensor:
    """Sums the CPU tensor `values` over process `group`, in place, through the compute device (NCCL and HCCL
    reduce device tensors only); returns it."""
    on_device = values.to(compute_device())
    torch.distributed.all_reduce(on_device, group=group)
    values.copy_(on_device.cpu())
    return values


def sum_over_data_parallel(values: torch.Tensor) -> torch.Tensor:
    """Sums the CPU tensor `values` over the data-parallel group, in place; returns it."""
    from megatron.core import parallel_state

    if data_parallel_rank_size()[1] > 1:
        sum_over(values, parallel_state.get_data_parallel_group())
    return values
