"""The PPO critic: the actor's GPTModel with its LM head swapped for a value head, its values and its update.

The critic is built like the actor (same layout, TP x PP) and initialised from the same HF
checkpoint, the usual PPO choice without a reward-model checkpoint. On the last pipeline stage
the vocabulary projection is replaced by a `ValueHead` (hidden -> 1, replicated on TP ranks), so
GPTModel's own final norm, forward and pipeline hand-offs stay as they are and its output is
[b, S, 1]. The value of response token t is read at the position that predicts it (prompt
length - 1 + t), as verl and MindSpeed-RL read it. Checkpoints are checkpoint.py's, under
`{save}/critic`.
"""
from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from services.trainer.modeling.checkpoint import TrainState, load_checkpoint, save_checkpoint
from services.trainer.modeling.logprobs import (ForwardConfig, ModelInputs, ResponseBatch, micro_batches, model_inputs,
                                                positions_predicting_responses)
from services.trainer.algorithm.losses import value_loss
from services.trainer.algorithm.masked import masked_mean
from services.trainer.modeling.model import ModelLayout, build_model, compute_device, model_chunks
from services.trainer.algorithm.update_epochs import reduce_totals, run_update_epochs
from services.trainer.modeling.data_parallel import my_rows, sum_over_data_parallel
from services.trainer.modeling.optimizer import ModelOptimizer, build_optimizer

VALUE_HEAD_INIT_STD = 0.02  # HF's initializer_range for the score head of a token-classification model
CRITIC_CHECKPOINT_DIR = "critic"


