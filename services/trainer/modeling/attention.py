"""Causal core attention on torch's `scaled_dot_product_attention`, for padded (sbhd) and packed (thd) input.

megatron-core's local `DotProductAttention` needs fused CUDA softmax kernels and refuses packed
sequences (`packed_seq_params` must be None); TransformerEngine's takes THD but fuses the layer
norms into its linear layers under other parameter names than the HF converter maps. This one
runs on the CPU, CUDA and NPU alike (SDPA picks flash / memory-efficient kernels where the device
has them) and takes packed input sequence by sequence.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Causal core attention on `scaled_dot_product_attention`, for padded (sbhd) and packed (thd) input.

    Takes the place of megatron-core's DotProductAttention in the layer spec. Heads are the ones of
    this tensor-parallel rank; grouped-query heads are expanded to the query heads.
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

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D], causal."""
        groups = q.size(1) // k.size(1)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, dropout_p=self.dropout if self.training else 0.0
        )

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """sbhd: [S, B, H, D] -> [S, B, H*D]; thd (packed): [T, H, D] -> [T, H*D], causal per sequence."""
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            outs = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                q, k, v = (t[start:end].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
                outs.append(self._attend(q, k, v)[0].permute(1, 0, 2))
            out = torch.cat(outs, dim=0)
            return out.reshape(out.size(0), -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v).permute(2, 0, 1, 3)
        return out.reshape(out.size(0), out.size(1), -1)
