"""adv_estimator group_norm (GRPO, and DAPO's with its clip-higher and group filter): each sample's score normalised in its group."""
from __future__ import annotations

from dataclasses import dataclass

from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.algorithm.estimators.interface import (AdvantageEstimator, Estimate, EstimatorSetup, LogProbPasses,
                                                             EstimatorBatch)


@dataclass(frozen=True)
class GroupNormEstimator(AdvantageEstimator):
    """No model of its own; the reference log-probs (with a reference model) feed the loss's KL term. The update computes
    the old log-probs itself, or skips them when they equal the current policy's."""

    n_samples_per_prompt: int

    @classmethod
    def build(cls, setup: EstimatorSetup) -> "GroupNormEstimator":
        return cls(setup.cfg.rl_config.n_samples_per_prompt)

    def estimate(self, batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float) -> Estimate:
        ref_logprobs = passes.reference_logprobs()
        return Estimate(group_norm_advantages(batch.scores, self.n_samples_per_prompt, batch.mask), ref_logprobs=ref_logprobs)
