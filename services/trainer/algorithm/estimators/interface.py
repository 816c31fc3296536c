"""What an advantage estimator (one per rl_config.adv_estimator) is: the log-prob passes it asks for, its advantages, and
the models of its own it trains beside the policy (PPO's critic)."""
from __future__ import annotations

import pathlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from services.common.config import Config
from services.trainer.modeling.checkpoint import TrainState
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, compute_logprobs
from services.trainer.modeling.model import ModelLayout


@dataclass(frozen=True)
class EstimatorBatch:
    """One iteration's samples as the estimator sees them."""

    samples: ResponseBatch
    mask: torch.Tensor  # [B, L] 1 on response tokens
    scores: torch.Tensor  # [B] fp32, each sample's reward


@dataclass(frozen=True)
class LogProbPasses:
    """The forward passes over `samples` an estimator may ask for before the update; each gives [B, L] fp32 on CPU."""

    policy: Any
    reference: Any | None  # None: no reference model (init_kl_coef 0)
    samples: ResponseBatch
    forward: ForwardConfig  # the training passes' micro-batches (a critic's value pass takes them too)
    policy_forward: ForwardConfig | None = None  # the policy's log-prob pass (rl_config.actor_forward_*); None: `forward`
    reference_forward: ForwardConfig | None = None  # the reference's (rl_config.ref_forward_*); None: `forward`

    def old_logprobs(self) -> torch.Tensor:
        """The policy's log-probs before the update (the update computes its own when not given them)."""
        with record_function("actor_compute_log_prob"):
            return compute_logprobs(self.policy, self.samples, self.policy_forward or self.forward)[0].float().cpu()

    def reference_logprobs(self) -> torch.Tensor | None:
        """The reference model's log-probs; None without a reference model."""
        if self.reference is None:
            return None
        with torch.no_grad(), record_function("reference_compute_log_prob"):
            return compute_logprobs(self.reference, self.samples, self.reference_forward or self.forward)[0].float().cpu()


@dataclass(frozen=True)
class Estimate:
    """What an estimator gives the policy update, every tensor [B, L] over the response tokens."""

    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None  # the policy's before the update when the estimator needed them; the update reuses them
    ref_logprobs: torch.Tensor | None = None  # for the loss's KL term; None: no KL in the loss
    reward_kl: torch.Tensor | None = None  # the per-token KL the rewards were penalised by (use_kl_in_reward)
    values: torch.Tensor | None = None  # a critic's values before its update (gae)
    returns: torch.Tensor | None = None  # a critic's regression targets (gae)


@dataclass(frozen=True)
class EstimatorSetup:
    """What building an estimator may use: the config and the policy's starting point (a critic starts from it too)."""

    cfg: Config
    layout: ModelLayout
    hf_state: dict[str, torch.Tensor]
    dtype: torch.dtype
    total_steps: int  # optimizer steps of the run, for an LR schedule


class AdvantageEstimator(ABC):
    """One rl_config.adv_estimator. Adding one is a module with a subclass and a line in estimators.ESTIMATORS."""

    @abstractmethod
    def estimate(self, batch: EstimatorBatch, passes: LogProbPasses, kl_coef: float) -> Estimate:
        """The log-prob passes it needs (from `passes`), then the advantages; `kl_coef` is the KL controller's value."""

    def update(self, samples: ResponseBatch, estimate: Estimate, step: int) -> dict[str, float]:
        """After the policy's update: the update of the estimator's own models; their metrics, named with their prefix."""
        return {}

    def save(self, root: str | pathlib.Path, state: TrainState) -> None:
        """Saves the estimator's own models beside the policy's checkpoint under `root`."""

    def load(self, root: str | pathlib.Path, step: int) -> None:
        """Restores the estimator's own models saved with the policy's checkpoint of `step`."""
