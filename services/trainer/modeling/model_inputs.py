"""One micro-batch as megatron's GPTModel takes it: tokens, positions, the causal mask or the packed (THD)
sequences' bounds, and where each sample starts in the flattened output.

logprobs.py builds them from a ResponseBatch; pipeline.py reshapes them for the interleaved schedule.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from services.trainer.modeling.routing_replay import replaying


@dataclass(frozen=True)
class ModelInputs:
    """One micro-batch as the GPTModel takes it, and where each sample starts in the flattened output."""

    tokens: torch.Tensor  # [b, S] padded, or [1, T] packed
    positions: torch.Tensor  # same shape as tokens
    attention_mask: torch.Tensor | None  # [1, 1, S, S] causal (True = masked); None when packed
    packed_seq_params: object | None  # megatron PackedSeqParams (THD) when packed
    starts: list[int]  # flat offset of each sample's first token (in the whole, CP-padded layout)
    hidden_shape: tuple[int, int]  # (S, b) or (T, 1): the activations passed between pipeline stages
    labels: torch.Tensor | None = None  # under CP: the token each of this rank's positions predicts
    cp_index: torch.Tensor | None = None  # under CP: [CP, n] the flat positions (within a row) each CP rank holds
    routing: torch.Tensor | None = None  # routing replay: [S * b or T, MoE layers, top_k] experts per token, router order

    def run(self, model) -> torch.Tensor:
        """The model's output: logits [b, S, V] on the last pipeline stage, hidden states elsewhere."""
        replay = contextlib.nullcontext() if self.routing is None else replaying(model, self.routing.to(self.tokens.device))
        with replay:
            return model(self.tokens, self.positions, self.attention_mask, packed_seq_params=self.packed_seq_params)


def padded_inputs(tokens: torch.Tensor, samples: int, routing: torch.Tensor | None = None) -> ModelInputs:
    """Right-padded rows `tokens` [rows, width], the first `samples` of them real, as the model takes them: positions
    0..width-1 in every row, one causal mask, each sample starting at its row."""
    rows, width = tokens.shape
    positions = torch.arange(width, device=tokens.device).unsqueeze(0).expand(rows, -1)
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=tokens.device), 1)[None, None]
    return ModelInputs(tokens, positions, causal, None, [i * width for i in range(samples)], (width, rows), routing=routing)


def packed_params(bounds: torch.Tensor, max_len: int):
    """megatron's THD description of sequences packed end to end: `bounds` their cumulative starts (and the end)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=max_len, max_seqlen_kv=max_len)
