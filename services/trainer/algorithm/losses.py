"""Policy and value losses: PPO clip, DAPO clip-higher, dual-clip, GSPO's sequence-level ratio, AReaL's decoupled objective,
the rollout-mismatch correction (rollout_correction.py), entropy bonus, clipped critic loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.config import LOSS_AGG_MODES
from services.trainer.algorithm.masked import masked_mean
from services.trainer.algorithm.rollout_correction import RolloutCorrection, rollout_correction_factor


LOG_RATIO_LIMIT = 20.0
GSPO_LOG_RATIO_MAX = 10.0  # verl's compute_policy_loss_gspo clamps the sequence log-ratio here before exp
POLICY_LOSS_MODES = ("vanilla", "gspo")  # rl_config.policy_loss_mode, verl's policy_loss.loss_mode names


@dataclass(frozen=True)
class PolicyLossConfig:
    """The knobs of the clipped policy loss (rl_config names)."""

    clip_ratio_low: float = 0.2  # ratio floor 1 - low; equals clip_ratio unless clip-higher
    clip_ratio_high: float = 0.2  # ratio ceiling 1 + high; DAPO raises it (0.28)
    clip_ratio_c: float = 3.0  # dual-clip bound on the loss for negative advantages
    agg: str = "token-mean"  # one of LOSS_AGG_MODES: how per-token terms become the loss
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0  # KL-in-loss coefficient (0: no KL term)
    decoupled: bool = False  # weight each token by pi_prox / pi_behaviour (AReaL's decoupled PPO)
    behav_imp_weight_cap: float = 0.0  # tokens whose weight exceeds it are left out (0: no cap)
    mode: str = "vanilla"  # one of POLICY_LOSS_MODES (rl_config.policy_loss_mode)
    rollout: RolloutCorrection = RolloutCorrection()  # the rollout-mismatch correction (off by default)

    @classmethod
    def from_rl_config(cls, rl, kl_coef: float) -> "PolicyLossConfig":
        """clip_ratio for both bounds unless clip_higher_enable, as MindSpeed-RL reads it; GSPO aggregates seq-mean-token-mean
        whatever token_level_loss says (verl's compute_policy_loss_gspo; the config check refuses another loss_agg_mode)."""
        low, high = (rl.clip_ratio_low, rl.clip_ratio_high) if rl.clip_higher_enable else (rl.clip_ratio, rl.clip_ratio)
        agg = rl.loss_agg_mode or ("token-mean" if rl.token_level_loss else "seq-mean-token-mean")
        if rl.policy_loss_mode == "gspo":
            agg = "seq-mean-token-mean"
        return cls(low, high, rl.clip_ratio_c, agg, rl.entropy_coeff, kl_coef, rl.use_decoupled_loss, rl.behav_imp_weight_cap,
                   rl.policy_loss_mode, RolloutCorrection.from_rl_config(rl))

    @property
    def token_level(self) -> bool:
        """Whether the loss is a mean over tokens (micro-batches then weigh by tokens, else by sequences)."""
        return self.aggregation == "token-mean"

    @property
    def aggregation(self) -> str:
        """The loss_agg_mode the loss uses: GSPO's is seq-mean-token-mean whatever `agg` says (verl's compute_policy_loss_gspo)."""
        return "seq-mean-token-mean" if self.mode == "gspo" else self.agg


@dataclass(frozen=True)
class PolicyLoss:
    """A loss to backpropagate and its metrics (scalars)."""

    loss: torch.Tensor
    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    pg_clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor
    behav_clipfrac: torch.Tensor  # share of tokens the behaviour-weight cap left out (decoupled loss)
    behav_imp_weight: torch.Tensor  # mean behaviour importance weight over the tokens kept


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[B, L] per-token values -> one: token-mean, the mean over all response tokens (DAPO);
    seq-mean-token-mean, the mean over sequences of per-sequence means (GRPO's paper);
    seq-mean-token-sum, the mean over sequences of per-sequence sums (Dr. GRPO's, verl's name)."""
    if mode == "token-mean":
        return masked_mean(values, mask)
    if mode == "seq-mean-token-mean":
        return masked_mean(values, mask, dim=-1).mean()
    if mode == "seq-mean-token-sum":
        return (values * mask).sum(dim=-1).mean()
    raise ValueError(f"rl_config.loss_agg_mode: {mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")


def policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: PolicyLossConfig, entropy: torch.Tensor | None = None,
                kl: torch.Tensor | None = None, behaviour_logprob: torch.Tensor | None = None) -> PolicyLoss:
    """Clipped surrogate loss with dual-clip, plus -entropy_coeff * entropy and + kl_coef * kl.

    All tensors [B, L]; `kl` is a per-token estimate (services.trainer.algorithm.kl). pg_clipfrac is the
    fraction of tokens where the clipped term is the one taken; pg_clipfrac_lower the fraction
    with negative advantage where the dual-clip bound is taken.

    With cfg.decoupled, `old_logprob` is the proximal policy (the policy before this update) and
    `behaviour_logprob` the policy that generated the tokens (the rollout's log-probs): the ratio is
    clipped against the proximal policy and each token's term is weighted by the behaviour
    importance weight pi_prox / pi_behaviour, a constant; tokens whose weight exceeds
    cfg.behav_imp_weight_cap are left out of the loss (they keep their place in its denominator).

    With cfg.mode gspo the ratio is GSPO's sequence-level one (_gspo_terms). With cfg.rollout enabled (not with the
    decoupled loss: the config refuses both), each token's term is multiplied by the rollout-mismatch factor of
    `old_logprob` against `behaviour_logprob` (rollout_correction.py): the truncated IS weight and / or the rejection
    mask; rejected tokens keep their place in the denominator, as the decoupled cap's.
    """
    # Clamped before exp: a log-ratio far out (a garbage log-prob, a token the policy has left) would give
    # inf, and inf times a zero advantage a NaN loss; 20 keeps the ratio finite and well past any clip.
    log_ratio = (logprob - old_logprob).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ppo_kl = masked_mean(-log_ratio, mask)
    if cfg.mode == "gspo":
        per_token, pg_clipfrac, pg_clipfrac_lower = _gspo_terms(logprob, log_ratio, advantages, mask, cfg)
    elif cfg.mode == "vanilla":
        per_token, pg_clipfrac, pg_clipfrac_lower = _clip_terms(log_ratio.exp(), advantages, mask, cfg)
    else:
        raise ValueError(f"rl_config.policy_loss_mode: {cfg.mode!r} is not one of {', '.join(POLICY_LOSS_MODES)}")
    zero = per_token.new_zeros(())
    behav_clipfrac, behav_weight_mean = zero, per_token.new_ones(())
    if cfg.decoupled:
        if behaviour_logprob is None:
            raise ValueError("rl_config.use_decoupled_loss: the batch has no rollout (behaviour) log-probs")
        # exp of 0 off the mask: padding positions hold no log-prob worth exponentiating
        weight = torch.where(mask > 0, old_logprob - behaviour_logprob, torch.zeros_like(old_logprob)).detach().exp()
        kept = torch.ones_like(weight, dtype=torch.bool) if not cfg.behav_imp_weight_cap else weight <= cfg.behav_imp_weight_cap
        behav_clipfrac = masked_mean((~kept).float(), mask)
        kept_mask = mask * kept
        behav_weight_mean = masked_mean(weight, kept_mask) if kept_mask.sum() > 0 else zero
        per_token = per_token * torch.where(kept, weight, torch.zeros_like(weight))
    if cfg.rollout.enabled:
        if behaviour_logprob is None:
            raise ValueError("rl_config.rollout_is / rollout_rs: the batch has no rollout log-probs")
        per_token = per_token * rollout_correction_factor(old_logprob, behaviour_logprob, mask, cfg.rollout)
    pg_loss = aggregate(per_token, mask, cfg.aggregation)
    ent = aggregate(entropy, mask, cfg.aggregation) if entropy is not None else zero
    kl_mean = aggregate(kl, mask, cfg.aggregation) if kl is not None else zero
    loss = pg_loss - cfg.entropy_coeff * ent + cfg.kl_coef * kl_mean
    return PolicyLoss(loss, pg_loss.detach(), pg_clipfrac, pg_clipfrac_lower, ppo_kl.detach(), ent.detach(), kl_mean.detach(),
                      behav_clipfrac, behav_weight_mean)


def _clip_terms(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token with dual-clip for negative advantages; (terms, pg_clipfrac, pg_clipfrac_lower)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    clip_max = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean((clipped > unclipped).float(), mask)
    dual_bound = -advantages * cfg.clip_ratio_c
    dual = torch.minimum(dual_bound, clip_max)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(((clip_max > dual_bound) & negative).float(), mask)
    return torch.where(negative, dual, clip_max), pg_clipfrac, pg_clipfrac_lower


def _gspo_terms(logprob: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025), as verl's compute_policy_loss_gspo: the sequence ratio s_i = exp(mean over the response of
    log pi / pi_old), in the paper's token-level gradient form s_i,t = sg[s_i] * pi_t / sg[pi_t] (its value s_i, its
    gradient s_i * grad log pi_t), log clamped at 10, clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; no dual-clip
    (verl's GSPO has none), so pg_clipfrac_lower is 0. The caller aggregates seq-mean-token-mean."""
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).detach().unsqueeze(-1)  # padding never counts in |y_i|
    # 0 off the mask: a padding position's log-prob may be -inf, and -inf - -inf is NaN
    grad_only = torch.where(mask > 0, logprob - logprob.detach(), torch.zeros_like(logprob))
    log_s = (grad_only + seq_log_ratio).clamp(max=GSPO_LOG_RATIO_MAX)
    ratio = log_s.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    pg_clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return torch.maximum(unclipped, clipped), pg_clipfrac, pg_clipfrac.new_zeros(())


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic loss 0.5 * mean(max((v - R)^2, (clip(v, v_old +- c) - R)^2)); returns (loss, clip fraction)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, clipfrac
