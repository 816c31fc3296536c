"""Advantage estimators: GRPO's group normalisation and PPO's GAE (formulas of MindSpeed-RL / verl)."""
from __future__ import annotations

import torch

from services.trainer.masked import masked_whiten

GROUP_NORM_EPS = 1e-6


def group_norm_advantages(scores: torch.Tensor, n_samples_per_prompt: int, response_mask: torch.Tensor) -> torch.Tensor:
    """GRPO: each sample's score normalised within its group of n, broadcast over its response tokens.

    scores [B*n] (a group is n contiguous samples), response_mask [B*n, L] -> advantages [B*n, L].
    (r - mean) / (std + 1e-6) with the unbiased std, as MindSpeed-RL computes it.
    """
    if scores.numel() % n_samples_per_prompt:
        raise ValueError(f"scores: {scores.numel()} samples is not a multiple of n_samples_per_prompt={n_samples_per_prompt}")
    grouped = scores.float().view(-1, n_samples_per_prompt)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True) if n_samples_per_prompt > 1 else torch.zeros_like(mean)
    normed = ((grouped - mean) / (std + GROUP_NORM_EPS)).view(-1, 1)
    return normed * response_mask.to(normed.dtype)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: generalised advantage estimation over response tokens, then whitening.

    token_rewards, values, response_mask [B, L]; returns (advantages [B, L] whitened over the mask,
    returns [B, L] = raw advantages + values). Past the last response token the next value is 0.
    """
    mask = response_mask.to(values.dtype)
    values = values * mask
    length = token_rewards.size(1)
    last = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last)
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask) * mask, returns
