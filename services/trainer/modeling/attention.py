"""Causal core attention on torch's `scaled_dot_product_attention`, for padded (sbhd) and packed (thd) input.

megatron-core's local `DotProductAttention` needs fused CUDA softmax kernels and refuses packed
sequences (`packed_seq_params` must be None); TransformerEngine's takes THD but fuses the layer
norms into its linear layers under other parameter names than the HF converter maps. This one
runs on the CPU, CUDA and NPU alike (SDPA picks flash / memory-efficient kernels where the device
has them) and takes packed input sequence by sequence. Under context parallel it attends across
the CP ranks with the exchange `cp_comm_type` names (context_parallel.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from services.trainer.modeling import context_parallel


class SDPACoreAttention(MegatronModule):
    """Causal core attention on `scaled_dot_product_attention`, for padded (sbhd) and packed (thd) input.

    Takes the place of megatron-core's DotProductAttention in the layer spec. Heads are the ones of
    this tensor-parallel rank; grouped-query heads are expanded to the query heads. With
    `config.context_parallel_size` > 1 the input is this CP rank's share of each sequence
    (context_parallel's layout) and `cp_comm_type` picks the exchange: "a2a" (Ulysses), "p2p" (ring) or
    "a2a+p2p" (Ulysses within megatron's hierarchical CP groups, the ring across them).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal attention only, got {attn_mask_type}")
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp = config.context_parallel_size
        self.cp_comm_type = cp_comm_type or "p2p"
        if self.cp > 1 and self.cp_comm_type not in context_parallel.CP_ALGOS.values():
            raise ValueError(f"SDPACoreAttention: cp_comm_type {self.cp_comm_type!r} is not one of "
                             f"{', '.join(context_parallel.CP_ALGOS.values())}")

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D], causal."""
        k, v = _expand_groups(k, q.size(1)), _expand_groups(v, q.size(1))
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, dropout_p=self.dropout if self.training else 0.0
        )

    def _attend_sbhd(self, query, key, value, bounds: list[int] | None) -> torch.Tensor:
        """[S, B, H, D] -> [S, B, H, D]: causal over each row, or, with `bounds` (B = 1), within each packed sequence."""
        if bounds is None:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            return self._attend(q, k, v).permute(2, 0, 1, 3)
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].permute(1, 2, 0, 3) for t in (query, key, value))
            outs.append(self._attend(q, k, v).permute(2, 0, 1, 3))
        return torch.cat(outs, dim=0)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """sbhd: [S, B, H, D] -> [S, B, H*D]; thd (packed): [T, H, D] -> [T, H*D], causal per sequence."""
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:  # one row of T positions; cu_seqlens are the whole sequences' bounds (padded for CP)
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            bounds = packed_seq_params.cu_seqlens_q.tolist()
        else:
            bounds = None
        if self.cp == 1:
            out = self._attend_sbhd(query, key, value, bounds)
        elif self.cp_comm_type == "a2a":
            out = self._ulysses(query, key, value, bounds)
        elif self.cp_comm_type == "a2a+p2p":
            out = self._hybrid(query, key, value, bounds)
        else:
            out = self._ring(query, key, value, bounds)
        out = out.reshape(out.size(0), out.size(1), -1)
        return out.squeeze(1) if packed else out

    def _ulysses(self, query, key, value, bounds: list[int] | None) -> torch.Tensor:
        """[n, B, H, D] of this CP rank's positions -> the same, each rank attending over whole sequences with H / CP heads."""
        from megatron.core import parallel_state

        index = context_parallel.layout_index(_lengths(query, bounds, self.cp), self.cp)
        group = parallel_state.get_context_parallel_group()
        q, k, v = (context_parallel.sequence_to_heads(t, index, group) for t in _split_kv(query, key, value, self.cp))
        return context_parallel.heads_to_sequence(self._attend_sbhd(q, k, v, bounds), index, group)

    def _ring(self, query, key, value, bounds: list[int] | None) -> torch.Tensor:
        """[n, B, H, D] of this CP rank's positions -> the same, keys and values passed around the CP ring."""
        from megatron.core import parallel_state

        local_bounds = [0, query.size(0)] if bounds is None else [b // self.cp for b in bounds]
        return self._ring_over(query, key, value, local_bounds, parallel_state.get_context_parallel_group())

    def _hybrid(self, query, key, value, bounds: list[int] | None) -> torch.Tensor:
        """[n, B, H, D] of this CP rank's positions -> the same: Ulysses within this rank's group of U consecutive CP
        ranks (the group's positions, H / U heads), the ring across the R = CP / U groups for those heads, Ulysses back.
        """
        from megatron.core import parallel_state

        ulysses, ring = context_parallel.hybrid_groups()
        u = ulysses.size()
        first = parallel_state.get_context_parallel_rank() // u * u
        index = context_parallel.layout_index(_lengths(query, bounds, self.cp), self.cp)[first:first + u]
        q, k, v = (context_parallel.sequence_to_heads(t, index, ulysses) for t in _split_kv(query, key, value, u))
        # The group's share of each sequence is its two chunks of the sequence cut into 2 * R, U times a rank's share.
        local_bounds = [0, q.size(0)] if bounds is None else [b * u // self.cp for b in bounds]
        return context_parallel.heads_to_sequence(self._ring_over(q, k, v, local_bounds, ring), index, ulysses)

    def _ring_over(self, query, key, value, local_bounds: list[int], group) -> torch.Tensor:
        """[n, B, H, D] -> the same, keys and values passed around `group` (rank i holding chunks i and 2 * size - 1 - i)."""
        heads = query.size(2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, _expand_groups(key, heads, dim=2), _expand_groups(value, heads, dim=2)))
        return context_parallel.ring_attention(q, k, v, local_bounds, self.softmax_scale, group).permute(2, 0, 1, 3)


def _lengths(query: torch.Tensor, bounds: list[int] | None, cp: int) -> list[int]:
    """Whole (padded) lengths of the sequences of which `query` [n, B, ...] holds this CP rank's share."""
    return [query.size(0) * cp] if bounds is None else [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _split_kv(query, key, value, ways: int):
    """(query, key, value) with the KV heads expanded per query head when there are too few to split `ways` ways."""
    if key.size(2) % ways:
        key, value = (_expand_groups(t, query.size(2), dim=2) for t in (key, value))
    return query, key, value


def _expand_groups(kv: torch.Tensor, heads: int, dim: int = 1) -> torch.Tensor:
    """Grouped-query keys/values repeated to `heads` heads along `dim` (each KV head serves heads / kv_heads query heads)."""
    groups = heads // kv.size(dim)
    return kv.repeat_interleave(groups, dim=dim) if groups > 1 else kv
