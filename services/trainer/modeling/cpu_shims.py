"""What megatron-core needs to run on a machine without an accelerator, in one place.

megatron-core 0.16 assumes CUDA where it matters for training on CPU: it asks
`torch.cuda.current_device()` for the device of buffers it creates; its optimizers, gradient
clipping and data-parallel wrapper make tensors with `device="cuda"`, call `.cuda()` and check
`param.type()` against `torch.cuda.FloatTensor`; and its local core attention relies on fused CUDA
softmax kernels. `apply_cpu_shims()` answers "cpu" for the first and makes `synchronize` /
`empty_cache` harmless; `megatron_on_cpu()` is a torch function mode that maps the `cuda` device to
the CPU around calls into megatron's optimizer and DDP (it is not on during the model's forward and
backward, where every torch call would pay its Python hook); `SDPACoreAttention` replaces the
core attention in the layer spec. All of them apply only when no accelerator is present (see
`accelerator_present`).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

_applied = False


def accelerator_present() -> bool:
    """True when CUDA (or an NPU through torch_npu) is usable, so no shim is needed."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def apply_cpu_shims() -> bool:
    """Makes `torch.cuda.current_device()` answer "cpu" when no accelerator exists; idempotent.

    Returns whether the shims are (now) in effect.
    """
    global _applied
    if accelerator_present():
        return False
    if not _applied:
        torch.cuda.current_device = lambda: "cpu"
        # megatron's DDP frees and re-allocates buffers around these; on CPU there is nothing to wait for.
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.empty_cache = lambda: None
        _applied = True
    return True


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _as_cpu(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    """Runs torch calls written for CUDA on the CPU: `device="cuda"` (or an index) becomes the CPU,
    `.cuda()` is the tensor itself, and `.type()` names a float tensor as its CUDA type, which is
    what megatron's optimizers check before they take a parameter."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype) or func(*args)
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)):
            args = (args[0], _as_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def megatron_on_cpu() -> contextlib.AbstractContextManager:
    """A context in which megatron-core's CUDA-only calls run on the CPU; does nothing with an accelerator."""
    if accelerator_present():
        return contextlib.nullcontext()
    apply_cpu_shims()
    return _CudaAsCpu()


class SDPACoreAttention(MegatronModule):
    """Causal core attention on `scaled_dot_product_attention`, for padded (sbhd) and packed (thd) input.

    Takes the place of megatron-core's DotProductAttention in the layer spec on CPU. Heads are
    the ones of this tensor-parallel rank; grouped-query heads are expanded to the query heads.
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
