"""KL estimators between the current and reference policy per token, clamped as MindSpeed-RL clamps."""
from __future__ import annotations

from dataclasses import dataclass

import torch

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOW_VAR_KL_LOG_RATIO_BOUND = 20.0  # exp() of more overflows in fp32
LOW_VAR_KL_BOUND = 10.0


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of pi vs pi_ref from log-probs [B, L] -> [B, L].

    kl/k1: logp - logp_ref; abs: |logp - logp_ref|; mse/k2: 0.5 (logp - logp_ref)^2;
    low_var_kl/k3: exp(r) - r - 1 with r = logp_ref - logp clamped to [-20, 20], result to [-10, 10].
    """
    diff = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = (-diff).clamp(-LOW_VAR_KL_LOG_RATIO_BOUND, LOW_VAR_KL_LOG_RATIO_BOUND)
        kld = log_ratio.exp() - log_ratio - 1
        return kld.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    raise ValueError(f"rl_config.kl_penalty: {kind!r} is not one of {', '.join(KL_PENALTIES)}")


ADAPTIVE_KL_STEP_BOUND = 0.2  # the proportional error is clipped to +-20%, as in Ziegler et al. and verl


@dataclass
class KLController:
    """The KL coefficient (rl_config.init_kl_coef), fixed or adaptive (kl_ctrl_type).

    Adaptive is Ziegler et al.'s controller as verl and MindSpeed-RL run it: after a step whose
    mean KL per token was `kl` over `samples` samples, the coefficient is multiplied by
    1 + clip(kl / kl_target - 1, -0.2, 0.2) * samples / kl_horizon, so a KL over the target
    raises it and one under lowers it, by at most 20% per kl_horizon samples.
    """

    value: float
    target: float = 0.0  # 0: fixed
    horizon: int = 1

    @classmethod
    def from_rl_config(cls, rl) -> "KLController":
        if rl.kl_ctrl_type == "adaptive":
            return cls(rl.init_kl_coef, rl.kl_target, rl.kl_horizon)
        return cls(rl.init_kl_coef)

    def update(self, kl: float, samples: int) -> None:
        """Moves the coefficient after a step (nothing when fixed)."""
        if not self.target:
            return
        error = min(max(kl / self.target - 1.0, -ADAPTIVE_KL_STEP_BOUND), ADAPTIVE_KL_STEP_BOUND)
        self.value *= 1.0 + error * samples / self.horizon
