"""Advantage estimators: GRPO's group normalisation and PPO's GAE (formulas of MindSpeed-RL / verl)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.algorithm.kl import kl_penalty
from services.trainer.algorithm.masked import masked_whiten

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


def token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None,
                        kl_coef: float = 0.0) -> torch.Tensor:
    """PPO's per-token rewards: each sample's score on its last response token, minus kl_coef * kl on every response token.

    scores [B], response_mask [B, L], kl [B, L] a per-token KL estimate of old vs reference policy
    (None: no KL in the reward) -> [B, L], 0 past each response (verl's apply_kl_penalty).
    """
    mask = response_mask.float()
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores: shape {tuple(scores.shape)} does not match {mask.size(0)} samples")
    if bool((mask.sum(dim=1) == 0).any()):
        raise ValueError("response_mask: every sample needs at least one response token to carry its score")
    # the last masked-in token: a multi-turn episode's mask has environment tokens (0) between the model's
    last = mask.size(1) - 1 - mask.flip(dims=[1]).argmax(dim=1)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(mask.size(0)), last] = scores.float()
    if kl is not None:
        rewards = rewards - kl_coef * kl.float() * mask
    return rewards


@dataclass(frozen=True)
class PPOTargets:
    """What GAE gives the actor and the critic, all [B, L] over the response tokens."""

    token_rewards: torch.Tensor
    advantages: torch.Tensor  # whitened, for the policy loss
    returns: torch.Tensor  # raw advantages + values, the critic's regression target
    kl: torch.Tensor | None  # the per-token KL in the reward (None without use_kl_in_reward)


def ppo_targets(scores: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, rl,
                old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                kl_coef: float | None = None) -> PPOTargets:
    """Token rewards (with the KL penalty when rl.use_kl_in_reward), then GAE with rl.gamma / rl.lam.

    `rl` is the rl_config section; with use_kl_in_reward the KL is rl.kl_penalty of the rollout
    policy's log-probs (`old_logprobs`) against the reference's, scaled by `kl_coef` (the KL
    controller's value; rl.init_kl_coef when not given).
    """
    kl = None
    if rl.use_kl_in_reward:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("rl_config.use_kl_in_reward: needs the old and the reference log-probs")
        kl = kl_penalty(old_logprobs.float(), ref_logprobs.float(), rl.kl_penalty) * response_mask.float()
    rewards = token_level_rewards(scores, response_mask, kl, rl.init_kl_coef if kl_coef is None else kl_coef)
    advantages, returns = gae_advantages(rewards, values.float(), response_mask, rl.gamma, rl.lam)
    return PPOTargets(rewards, advantages, returns, kl)
