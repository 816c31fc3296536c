"""adv_estimator gae (PPO): a critic's values, the token rewards (with the KL penalty under use_kl_in_reward), GAE."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

from torch.profiler import record_function

from services.common.config import RLConfig
from services.trainer.algorithm.advantages import ppo_targets
from services.trainer.algorithm.critic import Critic
from services.trainer.algorithm.estimators.interface import (AdvantageEstimator, Estimate, EstimatorSetup, LogProbPasses,
                                                             EstimatorBatch)
from services.trainer.modeling.checkpoint import TrainState
from services.trainer.modeling.logprobs import ResponseBatch


@dataclass(frozen=True)
class GAEEstimator(AdvantageEstimator):
    """Owns the critic: its values before the policy update give the advantages and its returns, and it is updated after."""

    critic: Critic
    rl: RLConfig

    @classmethod
    def build(cls, setup: EstimatorSetup) -> "GAEEstimator":
        return cls(Critic.build(setup.cfg, setup.layout, setup.hf_state, setup.dtype, setup.total_steps), setup.cfg.rl_config)

    def estimate(self, batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float) -> Estimate:
        kl_in_reward = self.rl.use_kl_in_reward
        # the reward's KL needs the old policy before the update; otherwise the update has it
        old_logprobs = passes.old_logprobs() if kl_in_reward else None
        ref_logprobs = passes.reference_logprobs()
        with record_function("critic_compute_values"):
            values = self.critic.values(batch.samples, passes.forward).float().cpu()
        targets = ppo_targets(batch.scores, values, batch.mask, self.rl, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                              kl_coef=kl_coef)
        return Estimate(targets.advantages, old_logprobs=old_logprobs,
                        ref_logprobs=None if kl_in_reward else ref_logprobs,  # a KL in the reward is not in the loss too
                        reward_kl=targets.kl, values=values, returns=targets.returns)

    def update(self, samples: ResponseBatch, estimate: Estimate, step: int) -> dict[str, float]:
        with record_function("critic_update"):
            critic_out = self.critic.update(samples, estimate.values, estimate.returns, step)
        return {f"critic/{k}": v for k, v in critic_out.as_dict().items()}

    def save(self, root: str | pathlib.Path, state: TrainState) -> None:
        self.critic.save(root, state)

    def load(self, root: str | pathlib.Path, step: int) -> None:
        self.critic.load(root, step)
