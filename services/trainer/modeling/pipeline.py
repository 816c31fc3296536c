"""Pipeline-parallel forward and backward over micro-batches on megatron-core's own schedule (1F1B).

`get_forward_backward_func()` gives megatron's non-interleaved 1F1B schedule for PP > 1: after a
warm-up of (stages - stage - 1) forwards each stage alternates one forward and one backward, so
a stage holds at most `stages` micro-batches' activations instead of all of them. Activations
and their gradients travel between stages by megatron's P2P communicator; micro-batches differ
in length here (padded to each one's longest sample, or packed), so the config's
`variable_seq_lengths` makes it send each tensor's shape first. The last stage computes
log-probs and losses; the log-probs are then broadcast to every stage. On the CPU the schedule's
CUDA-only calls run under `megatron_on_cpu`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from services.trainer.modeling.cpu_shims import megatron_on_cpu
from services.trainer.modeling.model import compute_device


def pipelined_micro_batches(model, parts: list, inputs: list, stats: Callable, loss_fn: Callable | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs `parts` (ResponseBatch) with their ModelInputs through this rank's stage.

    `stats(logits, part, inputs)` gives (log-probs, entropy) on the last stage and `loss_fn(i, logp,
    entropy)` the loss to backpropagate (None: forward only). Returns each part's (log-probs,
    entropy), detached, on every stage.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    results: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last stage's, in micro-batch order
    count = len(parts)
    cp_size = parallel_state.get_context_parallel_world_size()

    def forward_step(data_iterator, stage_model):
        i = next(data_iterator)
        output = inputs[i].run(stage_model)

        def loss_func(logits: torch.Tensor):
            logp, entropy = stats(logits, parts[i], inputs[i])
            results.append((logp.detach(), entropy.detach()))
            if loss_fn is None:
                return logits.new_zeros(()), {}
            # The schedule divides each micro-batch's loss by their count and multiplies it by the
            # context-parallel size; ours are already shares of the mini-batch's loss, scaled for
            # DDP's mean over DP x CP (ModelOptimizer.loss_scale), so undo both.
            return loss_fn(i, logp, entropy) * count / cp_size, {}

        return output, loss_func

    widest = max(inp.hidden_shape[0] for inp in inputs)
    with megatron_on_cpu():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(range(count)), model=[model], num_microbatches=count,
            seq_length=widest, micro_batch_size=max(inp.hidden_shape[1] for inp in inputs), forward_only=loss_fn is None,
        )
    return _broadcast_from_last_stage(parts, results, compute_device())


def _broadcast_from_last_stage(parts: list, results: list, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    src, group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
    out = []
    for i, part in enumerate(parts):
        shape = (part.size, part.max_response_length)
        logp, entropy = results[i] if results else (torch.empty(shape, device=device), torch.empty(shape, device=device))
        logp, entropy = logp.contiguous(), entropy.contiguous()
        dist.broadcast(logp, src=src, group=group)
        dist.broadcast(entropy, src=src, group=group)
        out.append((logp, entropy))
    return out