class ValueHead(torch.nn.Linear):
    """hidden -> 1 with a bias, in GPTModel's output_layer call shape: (hidden [S, b, H], weight=...) -> (values, None).

    Replicated on TP ranks: it is initialised from a fixed seed, so every rank starts equal, and
    its gradient (from the full hidden states every rank holds) is the same on each.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, seed: int):
        super().__init__(hidden_size, 1, bias=True, dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * VALUE_HEAD_INIT_STD)
            self.bias.zero_()

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        # GPTModel passes `weight` only to a tied LM head; build_critic unties, so it is None here.
        return super().forward(hidden_states), None


def build_critic(layout: ModelLayout, hf_state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32, seed: int = 1234,
                 cp_algo: str = "megatron_cp_algo", routing_replay: bool = False):
    """This rank's critic shard: build_model(layout) loaded from `hf_state`, the last stage's LM head replaced by a ValueHead
    (under a virtual pipeline: its last chunk's; with context parallel, its attention exchanges sequence shares by
    `cp_algo`, as the actor's).

    init_parallel first. An untied layout allocates its vocabulary head for the load and frees it
    at the swap; a tied layout's embedding stays an input embedding only.
    """
    from megatron.core import parallel_state

    from services.trainer.modeling.checkpoint_convert import load_hf_into_model

    model = build_model(layout, dtype, cp_algo, routing_replay)
    load_hf_into_model(model, hf_state, layout)
    chunks = model_chunks(model)
    if parallel_state.is_pipeline_last_stage():
        chunks[-1].output_layer = ValueHead(layout.hidden_size, dtype, seed).to(compute_device())
    # No LM head is left to tie: GPTModel then passes no embedding weight to the head, and no
    # cross-stage embedding gradient sum is run.
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights = False
    return model


def build_critic_optimizer(critic, mt, total_steps: int) -> ModelOptimizer:
    """The actor's optimizer and LR schedule (build_optimizer) at megatron_training.critic_lr (its lr when 0)."""
    return build_optimizer(critic, dataclasses.replace(mt, lr=mt.critic_lr or mt.lr), total_steps)


def response_values(output: torch.Tensor, batch: ResponseBatch, inputs: ModelInputs) -> torch.Tensor:
    """From the last stage's output [b, S, 1] (or [1, T, 1] packed): values [b, L] of the responses in fp32, 0 past each.

    Under context parallel the output holds this CP rank's positions only: every rank's are gathered in order first
    (with a backward that keeps this rank's share, as for the actor's log-probs), so each CP rank has every value.
    """
    device = output.device
    rows, cols = positions_predicting_responses(batch, inputs.starts)
    offsets = torch.cat([torch.arange(r) for r in batch.response_lengths.tolist()])
    if inputs.cp_index is not None:
        from services.trainer.modeling.context_parallel import gather_sequence

        output = gather_sequence(output.view(output.size(0), -1, 1).transpose(0, 1), inputs.cp_index).transpose(0, 1)
    picked = output.reshape(-1)[cols.to(device)].float()
    return torch.zeros(batch.size, batch.max_response_length, device=device).index_put((rows.to(device), offsets.to(device)), picked)


def _values_as_stats(output: torch.Tensor, batch: ResponseBatch, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
    # The pipeline schedule carries (log-probs, entropy) pairs; the critic has one tensor, so the second is empty.
    values = response_values(output, batch, inputs)
    return values, torch.zeros_like(values)


# The value loss of micro-batch i from its values [b, L]; its backward runs inside run_critic_micro_batches.
ValueMicroBatchLoss = Callable[[int, torch.Tensor], torch.Tensor]


def run_critic_micro_batches(critic, parts: list[ResponseBatch], packed: bool,
                             loss_fn: ValueMicroBatchLoss | None = None) -> list[torch.Tensor]:
    """Forward (and, with `loss_fn`, backward) over micro-batches; every rank gets each part's values [b, L], detached."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        from services.trainer.modeling.pipeline import pipelined_micro_batches

        stage_loss = None if loss_fn is None else (lambda i, values, _unused: loss_fn(i, values))
        results = pipelined_micro_batches(critic, parts, [model_inputs(p, packed) for p in parts], _values_as_stats, stage_loss)
        return [values for values, _ in results]
    out = []
    for i, part in enumerate(parts):
        inputs = model_inputs(part, packed)
        values = response_values(inputs.run(critic), part, inputs)
        if loss_fn is not None:
            loss_fn(i, values).backward()
        out.append(values.detach())
    return out


@torch.no_grad()
def compute_values(critic, batch: ResponseBatch, cfg: ForwardConfig) -> torch.Tensor:
    """Values [B, L] (fp32, CPU) at the positions predicting each response token; 0 past each response."""
    was_training = critic.training
    critic.eval()
    values = torch.zeros(batch.size, batch.max_response_length)
    mine = my_rows(torch.arange(batch.size))  # this data-parallel rank's rows; the others' come from theirs
    if len(mine):
        indexes = [mine[index] for index in micro_batches(batch.select(mine), cfg)]
        parts = [batch.select(index) for index in indexes]
        for index, part, part_values in zip(indexes, parts, run_critic_micro_batches(critic, parts, cfg.use_remove_padding)):
            values[index, : part.max_response_length] = part_values.cpu()
    critic.train(was_training)
    return sum_over_data_parallel(values)


@dataclass(frozen=True)
class CriticUpdateConfig:
    """How one batch becomes critic optimizer steps (rl_config and megatron_training names, shared with the actor)."""

    mini_batch_size: int  # samples per optimizer step
    epochs: int = 1
    shuffle_mini_batch: bool = False
    cliprange_value: float = 0.5  # new values kept within old +- this in the clipped loss term
    seed: int = 1234
    forward: ForwardConfig = ForwardConfig()

    @classmethod
    def from_config(cls, cfg) -> "CriticUpdateConfig":
        rl, mt = cfg.rl_config, cfg.megatron_training
        return cls(rl.mini_batch_size, rl.epochs, rl.shuffle_mini_batch, rl.cliprange_value, mt.seed,
                   ForwardConfig.from_config(cfg))


@dataclass(frozen=True)
class CriticMetrics:
    """Means over the optimizer steps of one critic_update call."""

    vf_loss: float
    vf_clipfrac: float
    values_mean: float  # mean predicted value over response tokens, before each step
    grad_norm: float
    lr: float
    optimizer_steps: int

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


VALUE_METRICS = ("vf_loss", "vf_clipfrac", "values_mean")


def critic_update(critic, optimizer: ModelOptimizer, batch: ResponseBatch, old_values: torch.Tensor, returns: torch.Tensor,
                  cfg: CriticUpdateConfig, step: int = 0) -> CriticMetrics:
    """cfg.epochs passes of mini-batch steps regressing the values on `returns` with the clipped value loss (run_update_epochs).

    old_values, returns [B, L] (compute_values before the update; ppo_targets' returns). Micro-batch
    losses are weighted by their token share, so each step's gradient is that of its mini-batch's
    token mean. `step` seeds the shuffle reproducibly.
    """
    mask = batch.response_mask()
    critic.train()
    totals = torch.zeros(len(VALUE_METRICS))  # filled on the last pipeline stage, where the loss is computed

    def mini_batch_pass(indexes: list[torch.Tensor], weights: list[float]) -> None:
        def micro_loss(i: int, values: torch.Tensor) -> torch.Tensor:
            index = indexes[i]
            width = values.size(1)
            part_mask = mask[index, :width].to(values.device)
            loss, clipfrac = value_loss(values, old_values[index, :width].to(values.device),
                                        returns[index, :width].to(values.device), part_mask, cfg.cliprange_value)
            parts = [loss.detach(), clipfrac, masked_mean(values.detach(), part_mask)]
            totals.add_(torch.tensor([float(v) for v in parts]) * weights[i])
            return loss * weights[i] * optimizer.loss_scale

        run_critic_micro_batches(critic, [batch.select(index) for index in indexes], cfg.forward.use_remove_padding, micro_loss)

    steps = run_update_epochs(optimizer, batch, cfg, True, step, mini_batch_pass)
    reduce_totals(totals)
    means = dict(zip(VALUE_METRICS, (totals / steps.steps).tolist()))
    return CriticMetrics(**means, grad_norm=steps.grad_norm, lr=steps.lr, optimizer_steps=steps.steps)


def critic_checkpoint_root(save: str | pathlib.Path) -> pathlib.Path:
    """Where the critic's checkpoints live: `{megatron_training.save}/critic`, beside the actor's iter_* directories."""
    return pathlib.Path(save) / CRITIC_CHECKPOINT_DIR


def save_critic_checkpoint(save: str | pathlib.Path, critic, optimizer: ModelOptimizer, state: TrainState) -> pathlib.Path:
    """This rank's critic shard (weights, optimizer, scheduler) for `state.step` under critic_checkpoint_root(save)."""
    return save_checkpoint(critic_checkpoint_root(save), critic, optimizer, state)


def load_critic_checkpoint(save: str | pathlib.Path, critic, optimizer: ModelOptimizer, step: int) -> TrainState:
    """Restores the critic saved at `step`: pass the actor's resumed step, so both continue from one iteration.

    Also restores the RNG state saved with it (the same as the actor's at that step when both are
    saved together, critic last).
    """
    return load_checkpoint(critic_checkpoint_root(save), critic, optimizer, step=step)


@dataclass
class Critic:
    """PPO's critic (adv_estimator: gae) as one thing: the value model, its optimizer and LR schedule,
    and its update settings."""

    model: torch.nn.Module
    optimizer: ModelOptimizer
    cfg: CriticUpdateConfig

    @classmethod
    def build(cls, cfg, layout: ModelLayout, hf_state: dict[str, torch.Tensor], dtype: torch.dtype, total_steps: int) -> "Critic":
        """The critic of `cfg` initialised from the actor's HF checkpoint; `total_steps` sizes its LR schedule."""
        mt = cfg.megatron_training
        model = build_critic(layout, hf_state, dtype, seed=mt.seed, cp_algo=mt.context_parallel_algo,
                             routing_replay=cfg.rl_config.routing_replay)
        return cls(model, build_critic_optimizer(model, mt, total_steps), CriticUpdateConfig.from_config(cfg))

    def values(self, batch: ResponseBatch, cfg: ForwardConfig) -> torch.Tensor:
        """[B, L] values of the response tokens (see compute_values)."""
        return compute_values(self.model, batch, cfg)

    def update(self, batch: ResponseBatch, old_values: torch.Tensor, returns: torch.Tensor, step: int) -> CriticMetrics:
        """One critic update on the iteration's batch (see critic_update)."""
        return critic_update(self.model, self.optimizer, batch, old_values, returns, self.cfg, step)

    def save(self, save: str | pathlib.Path, state: TrainState) -> pathlib.Path:
        """This rank's critic checkpoint beside the actor's (see save_critic_checkpoint)."""
        return save_critic_checkpoint(save, self.model, self.optimizer, state)

    def load(self, save: str | pathlib.Path, step: int) -> TrainState:
        """Restores the critic saved with the actor's checkpoint of `step` (see load_critic_checkpoint)."""
        return load_critic_checkpoint(save, self.model, self.optimizer, step)
