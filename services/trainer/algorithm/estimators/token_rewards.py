"""The token rewards the outcome estimators (rloo, reinforce_plus_plus, reinforce_plus_plus_baseline) start from, with
the KL penalty in them under use_kl_in_reward, as verl's apply_kl_penalty gives them to its estimators."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.config import RLConfig
from services.trainer.algorithm.advantages import token_level_rewards
from services.trainer.algorithm.estimators.interface import EstimatorBatch, LogProbPasses
from services.trainer.algorithm.kl import kl_penalty


@dataclass(frozen=True)
class TokenRewards:
    """[B, L] rewards over the response tokens, and the log-probs their KL came from (None without use_kl_in_reward)."""

    rewards: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # for the loss's KL term when the KL is not in the reward
    kl: torch.Tensor | None = None


def outcome_token_rewards(batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float, rl: RLConfig) -> TokenRewards:
    """Each sample's score on its last response token; with use_kl_in_reward, minus kl_coef * rl.kl_penalty(old, ref) on
    every response token (the old policy's log-probs from a pass before the update, as verl's apply_kl_penalty)."""
    ref_logprobs = passes.reference_logprobs()
    if not rl.use_kl_in_reward:
        return TokenRewards(token_level_rewards(batch.scores, batch.mask), ref_logprobs=ref_logprobs)
    if ref_logprobs is None:
        raise ValueError("rl_config.use_kl_in_reward: needs a reference model (rl_config.init_kl_coef > 0)")
    old_logprobs = passes.old_logprobs()
    kl = kl_penalty(old_logprobs, ref_logprobs, rl.kl_penalty) * batch.mask.float()
    return TokenRewards(token_level_rewards(batch.scores, batch.mask, kl, kl_coef), old_logprobs=old_logprobs, kl=kl)
