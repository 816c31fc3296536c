"""KL estimators between the current and reference policy per token, clamped as MindSpeed-RL clamps."""
from __future__ import annotations

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
