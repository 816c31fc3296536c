"""The update-epochs loop the policy and the critic share: epochs x mini-batches x micro-batches, one optimizer step each mini-batch.

Mirrors MindSpeed-RL's actor update: the batch is split into mini-batches (one optimizer step
each, optionally shuffled per epoch); each mini-batch is run in micro-batches whose losses are
weighted so the accumulated gradient equals the gradient of the whole mini-batch's loss. The
model's own forward, loss and backward over those micro-batches is the caller's (update_policy,
critic_update); this holds the schedule, the weights and the optimizer steps.

Every data-parallel rank holds the whole batch and walks the same mini-batches; each runs the
forward and backward of its share of every mini-batch only, with its micro-batch losses weighted
as shares of the whole mini-batch, so the gradient summed over ranks is the one a single rank
would compute on the whole mini-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from services.trainer.modeling.data_parallel import my_rows, sum_over_data_parallel
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, micro_batches
from services.trainer.modeling.model import compute_device
from services.trainer.modeling.optimizer import ModelOptimizer


class EpochSchedule(Protocol):
    """The settings the loop reads (UpdateConfig and CriticUpdateConfig both have them; rl_config names)."""

    mini_batch_size: int  # samples per optimizer step
    epochs: int
    shuffle_mini_batch: bool
    seed: int
    forward: ForwardConfig


# One mini-batch's forward and backward on this rank: (its micro-batches' row indexes, each one's loss weight).
MiniBatchPass = Callable[[list[torch.Tensor], list[float]], None]


@dataclass(frozen=True)
class OptimizerSteps:
    """What the optimizer steps of one update call did: means over its steps, and their count."""

    grad_norm: float
    lr: float
    steps: int


def mini_batch_order(num_samples: int, mini_batch_size: int, shuffle: bool, seed: int, epoch: int, step: int) -> list[torch.Tensor]:
    """Sample indexes of each mini-batch of one epoch: in order, or shuffled reproducibly from (seed, step, epoch)."""
    if shuffle:
        gen = torch.Generator().manual_seed(seed + 1_000_003 * step + epoch)
        order = torch.randperm(num_samples, generator=gen)
    else:
        order = torch.arange(num_samples)
    return list(order.split(mini_batch_size))


def run_update_epochs(optimizer: ModelOptimizer, samples: ResponseBatch, schedule: EpochSchedule, token_level: bool,
                      step: int, mini_batch_pass: MiniBatchPass) -> OptimizerSteps:
    """schedule.epochs passes of one optimizer step per mini-batch; `step` seeds the shuffle reproducibly.

    `mini_batch_pass` runs this rank's micro-batches of a mini-batch, scaling each one's loss by
    its weight: its share of the mini-batch's response tokens (`token_level`, a token mean) or of
    its samples (a sequence mean), so the accumulated gradient is that of the mini-batch's loss.
    """
    mask = samples.response_mask()
    grad_norm = lr = 0.0
    steps = 0
    for epoch in range(schedule.epochs):
        for mini in mini_batch_order(samples.size, schedule.mini_batch_size, schedule.shuffle_mini_batch, schedule.seed, epoch, step):
            optimizer.zero_grad()
            mini_tokens = mask[mini].sum()
            mine = my_rows(mini)
            indexes = [mine[micro] for micro in micro_batches(samples.select(mine), schedule.forward)] if len(mine) else []
            weights = [float(mask[index].sum() / mini_tokens) if token_level else len(index) / len(mini) for index in indexes]
            mini_batch_pass(indexes, weights)
            step_grad_norm, step_lr = optimizer.step()
            grad_norm += step_grad_norm
            lr += step_lr
            steps += 1
    return OptimizerSteps(grad_norm / steps, lr / steps, steps)


def reduce_totals(totals: torch.Tensor) -> None:
    """Metric totals (CPU), weighted as shares of their mini-batches, summed in place over data-parallel ranks and taken from
    the last pipeline stage, where losses are computed; every rank takes part."""
    sum_over_data_parallel(totals)
    broadcast_from_last_stage(totals)


def broadcast_from_last_stage(values: torch.Tensor) -> None:
    """Overwrites `values` (CPU) on every pipeline stage with the last stage's, where the losses are computed."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        device_values = values.to(compute_device())
        torch.distributed.broadcast(device_values, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
        values.copy_(device_values.cpu())
