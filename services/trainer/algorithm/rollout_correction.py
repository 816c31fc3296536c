"""The rollout/training mismatch correction (rl_config.rollout_is, rollout_rs; verl's rollout_corr_helper.py).

The rollout engine's log-probs (pi_rollout, in every row of the batch) and the trainer's for the same weights (pi_old,
the policy before the update) differ where the engine runs other kernels or a lower precision (bf16 on GPUs); the
gradient is then off-policy by rho_t = pi_old(y_t) / pi_rollout(y_t). Two corrections, each per token of the policy
loss, both constants (no gradient):

- truncated importance sampling (TIS, rollout_is): the term is weighted by min(rho, rollout_is_threshold), with rho the
  token's ratio (`token`) or its sequence's product of ratios (`sequence`), as verl's compute_rollout_correction_weights.
- masked importance sampling (MIS, rollout_rs): the term is left out where the ratio is outside [lower, upper]: the
  token's ratio (`token_k1`; IcePop is this with [0.5, 2]), its sequence's product (`seq_sum_k1`) or the geometric mean
  of its sequence's token ratios (`seq_mean_k1`), verl's compute_rollout_rejection_mask options of those names (verl
  states them as a bound on k1 = -log rho; here as bounds on rho). Left-out tokens keep their place in the loss's
  denominator (as behav_imp_weight_cap's do; verl drops them from the mask): micro-batch weights stay those of the
  response tokens, so the accumulated gradient stays exact.

With both, the weight and the mask multiply. Off by default: on CPU in fp32 the engine and the trainer agree to below
1e-3 per token, so every weight is 1 and nothing is masked; on GPUs in bf16 they differ and it should be on
(docs/trainer.md). It is refused with use_decoupled_loss, which already weights each token by pi_prox / pi_rollout,
the same ratio: the two together would apply it twice (checks.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.trainer.algorithm.masked import masked_mean

SAFETY_BOUND = 20.0  # |log rho| is clamped here before exp, as verl's SAFETY_BOUND
ROLLOUT_IS_LEVELS = ("token", "sequence")  # rl_config.rollout_is
ROLLOUT_RS_OPTIONS = ("token_k1", "seq_sum_k1", "seq_mean_k1")  # rl_config.rollout_rs


@dataclass(frozen=True)
class RolloutCorrection:
    """The rl_config keys of the correction; empty `is_level` and `rs`: off."""

    is_level: str = ""  # rollout_is: "" | token | sequence
    is_threshold: float = 2.0  # rollout_is_threshold: the cap on the weight
    rs: str = ""  # rollout_rs: "" | token_k1 | seq_sum_k1 | seq_mean_k1
    rs_threshold: float = 2.0  # rollout_rs_threshold: the upper bound on the ratio
    rs_threshold_lower: float = 0.0  # rollout_rs_threshold_lower: the lower bound; 0: 1 / rs_threshold

    @classmethod
    def from_rl_config(cls, rl) -> "RolloutCorrection":
        return cls(rl.rollout_is, rl.rollout_is_threshold, rl.rollout_rs, rl.rollout_rs_threshold, rl.rollout_rs_threshold_lower)

    @property
    def enabled(self) -> bool:
        return bool(self.is_level or self.rs)

    @property
    def rs_bounds(self) -> tuple[float, float]:
        return (self.rs_threshold_lower or 1.0 / self.rs_threshold), self.rs_threshold


def needs_rollout_logprobs(rl) -> bool:
    """Whether the update reads the rollout's log-probs (rl_config): the decoupled loss or this correction."""
    return bool(rl.use_decoupled_loss or rl.rollout_is or rl.rollout_rs)


def _log_ratio(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi_old - log pi_rollout per token, 0 off the mask (padding holds no log-prob worth comparing)."""
    return torch.where(mask > 0, old_logprob - rollout_logprob, torch.zeros_like(old_logprob)).detach()


def _is_weight(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The untruncated IS weight per token [B, L]: exp of the token's log-ratio, or of its sequence's sum; 0 off the mask."""
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        log_w = (log_ratio * mask).sum(dim=-1, keepdim=True).expand_as(log_ratio)
    else:
        raise ValueError(f"rl_config.rollout_is: {level!r} is not one of {', '.join(ROLLOUT_IS_LEVELS)}")
    return log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * mask


def _rs_keep(log_ratio: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrection) -> torch.Tensor:
    """1 where the token (or its whole sequence) is kept, 0 where its ratio is outside the bounds; [B, L]."""
    if cfg.rs == "token_k1":
        stat = log_ratio
    elif cfg.rs == "seq_sum_k1":
        stat = (log_ratio * mask).sum(dim=-1, keepdim=True)
    elif cfg.rs == "seq_mean_k1":
        stat = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)
    else:
        raise ValueError(f"rl_config.rollout_rs: {cfg.rs!r} is not one of {', '.join(ROLLOUT_RS_OPTIONS)}")
    lower, upper = cfg.rs_bounds
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    return keep.expand_as(log_ratio).to(log_ratio.dtype)


def rollout_correction_factor(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                              cfg: RolloutCorrection) -> torch.Tensor:
    """The factor [B, L] each token's policy-loss term is multiplied by: min(rho, cap) under rollout_is, times the keep
    mask under rollout_rs; 1 where neither is set. A constant (no gradient)."""
    log_ratio = _log_ratio(old_logprob, rollout_logprob, mask)
    factor = torch.ones_like(log_ratio)
    if cfg.is_level:
        factor = _is_weight(log_ratio, mask, cfg.is_level).clamp(max=cfg.is_threshold)
    if cfg.rs:
        factor = factor * _rs_keep(log_ratio, mask, cfg)
    return factor


def rollout_correction_metrics(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                               cfg: RolloutCorrection) -> dict[str, float]:
    """The step's metrics over the whole batch, named as verl's rollout_corr metrics: rollout_is_mean and rollout_is_max (the
    weight before truncation, over the response tokens), rollout_rs_masked_fraction (share of response tokens left out),
    rollout_corr_k3_kl (verl's rollout_corr/k3_kl: mean of rho - log rho - 1, the k3 estimate of KL(pi_rollout || pi_old))."""
    mask = mask.float()
    log_ratio = _log_ratio(old_logprob.float(), rollout_logprob.float(), mask)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics = {"rollout_corr_k3_kl": float(masked_mean(safe.exp() - safe - 1, mask))}
    if cfg.is_level:
        weight = _is_weight(log_ratio, mask, cfg.is_level)
        metrics["rollout_is_mean"] = float(masked_mean(weight, mask))
        metrics["rollout_is_max"] = float(weight.masked_fill(mask == 0, float("-inf")).max()) if mask.any() else 0.0
    if cfg.rs:
        metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - _rs_keep(log_ratio, mask, cfg), mask))
    return metrics
