"""The actor update: mini-batches over epochs, micro-batch gradient accumulation, clipping, AdamW.

Mirrors MindSpeed-RL's actor update: the batch is split into mini-batches (one optimizer step
each, optionally shuffled per epoch); each mini-batch is run in micro-batches whose losses are
weighted so the accumulated gradient equals the gradient of the whole mini-batch's loss.
When one mini-batch covers the batch for one epoch the old policy is the current one, so the
old-logprob forward pass is skipped and the detached current log-probs stand in for it; the
log-probs of that step's own forward pass are then the policy's before the update, which the
caller gets back for its checks (train_rollout_logprob_diff) without a pass of its own.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from services.trainer.algorithm.kl import kl_penalty
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, compute_logprobs, micro_batches, run_micro_batches
from services.trainer.algorithm.losses import PolicyLossConfig, policy_loss
from services.trainer.modeling.model import compute_device


LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class UpdateConfig:
    """How one batch becomes optimizer steps (rl_config and megatron_training names)."""

    mini_batch_size: int  # samples per optimizer step
    epochs: int = 1
    shuffle_mini_batch: bool = False
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    kl_penalty: str = "low_var_kl"
    seed: int = 1234
    forward: ForwardConfig = ForwardConfig()
    loss: PolicyLossConfig = PolicyLossConfig()

    @classmethod
    def from_config(cls, cfg) -> "UpdateConfig":
        rl, mt = cfg.rl_config, cfg.megatron_training
        kl_coef = 0.0 if rl.use_kl_in_reward else rl.init_kl_coef
        return cls(rl.mini_batch_size, rl.epochs, rl.shuffle_mini_batch, mt.clip_grad, rl.kl_penalty, mt.seed,
                   ForwardConfig.from_config(cfg), PolicyLossConfig.from_rl_config(rl, kl_coef))


@dataclass(frozen=True)
class TrainBatch:
    """What the update consumes; every tensor [B, L] over the response tokens of `samples`."""

    samples: ResponseBatch
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None  # None: computed here, or skipped when equal to the current policy
    ref_logprobs: torch.Tensor | None = None  # None: no KL term
    behaviour_logprobs: torch.Tensor | None = None  # the rollout's log-probs; the decoupled loss weights by them


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

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class UpdateResult:
    """What one update call gives back."""

    metrics: UpdateMetrics
    start_logprobs: torch.Tensor  # [B, L] (CPU) the policy's log-probs of `samples` before this update's first step


def build_optimizer(model, mt, total_steps: int):
    """AdamW over the model's parameters and megatron's OptimizerParamScheduler (warmup, then constant/linear/cosine).

    `mt` is the megatron_training section; `total_steps` the optimizer steps of the whole run.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if mt.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"megatron_training.lr_decay_style: {mt.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=mt.lr, betas=(mt.adam_beta1, mt.adam_beta2), eps=mt.adam_eps,
                                  weight_decay=mt.weight_decay)
    total_steps = max(1, total_steps)
    warmup = min(int(mt.lr_warmup_fraction * total_steps), total_steps - 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else mt.lr, max_lr=mt.lr, min_lr=mt.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=total_steps, lr_decay_style=mt.lr_decay_style, start_wd=mt.weight_decay, end_wd=mt.weight_decay,
        wd_incr_steps=total_steps, wd_incr_style="constant",
    )
    return optimizer, scheduler


def needs_old_logprob_pass(num_samples: int, cfg: UpdateConfig) -> bool:
    """False when one mini-batch and one epoch: the old policy is the policy being updated."""
    return not (cfg.epochs == 1 and cfg.mini_batch_size >= num_samples)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the gradients over TP shards and PP stages, each tensor counted once; scales them to max_norm.

    TP-replicated tensors count on one TP rank; a tied embedding's copy on the last stage
    (megatron marks it `shared`) does not count.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
            squares += p.grad.float().square().sum()
    model_parallel = parallel_state.get_tensor_model_parallel_world_size() * parallel_state.get_pipeline_model_parallel_world_size()
    if model_parallel > 1:
        torch.distributed.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    total = math.sqrt(squares.item())
    if max_norm > 0 and total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total


