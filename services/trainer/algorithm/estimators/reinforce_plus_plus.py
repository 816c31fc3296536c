"""adv_estimator reinforce_plus_plus: REINFORCE++ (Hu 2025), verl's compute_reinforce_plus_plus_outcome_advantage."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.config import RLConfig
from services.trainer.algorithm.estimators.interface import (AdvantageEstimator, Estimate, EstimatorSetup, LogProbPasses,
                                                             EstimatorBatch)
from services.trainer.algorithm.estimators.token_rewards import outcome_token_rewards
from services.trainer.algorithm.masked import masked_whiten


def reinforce_plus_plus_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """The discounted return-to-go of each response token, G_t = r_t + gamma * G_{t+1}, whitened over every response token
    of the batch (verl's masked_whiten: unbiased variance), 0 off the mask.

    token_rewards, response_mask [B, L] -> [B, L]. As verl, the return is cut at the first padding position (the running
    return is multiplied by the mask), so padding never carries a return into a response.
    """
    mask = response_mask.float()
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.size(0))
    for t in reversed(range(token_rewards.size(1))):
        running = token_rewards[:, t].float() + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, mask) * mask


@dataclass(frozen=True)
class ReinforcePlusPlusEstimator(AdvantageEstimator):
    """No model of its own and no group baseline: the KL belongs in the reward (use_kl_in_reward, as the paper and verl)."""

    rl: RLConfig

    @classmethod
    def build(cls, setup: EstimatorSetup) -> "ReinforcePlusPlusEstimator":
        return cls(setup.cfg.rl_config)

    def estimate(self, batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float) -> Estimate:
        tokens = outcome_token_rewards(batch, passes, kl_coef, self.rl)
        advantages = reinforce_plus_plus_advantages(tokens.rewards, batch.mask, self.rl.gamma)
        return Estimate(advantages, old_logprobs=tokens.old_logprobs, ref_logprobs=tokens.ref_logprobs, reward_kl=tokens.kl)
