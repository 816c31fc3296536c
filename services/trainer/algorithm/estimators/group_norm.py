"""adv_estimator group_norm (GRPO, and DAPO's with its clip-higher and group filter): each sample's score normalised in its
group; with norm_adv_by_std_in_grpo false, Dr. GRPO's: the score minus its group's mean, not divided by the std."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.algorithm.estimators.interface import (AdvantageEstimator, Estimate, EstimatorSetup, LogProbPasses,
                                                             EstimatorBatch)


def group_mean_advantages(scores: torch.Tensor, n_samples_per_prompt: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): r - mean(group), broadcast over the response tokens, as verl's
    compute_grpo_outcome_advantage with norm_adv_by_std_in_grpo=False. scores [B*n], response_mask [B*n, L] -> [B*n, L]."""
    if scores.numel() % n_samples_per_prompt:
        raise ValueError(f"scores: {scores.numel()} samples is not a multiple of n_samples_per_prompt={n_samples_per_prompt}")
    grouped = scores.float().view(-1, n_samples_per_prompt)
    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1, 1) * response_mask.float()


@dataclass(frozen=True)
class GroupNormEstimator(AdvantageEstimator):
    """No model of its own; the reference log-probs (with a reference model) feed the loss's KL term. The update computes
    the old log-probs itself, or skips them when they equal the current policy's."""

    n_samples_per_prompt: int
    norm_by_std: bool = True  # rl_config.norm_adv_by_std_in_grpo

    @classmethod
    def build(cls, setup: EstimatorSetup) -> "GroupNormEstimator":
        rl = setup.cfg.rl_config
        return cls(rl.n_samples_per_prompt, rl.norm_adv_by_std_in_grpo)

    def estimate(self, batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float) -> Estimate:
        ref_logprobs = passes.reference_logprobs()
        advantages = group_norm_advantages if self.norm_by_std else group_mean_advantages
        return Estimate(advantages(batch.scores, self.n_samples_per_prompt, batch.mask), ref_logprobs=ref_logprobs)
