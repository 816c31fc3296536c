"""What megatron-core needs to run on a machine without an accelerator, in one place.

megatron-core 0.16 assumes CUDA where it matters for training on CPU: it asks
`torch.cuda.current_device()` for the device of buffers it creates; its optimizers, gradient
clipping and data-parallel wrapper make tensors with `device="cuda"`, call `.cuda()` and check
`param.type()` against `torch.cuda.FloatTensor`; its MoE all-to-all token dispatcher copies routing
counts to the host on a side `torch.cuda.Stream`; and its local core attention relies on fused CUDA
softmax kernels. `apply_cpu_shims()` answers "cpu" for the first, makes `synchronize` /
`empty_cache` harmless and gives the dispatcher a stream that runs everything in order; `megatron_on_cpu()` is a torch function mode that maps the `cuda` device to
the CPU around calls into megatron's optimizer, DDP and pipeline schedule (it is not on during a
model's forward and backward outside a schedule, where every torch call would pay its Python hook).
Under context parallel megatron's rotary embedding picks a CP rank's positions with a pinned index
moved by `.cuda()`; `apply_cpu_shims()` runs that one function under the same mode.
Both apply only when no accelerator is present (see `accelerator_present`). The fused CUDA softmax
of megatron's local core attention is not needed: the layer spec uses `attention.SDPACoreAttention`
on every device.
"""
from __future__ import annotations

import contextlib

import torch

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
        _shim_rope_context_parallel()
        # The MoE dispatcher's device-to-host side stream: on the CPU every copy is already done in order.
        torch.cuda.Stream = _InOrderStream
        torch.cuda.current_stream = lambda *args, **kwargs: _MAIN_STREAM
        torch.cuda.stream = lambda stream: contextlib.nullcontext()
        _applied = True
    return True


class _InOrderStream:
    """A stream on the CPU, where work runs in program order: waiting on one or on its events returns at once."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> "_InOrderStream":
        return self

    def synchronize(self) -> None:
        pass


_MAIN_STREAM = _InOrderStream()

def apply_moe_cpu_shims() -> None:
    """Makes megatron's MoE all-to-all dispatcher take its split sizes as numbers on the CPU; idempotent.

    The dispatcher turns its per-rank token counts into numpy split sizes only while copying them
    off a CUDA device; on the CPU they stay tensors, which gloo's all_to_all_single refuses.
    """
    if accelerator_present():
        return
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        tensor = moe_utils.maybe_move_tensor_to_cpu(tensor, as_numpy, record_stream)
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


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
        kwargs.pop("pin_memory", None)  # pinned memory needs an accelerator
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)):
            args = (args[0], _as_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def _shim_rope_context_parallel() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    original = rotary_pos_embedding.get_pos_emb_on_this_cp_rank

    def on_cpu(pos_emb, seq_dim, cp_group):
        with _CudaAsCpu():
            return original(pos_emb, seq_dim, cp_group)

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = on_cpu


def megatron_on_cpu() -> contextlib.AbstractContextManager:
    """A context in which megatron-core's CUDA-only calls run on the CPU; does nothing with an accelerator."""
    if accelerator_present():
        return contextlib.nullcontext()
    apply_cpu_shims()
    return _CudaAsCpu()
