"""Pipeline-parallel forward and backward over micro-batches, by point-to-point sends between stages.

megatron-core's own schedules allocate their token counters with `device="cuda"`, so on CPU the
stages exchange activations here instead: every micro-batch's forward in order (each stage
receives its input from the previous one and sends its output on), then every backward in the
same order (gradients flow back the same way). This is GPipe's schedule: simple, and with the
activations of all micro-batches held until the backward. The last stage computes log-probs
and losses; the log-probs are then broadcast to every stage.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from services.trainer.modeling.model import compute_device


def pipelined_micro_batches(model, parts: list, inputs: list, stats: Callable, loss_fn: Callable | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs `parts` (ResponseBatch) with their ModelInputs through this rank's stage.

    `stats(logits, part, inputs)` gives (log-probs, entropy) on the last stage and `loss_fn(i, logp,
    entropy)` the loss to backpropagate (None: forward only). Returns each part's (log-probs,
    entropy), detached, on every stage.
    """
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    prev_rank, next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    hidden, dtype, device = model.config.hidden_size, model.config.params_dtype, compute_device()
    held: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # (received input, output or loss)
    results: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, (part, inp) in enumerate(zip(parts, inputs)):
        received = None
        if not first:
            received = torch.empty(*inp.hidden_shape, hidden, dtype=dtype, device=device)
            dist.recv(received, src=prev_rank)
            received.requires_grad_(loss_fn is not None and torch.is_grad_enabled())
        model.set_input_tensor(received)
        out = inp.run(model)
        if last:
            logp, entropy = stats(out, part, inp)
            results.append((logp.detach(), entropy.detach()))
            held.append((received, loss_fn(i, logp, entropy) if loss_fn is not None else None))
        else:
            dist.send(out.detach().contiguous(), dst=next_rank)
            held.append((received, out))
    model.set_input_tensor(None)
    if loss_fn is not None:
        for received, out in held:
            if last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=next_rank)
                out.backward(grad)
            if not first:
                dist.send(received.grad.contiguous(), dst=prev_rank)
    return _broadcast_from_last_stage(parts, results, device)


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
