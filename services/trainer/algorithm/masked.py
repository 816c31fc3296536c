"""Masked reductions shared by the advantage and loss functions."""
from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (over `dim`, or over everything)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the masked entries, with the unbiased variance (verl's whitening)."""
    mask = mask.to(values.dtype)
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / (count - 1).clamp_min(1.0)
    return (values - mean) * torch.rsqrt(var + eps)
