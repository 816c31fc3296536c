"""The actor update: the policy loss of each micro-batch, in the update-epochs loop (update_epochs.py).

When one mini-batch covers the batch for one epoch the old policy is the current one, so the
old-logprob forward pass is skipped and the detached current log-probs stand in for it; the
log-probs of that step's own forward pass are then the policy's before the update, which the
caller gets back for its checks (train_rollout_logprob_diff) without a pass of its own.
A mixture-of-experts model's load-balancing loss is weighted per micro-batch as the policy loss
is (services.trainer.modeling.moe_aux_loss) and reported as `moe_aux_loss`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from services.trainer.algorithm.kl import kl_penalty
from services.trainer.modeling import moe_aux_loss
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, compute_logprobs, run_micro_batches
from services.trainer.algorithm.losses import PolicyLossConfig, policy_loss
from services.trainer.algorithm.rollout_correction import rollout_correction_metrics
from services.trainer.algorithm.update_epochs import reduce_totals, run_update_epochs
from services.trainer.modeling.data_parallel import sum_over_data_parallel
from services.trainer.modeling.optimizer import ModelOptimizer


@dataclass(frozen=True)
class UpdateConfig:
    """How one batch becomes optimizer steps (rl_config and megatron_training names)."""

    mini_batch_size: int  # samples per optimizer step
    epochs: int = 1
    shuffle_mini_batch: bool = False
    kl_penalty: str = "low_var_kl"
    seed: int = 1234
    forward: ForwardConfig = ForwardConfig()
    loss: PolicyLossConfig = PolicyLossConfig()
    old_forward: ForwardConfig | None = None  # the old log-prob pass when the update makes one (rl_config.actor_forward_*); None: `forward`

    @classmethod
    def from_config(cls, cfg) -> "UpdateConfig":
        rl, mt = cfg.rl_config, cfg.megatron_training
        kl_coef = 0.0 if rl.use_kl_in_reward else rl.init_kl_coef
        return cls(rl.mini_batch_size, rl.epochs, rl.shuffle_mini_batch, rl.kl_penalty, mt.seed,
                   ForwardConfig.from_config(cfg), PolicyLossConfig.from_rl_config(rl, kl_coef), ForwardConfig.from_config(cfg, "actor"))


@dataclass(frozen=True)
class TrainBatch:
    """What the update consumes; every tensor [B, L] over the response tokens of `samples`."""

    samples: ResponseBatch
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None  # None: computed here, or skipped when equal to the current policy
    ref_logprobs: torch.Tensor | None = None  # None: no KL term
    behaviour_logprobs: torch.Tensor | None = None  # the rollout's log-probs; the decoupled loss and the rollout correction weight by them


@dataclass(frozen=True)
class UpdateMetrics:
    """Means over the optimizer steps of one update call."""

    loss: float  # the objective minimised: pg_loss - entropy_coeff * entropy + kl_coef * kl
    pg_loss: float
    pg_clipfrac: float
    pg_clipfrac_lower: float
    ppo_kl: float
    entropy: float
    kl: float
    behav_clipfrac: float  # decoupled loss: share of tokens its behaviour-weight cap left out
    behav_imp_weight: float  # decoupled loss: mean pi_prox / pi_behaviour over the tokens kept (1 without it)
    grad_norm: float
    lr: float
    optimizer_steps: int
    old_logprob_pass: bool  # False when the pass was skipped (one mini-batch, one epoch)
    moe_aux_loss: float | None = None  # MoE: the routers' load-balancing loss (router_aux_loss_coef x its sum over layers), minimised beside `loss`; None: dense
    # The rollout-mismatch correction (rl_config.rollout_is / rollout_rs; None when off), over the whole batch, the policy before
    # the update against the rollout's log-probs; verl's rollout_corr names (rollout_correction_metrics)
    rollout_is_mean: float | None = None  # the IS weight's mean before truncation (rollout_is)
    rollout_is_max: float | None = None  # its max (rollout_is)
    rollout_rs_masked_fraction: float | None = None  # share of response tokens left out (rollout_rs)
    rollout_corr_k3_kl: float | None = None  # k3 estimate of KL(pi_rollout || pi_old) per token

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class UpdateResult:
    """What one update call gives back."""

    metrics: UpdateMetrics
    start_logprobs: torch.Tensor  # [B, L] (CPU) the policy's log-probs of `samples` before this update's first step


def needs_old_logprob_pass(num_samples: int, cfg: UpdateConfig) -> bool:
    """False when one mini-batch and one epoch: the old policy is the policy being updated."""
    return not (cfg.epochs == 1 and cfg.mini_batch_size >= num_samples)


LOSS_METRICS = ("loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl", "behav_clipfrac", "behav_imp_weight")


def update_policy(model, optimizer: ModelOptimizer, batch: TrainBatch, cfg: UpdateConfig, step: int = 0) -> UpdateResult:
    """Runs cfg.epochs passes of optimizer steps over `batch` (run_update_epochs); `step` seeds the shuffle reproducibly."""
    samples = batch.samples
    mask = samples.response_mask()
    old_pass = batch.old_logprobs is None and needs_old_logprob_pass(samples.size, cfg)
    old_logprobs = compute_logprobs(model, samples, cfg.old_forward or cfg.forward)[0] if old_pass else batch.old_logprobs
    # Without old log-probs there is one step over every sample: its forward pass fills these.
    start_logprobs = old_logprobs.float().cpu() if old_logprobs is not None else torch.zeros(samples.size, samples.max_response_length)
    model.train()
    moe = bool(model.config.num_moe_experts)
    if moe:
        moe_aux_loss.take(0.0)  # drop what other models' passes (the critic's) left in megatron's tracker
    # LOSS_METRICS, filled on the last pipeline stage, where losses are computed, then the MoE load-balancing loss
    loss_totals = torch.zeros(len(LOSS_METRICS) + 1)
    aux_total = torch.zeros(())  # this stage's MoE layers' part of the load-balancing loss, weighted as the losses are

    def mini_batch_pass(indexes: list[torch.Tensor], weights: list[float]) -> None:
        def micro_loss(i: int, logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            index = indexes[i]
            width = logp.size(1)
            part_mask = mask[index, :width].to(logp.device)
            old = old_logprobs[index, :width].to(logp.device) if old_logprobs is not None else logp.detach()
            kl = None
            if batch.ref_logprobs is not None and cfg.loss.kl_coef:
                kl = kl_penalty(logp, batch.ref_logprobs[index, :width].to(logp.device), cfg.kl_penalty)
            behaviour = batch.behaviour_logprobs[index, :width].to(logp.device) if batch.behaviour_logprobs is not None else None
            out = policy_loss(logp, old, batch.advantages[index, :width].to(logp.device), part_mask, cfg.loss,
                              entropy=entropy, kl=kl, behaviour_logprob=behaviour)
            loss_totals[:-1].add_(torch.stack([getattr(out, m).detach() for m in LOSS_METRICS]).cpu() * weights[i])
            return out.loss * weights[i] * optimizer.loss_scale

        def moe_stage_forward(i: int, output: torch.Tensor) -> None:
            aux_total.add_(moe_aux_loss.take(model.config.moe_aux_loss_coeff) * weights[i])
            moe_aux_loss.weigh_backward(output, weights[i] * optimizer.loss_scale)

        results = run_micro_batches(model, [samples.select(index) for index in indexes], cfg.forward.use_remove_padding,
                                    micro_loss, moe_stage_forward if moe else None)
        if old_logprobs is None:
            for index, (logp, _) in zip(indexes, results):
                start_logprobs[index, : logp.size(1)] = logp.float().cpu()

    steps = run_update_epochs(optimizer, samples, cfg, cfg.loss.token_level, step, mini_batch_pass)
    loss_totals[-1] = moe_aux_loss.sum_over_stages(aux_total) if moe else 0.0
    reduce_totals(loss_totals)
    if old_logprobs is None:
        sum_over_data_parallel(start_logprobs)  # each rank filled its own rows
    means = dict(zip(LOSS_METRICS, (loss_totals[:-1] / steps.steps).tolist()))
    metrics = UpdateMetrics(**means, grad_norm=steps.grad_norm, lr=steps.lr, optimizer_steps=steps.steps, old_logprob_pass=old_pass,
                            moe_aux_loss=float(loss_totals[-1]) / steps.steps if moe else None,
                            **(rollout_correction_metrics(start_logprobs, batch.behaviour_logprobs, mask, cfg.loss.rollout)
                               if cfg.loss.rollout.enabled and batch.behaviour_logprobs is not None else {}))
    return UpdateResult(metrics, start_logprobs)
