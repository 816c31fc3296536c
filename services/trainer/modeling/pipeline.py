"""Pipeline-parallel forward and backward over micro-batches on megatron-core's own schedules (1F1B, interleaved).

`get_forward_backward_func()` gives megatron's non-interleaved 1F1B schedule for PP > 1: after a
warm-up of (stages - stage - 1) forwards each stage alternates one forward and one backward, so
a stage holds at most `stages` micro-batches' activations instead of all of them. Activations
and their gradients travel between stages by megatron's P2P communicator; micro-batches differ
in length here (padded to each one's longest sample, or packed), so the config's
`variable_seq_lengths` makes it send each tensor's shape first. The last stage computes
log-probs and losses; the log-probs are then broadcast to every stage. On the CPU the schedule's
CUDA-only calls run under `megatron_on_cpu`.

With a virtual pipeline (`virtual_pipeline_model_parallel_size`) each stage holds several model chunks and
the same call gives megatron's interleaved 1F1B schedule: a micro-batch passes every stage once per chunk,
which shrinks the pipeline's bubble by the number of chunks. That schedule sends one fixed activation shape
(no `variable_seq_lengths`), so every micro-batch is padded to the widest and tallest of them first; it also
needs the micro-batch count a multiple of the stages (megatron-core 0.16.1 groups PP micro-batches per chunk).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.trainer.modeling.cpu_shims import megatron_on_cpu
from services.trainer.modeling.model_inputs import ModelInputs, packed_params, padded_inputs
from services.trainer.modeling.model import compute_device, model_chunks


def pipelined_micro_batches(model, parts: list, inputs: list, stats: Callable, loss_fn: Callable | None,
                            after_forward: Callable | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs `parts` (ResponseBatch) with their ModelInputs through this rank's stage (its chunks, under a virtual pipeline).

    `stats(logits, part, inputs)` gives (log-probs, entropy) on the last stage and `loss_fn(i, logp,
    entropy)` the loss to backpropagate (None: forward only); `after_forward(i, output)`, if given, sees
    each chunk's output on every stage right after its forward. Returns each part's (log-probs,
    entropy), detached, on every stage.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    results: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last stage's, in micro-batch order
    count = len(parts)
    cp_size = parallel_state.get_context_parallel_world_size()
    chunks = model_chunks(model)
    if len(chunks) > 1:
        inputs = _same_shape(inputs, count, parallel_state.get_pipeline_model_parallel_world_size())

    def forward_step(data_iterator, stage_model):
        i = next(data_iterator)
        output = inputs[i].run(stage_model)
        if after_forward is not None:
            after_forward(i, output)

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
    # The interleaved schedule takes one iterator per chunk; each chunk runs every micro-batch once, in order.
    data = [iter(range(count)) for _ in chunks] if len(chunks) > 1 else iter(range(count))
    with megatron_on_cpu():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=count,
            seq_length=widest, micro_batch_size=max(inp.hidden_shape[1] for inp in inputs), forward_only=loss_fn is None,
        )
    return _broadcast_from_last_stage(parts, results, compute_device())


def _same_shape(inputs: list[ModelInputs], count: int, pp: int) -> list[ModelInputs]:
    """`inputs` padded to one activation shape, the interleaved schedule's: padded rows to the widest and tallest
    micro-batch (extra rows of token 0; causal attention leaves every real position as it was), packed ones to the
    longest with one more sequence of token 0 at the end. The response positions (`starts`) stay the real samples'."""
    if count % pp:
        raise ValueError(f"megatron_training.virtual_pipeline_model_parallel_size: the interleaved schedule needs the "
                         f"micro-batch count a multiple of pipeline_model_parallel_size {pp}, got {count} micro-batches "
                         "(make rl_config.mini_batch_size / (micro_batch_size x data-parallel size) a multiple of it)")
    if any(inp.cp_index is not None for inp in inputs):
        raise ValueError("megatron_training.virtual_pipeline_model_parallel_size: not built with context_parallel_size > 1")
    if any(inp.routing is not None for inp in inputs):
        raise ValueError("megatron_training.virtual_pipeline_model_parallel_size: not built with rl_config.routing_replay")
    width = max(inp.hidden_shape[0] for inp in inputs)
    rows = max(inp.hidden_shape[1] for inp in inputs)
    return [_padded(inp, width, rows) if inp.packed_seq_params is None else _packed(inp, width) for inp in inputs]


def _padded(inputs: ModelInputs, width: int, rows: int) -> ModelInputs:
    b, s = inputs.tokens.shape
    return padded_inputs(F.pad(inputs.tokens, (0, width - s, 0, rows - b)), b)


def _packed(inputs: ModelInputs, width: int) -> ModelInputs:
    extra = width - inputs.tokens.size(1)
    if not extra:
        return inputs
    tokens = F.pad(inputs.tokens, (0, extra))
    positions = torch.cat([inputs.positions, torch.arange(extra, device=tokens.device).unsqueeze(0)], dim=1)
    params = inputs.packed_seq_params
    bounds = torch.cat([params.cu_seqlens_q, params.cu_seqlens_q.new_tensor([width])])
    return ModelInputs(tokens, positions, None, packed_params(bounds, max(params.max_seqlen_q, extra)), inputs.starts, (width, 1))


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
