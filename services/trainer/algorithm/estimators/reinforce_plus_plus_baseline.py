"""adv_estimator reinforce_plus_plus_baseline: REINFORCE++ with the group mean as baseline (Hu 2025), verl's
compute_reinforce_plus_plus_baseline_outcome_advantage."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.config import RLConfig
from services.trainer.algorithm.estimators.interface import (AdvantageEstimator, Estimate, EstimatorSetup, LogProbPasses,
                                                             EstimatorBatch)
from services.trainer.algorithm.estimators.token_rewards import outcome_token_rewards
from services.trainer.algorithm.masked import masked_whiten


def reinforce_plus_plus_baseline_advantages(scores: torch.Tensor, n_samples_per_prompt: int,
                                            response_mask: torch.Tensor) -> torch.Tensor:
    """Each sample's score minus its group's mean, broadcast over its response tokens, then whitened over every response
    token of the batch (verl's masked_whiten, unbiased variance); 0 off the mask. scores [B*n], response_mask [B*n, L]."""
    n = n_samples_per_prompt
    if scores.numel() % n:
        raise ValueError(f"scores: {scores.numel()} samples is not a multiple of n_samples_per_prompt={n}")
    grouped = scores.float().view(-1, n)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1, 1)
    mask = response_mask.float()
    return masked_whiten(centred * mask, mask) * mask


@dataclass(frozen=True)
class ReinforcePlusPlusBaselineEstimator(AdvantageEstimator):
    """No model of its own; the score is the sum of the token rewards (with the KL under use_kl_in_reward, as verl)."""

    rl: RLConfig

    @classmethod
    def build(cls, setup: EstimatorSetup) -> "ReinforcePlusPlusBaselineEstimator":
        return cls(setup.cfg.rl_config)

    def estimate(self, batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float) -> Estimate:
        tokens = outcome_token_rewards(batch, passes, kl_coef, self.rl)
        advantages = reinforce_plus_plus_baseline_advantages(tokens.rewards.sum(dim=-1), self.rl.n_samples_per_prompt, batch.mask)
        return Estimate(advantages, old_logprobs=tokens.old_logprobs, ref_logprobs=tokens.ref_logprobs, reward_kl=tokens.kl)
