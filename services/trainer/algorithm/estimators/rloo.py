"""adv_estimator rloo: REINFORCE leave-one-out (Ahmadian et al. 2024), verl's compute_rloo_outcome_advantage."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.config import RLConfig
from services.trainer.algorithm.estimators.interface import (AdvantageEstimator, Estimate, EstimatorSetup, LogProbPasses,
                                                             EstimatorBatch)
from services.trainer.algorithm.estimators.token_rewards import outcome_token_rewards


def rloo_advantages(scores: torch.Tensor, n_samples_per_prompt: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Each sample's score minus the mean of the other n - 1 of its group, broadcast over its response tokens.

    scores [B*n] (a group is n contiguous samples, n >= 2), response_mask [B*n, L] -> [B*n, L]; written as verl's
    compute_rloo_outcome_advantage writes it: r * n / (n - 1) - mean(group) * n / (n - 1), no whitening.
    """
    n = n_samples_per_prompt
    if n < 2 or scores.numel() % n:
        raise ValueError(f"rloo: needs groups of n_samples_per_prompt >= 2 dividing the batch; got n={n}, {scores.numel()} samples")
    grouped = scores.float().view(-1, n)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)) * (n / (n - 1))
    return advantages.view(-1, 1) * response_mask.float()


@dataclass(frozen=True)
class RLOOEstimator(AdvantageEstimator):
    """No model of its own; the score is the sum of the token rewards (with the KL under use_kl_in_reward, as verl)."""

    rl: RLConfig

    @classmethod
    def build(cls, setup: EstimatorSetup) -> "RLOOEstimator":
        return cls(setup.cfg.rl_config)

    def estimate(self, batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float) -> Estimate:
        tokens = outcome_token_rewards(batch, passes, kl_coef, self.rl)
        advantages = rloo_advantages(tokens.rewards.sum(dim=-1), self.rl.n_samples_per_prompt, batch.mask)
        return Estimate(advantages, old_logprobs=tokens.old_logprobs, ref_logprobs=tokens.ref_logprobs, reward_kl=tokens.kl)