def _finalize_grads(model, params: list[torch.nn.Parameter]) -> None:
    """Averages gradients over data-parallel replicas; sums a tied embedding's two copies' gradients across stages."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1:
        group = parallel_state.get_data_parallel_group()
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=group)
                p.grad.div_(dp)
    shared = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if (parallel_state.get_pipeline_model_parallel_world_size() > 1 and shared is not None
            and parallel_state.is_rank_in_embedding_group() and shared.grad is not None):
        torch.distributed.all_reduce(shared.grad, group=parallel_state.get_embedding_group())


def optimizer_step(model, optimizer, scheduler, params: list[torch.nn.Parameter], clip_grad: float) -> tuple[float, float]:
    """One step on the accumulated gradients: replica/tied-copy reduction, clipping, AdamW, scheduler; (grad norm, lr used)."""
    _finalize_grads(model, params)
    grad_norm = clip_grad_norm(params, clip_grad)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step(1)
    return grad_norm, lr


def mini_batch_order(num_samples: int, mini_batch_size: int, shuffle: bool, seed: int, epoch: int, step: int) -> list[torch.Tensor]:
    """Sample indexes of each mini-batch of one epoch: in order, or shuffled reproducibly from (seed, step, epoch)."""
    if shuffle:
        gen = torch.Generator().manual_seed(seed + 1_000_003 * step + epoch)
        order = torch.randperm(num_samples, generator=gen)
    else:
        order = torch.arange(num_samples)
    return list(order.split(mini_batch_size))


LOSS_METRICS = ("loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl", "behav_clipfrac", "behav_imp_weight")


def update_policy(model, optimizer, scheduler, batch: TrainBatch, cfg: UpdateConfig, step: int = 0) -> UpdateResult:
    """Runs cfg.epochs passes of optimizer steps over `batch`; `step` seeds the shuffle reproducibly."""
    samples = batch.samples
    mask = samples.response_mask()
    old_pass = batch.old_logprobs is None and needs_old_logprob_pass(samples.size, cfg)
    old_logprobs = compute_logprobs(model, samples, cfg.forward)[0] if old_pass else batch.old_logprobs
    # Without old log-probs there is one step over every sample: its forward pass fills these.
    start_logprobs = old_logprobs.float().cpu() if old_logprobs is not None else torch.zeros(samples.size, samples.max_response_length)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    loss_totals = torch.zeros(len(LOSS_METRICS))  # filled on the last pipeline stage, where losses are computed
    grad_norm = lr = 0.0
    steps = 0
    for epoch in range(cfg.epochs):
        for mini in mini_batch_order(samples.size, cfg.mini_batch_size, cfg.shuffle_mini_batch, cfg.seed, epoch, step):
            optimizer.zero_grad(set_to_none=True)
            mini_tokens = mask[mini].sum()
            indexes = [mini[micro] for micro in micro_batches(samples.select(mini), cfg.forward)]

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
                # Weights make the accumulated gradient that of the mini-batch's token or sequence mean.
                weight = part_mask.sum().cpu() / mini_tokens if cfg.loss.token_level_loss else len(index) / len(mini)
                loss_totals.add_(torch.stack([getattr(out, m).detach() for m in LOSS_METRICS]).cpu() * float(weight))
                return out.loss * weight

            results = run_micro_batches(model, [samples.select(index) for index in indexes], cfg.forward.use_remove_padding, micro_loss)
            if old_logprobs is None:
                for index, (logp, _) in zip(indexes, results):
                    start_logprobs[index, : logp.size(1)] = logp.float().cpu()
            step_grad_norm, step_lr = optimizer_step(model, optimizer, scheduler, params, cfg.clip_grad)
            grad_norm += step_grad_norm
            lr += step_lr
            steps += 1
    broadcast_from_last_stage(loss_totals)
    means = dict(zip(LOSS_METRICS, (loss_totals / steps).tolist()))
    metrics = UpdateMetrics(**means, grad_norm=grad_norm / steps, lr=lr / steps, optimizer_steps=steps, old_logprob_pass=old_pass)
    return UpdateResult(metrics, start_logprobs)


def broadcast_from_last_stage(values: torch.Tensor) -> None:
    """Overwrites `values` (CPU) on every pipeline stage with the last stage's, where the losses are computed."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        device_values = values.to(compute_device())
        torch.distributed.broadcast(device_values, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
        values.copy_(device_values.cpu())
