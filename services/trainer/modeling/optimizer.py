"""A model's optimizer on megatron-core's own machinery: DistributedDataParallel, get_megatron_optimizer, the LR schedule.

`build_optimizer` wraps the model in megatron-core's `DistributedDataParallel` (gradients
accumulate into contiguous fp32 buffers and are reduced over the data-parallel group bucket by
bucket) and builds its Adam through `get_megatron_optimizer`: by default the distributed
optimizer, which shards the fp32 main weights and the Adam moments over the data-parallel ranks
and all-gathers the updated weights after each step. Gradient clipping is megatron's (over TP and
PP, each tensor counted once, a tied embedding's copy left out); the tied embedding's two copies
across pipeline stages are reduced by `finalize_model_grads`. One code path for CPU (gloo) and
accelerators: on the CPU megatron's CUDA-only calls run under `megatron_on_cpu`.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.modeling.cpu_shims import megatron_on_cpu

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class ModelOptimizer:
    """One model's DDP wrapper, megatron optimizer and LR schedule, stepped as one."""

    ddps: list  # megatron.core.distributed.DistributedDataParallel around each model chunk (one without a virtual pipeline)
    optimizer: Any  # megatron.core.optimizer.ChainedOptimizer
    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    distributed: bool  # the distributed optimizer (state sharded over data-parallel ranks)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """What a rank multiplies its loss by: DDP averages gradients over the data-parallel ranks (times the
        context-parallel ones, whose gradients are each a part of their replica's), and each rank's loss is already
        its share of the whole mini-batch's, so the mean is scaled back to the sum."""
        from megatron.core import parallel_state

        return float(parallel_state.get_data_parallel_world_size(with_context_parallel=True))

    def zero_grad(self) -> None:
        """Clears the gradient buffers before a mini-batch's micro-batches accumulate into them."""
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[float, float]:
        """Reduces the accumulated gradients, clips, steps Adam and the LR schedule; returns (grad norm, lr used).

        The grad norm is NaN when the step was skipped for a non-finite gradient.
        """
        from megatron.core.distributed import finalize_model_grads

        lr = self.optimizer.param_groups[0]["lr"]
        with megatron_on_cpu():
            finalize_model_grads(self.ddps)
            ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(1)
        return (float(grad_norm) if ok and grad_norm is not None else float("nan")), lr

    @property
    def stepped(self) -> bool:
        """Whether a step has been taken (before it Adam has no state to save: a fresh one is the same)."""
        return any(len(chained.optimizer.state) for chained in self.optimizer.chained_optimizers)

    def state_dict(self) -> dict:
        """The optimizer's and the schedule's state ("optimizer" None before the first step); with the
        distributed optimizer the per-parameter state is not in it (see `save_sharded_state`)."""
        with megatron_on_cpu():
            optimizer = self.optimizer.state_dict() if self.stepped else None
        return {"optimizer": optimizer, "opt_param_scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores what `state_dict` gave."""
        if state["optimizer"] is not None:
            with megatron_on_cpu(), torch.no_grad():
                self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["opt_param_scheduler"])

    def save_sharded_state(self, path: pathlib.Path) -> None:
        """Distributed optimizer: gathers the weights' fp32 copy and Adam moments to data-parallel rank 0, which
        writes them to `path` (Megatron's distrib_optim.pt). A collective over the data-parallel group; nothing
        is written before the first step."""
        if self.stepped:
            with megatron_on_cpu():
                self.optimizer.save_parameter_state(str(path))

    def load_sharded_state(self, path: pathlib.Path) -> None:
        """The inverse of `save_sharded_state`: rank 0 reads `path` and scatters each rank's shard."""
        # megatron-core 0.16.1 copies every per-parameter state key back, but with torch's AdamW (no
        # TransformerEngine / Apex) the file has no "step": it travels in the param groups, which
        # load_state_dict has already put back, as one tensor shared by every parameter (AdamW
        # increments each parameter's in place: shared, it would count once per parameter). Set the
        # steps aside for the copy and give each parameter its own.
        inner = [chained.optimizer for chained in self.optimizer.chained_optimizers]
        steps = [{param: state.pop("step") for param, state in opt.state.items() if "step" in state} for opt in inner]
        # fp32 main weights are views of the model's weights, which require grad: copy into them without autograd.
        with megatron_on_cpu(), torch.no_grad():
            self.optimizer.load_parameter_state(str(path))
        for opt, saved in zip(inner, steps):
            for param, step in saved.items():
                opt.state[param]["step"] = step.clone()


def build_optimizer(model, mt, total_steps: int) -> ModelOptimizer:
    """megatron-core DDP and Adam (AdamW's decoupled weight decay) over `model`, with megatron's
    OptimizerParamScheduler (warmup, then constant/linear/cosine). A virtual pipeline's chunks (ModelChunks) are
    wrapped one DDP each and the optimizer gets the list, as Megatron's get_model and setup_model_and_optimizer do.

    `mt` is the megatron_training section (lr, min_lr, Adam betas and eps, weight decay,
    clip_grad, bf16, use_distributed_optimizer); `total_steps` the optimizer steps of the run.
    Biases and norm weights get no weight decay, as in Megatron.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from services.trainer.modeling.model import model_chunks

    if mt.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"megatron_training.lr_decay_style: {mt.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
    distributed = bool(mt.use_distributed_optimizer)
    params_dtype = next(model.parameters()).dtype
    with megatron_on_cpu():
        # Gradients are reduced once per optimizer step (overlap needs no_sync across micro-batches,
        # which the hand-run micro-batch loop does not give DDP yet).
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed)
        # Megatron buckets only the first chunk's gradients; the others' reduce as one bucket each.
        ddps = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=v > 0)
                for v, chunk in enumerate(model_chunks(model))]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=mt.lr, min_lr=mt.min_lr, weight_decay=mt.weight_decay,
                            adam_beta1=mt.adam_beta1, adam_beta2=mt.adam_beta2, adam_eps=mt.adam_eps,
                            clip_grad=mt.clip_grad, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
                            use_distributed_optimizer=distributed),
            ddps,
        )
    total_steps = max(1, total_steps)
    warmup = min(int(mt.lr_warmup_fraction * total_steps), total_steps - 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else mt.lr, max_lr=mt.lr, min_lr=mt.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=total_steps, lr_decay_style=mt.lr_decay_style, start_wd=mt.weight_decay, end_wd=mt.weight_decay,
        wd_incr_steps=total_steps, wd_incr_style="constant",
    )
    return ModelOptimizer(ddps, optimizer, scheduler, distributed)
