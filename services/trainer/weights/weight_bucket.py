"""Weights as buckets for the push to rollout: HF-named tensors packed into flat bytes + metadata.

A bucket is one contiguous byte string holding several tensors back to back, each described by
(name, dtype, shape, offset, nbytes), as proto/rollout.proto's TensorMeta says. The trainer
gathers its TP shards and PP stages and converts them to HF names (`gather_hf_weights`),
plans buckets of at most bucket_mb (a larger tensor gets a bucket of its own), and packs them
one at a time so packing can overlap sending.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

MIB = 1 << 20
ALIGN_BYTES = 8  # each tensor starts on a multiple of 8, so a receiver can view its bytes in place


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits in a bucket's bytes."""

    name: str  # Hugging Face name
    dtype: str  # torch dtype name without "torch.": "float32", "bfloat16", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightBucket:
    """Flat bytes and the slots of the tensors inside."""

    data: bytes
    tensors: tuple[TensorSlot, ...]

    @property
    def nbytes(self) -> int:
        return len(self.data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a TensorSlot dtype name; ValueError for an unknown one."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensors.dtype: {name!r} is not a torch dtype")
    return dtype


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_mb: float, dtype: torch.dtype | None = None) -> list[list[str]]:
    """Names per bucket, in order, each bucket at most bucket_mb (a tensor larger than that alone).

    Sizes count tensor bytes only; alignment padding (< 8 bytes a tensor) may add a little.
    """
    if bucket_mb <= 0:
        raise ValueError(f"trainer.bucket_mb: must be > 0, got {bucket_mb}")
    limit = int(bucket_mb * MIB)
    buckets: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * (torch.empty((), dtype=_cast_dtype(t, dtype)).element_size())
        if buckets and size + nbytes <= limit:
            buckets[-1].append(name)
            size += nbytes
        else:
            buckets.append([name])
            size = nbytes
    return buckets


def _cast_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def pack_bucket(tensors: Mapping[str, torch.Tensor], names: Iterable[str], dtype: torch.dtype | None = None) -> WeightBucket:
    """Packs `names` of `tensors` (floating ones cast to `dtype` when given) into one bucket."""
    parts, slots, offset = [], [], 0
    for name in names:
        t = tensors[name].detach().to("cpu", _cast_dtype(tensors[name], dtype)).contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        pad = -offset % ALIGN_BYTES
        parts.append(b"\0" * pad)
        offset += pad
        slots.append(TensorSlot(name, dtype_name(t.dtype), tuple(t.shape), offset, len(raw)))
        parts.append(raw)
        offset += len(raw)
    return WeightBucket(b"".join(parts), tuple(slots))


def unpack_bucket(bucket: WeightBucket) -> dict[str, torch.Tensor]:
    """The tensors of a bucket by name (copies, independent of the bucket's bytes)."""
    flat = torch.frombuffer(bytearray(bucket.data), dtype=torch.uint8) if bucket.data else torch.empty(0, dtype=torch.uint8)
    out = {}
    for s in bucket.tensors:
        if s.offset + s.nbytes > bucket.nbytes:
            raise ValueError(f"tensors[{s.name}]: bytes {s.offset}..{s.offset + s.nbytes} lie past the bucket's {bucket.nbytes}")
        # The copy first: a sender need not align, and view() needs an aligned start.
        out[s.name] = flat[s.offset: s.offset + s.nbytes].clone().view(torch_dtype(s.dtype)).reshape(s.shape)
    return out


def gather_hf_weights(model, layout) -> dict[str, torch.Tensor]:
    """The full model in HF names on every rank: TP shards gathered within each stage, then stages across PP."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.trainer.modeling.checkpoint_convert import megatron_to_hf

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    stage: dict[int, dict[str, torch.Tensor]] = {t: {} for t in range(tp)}
    for name, tensor in state.items():
        if tp == 1:
            stage[0][name] = tensor.cpu()
            continue
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        for t in range(tp):
            stage[t][name] = parts[t].cpu()
    stages = [stage]
    if pp > 1:
        stages = [None] * pp
        dist.all_gather_object(stages, stage, group=parallel_state.get_pipeline_model_parallel_group())
    return megatron_to_hf({(p, t): stages[p][t] for p in range(pp) for t in range(tp)}, layout)
