"""The weight push's wire format: the one definition the trainer (sender) and rollout replicas (receiver) share.

A push is a sequence of buckets; a bucket is one flat byte string holding several tensors (Hugging
Face names) back to back, each at an 8-byte aligned offset and described by (name, dtype, shape,
offset, nbytes): proto/rollout.proto's TensorMeta. A bucket travels as WeightChunk messages of at
most the gRPC message limit. Here: the dtypes a replica serves and their sizes, the tensor spec a
receiver checks against, bucket slots, bucket planning, packing, and the split of a bucket into
chunks (a replica's vLLM workers read the tensors back: rollout/worker_extension.py). The
receiver's reply is the proto's UpdateWeightsResponse itself.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from services.common.pb import rollout_pb2

SERVED_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # generate_config.dtype values a replica serves
DEFAULT_MAX_MESSAGE_BYTES = 4 * (1 << 20)  # gRPC's default receive limit
HEADER_SLACK_BYTES = 1024  # framing of the non-data fields of a chunk
MIB = 1 << 20
ALIGN_BYTES = 8  # each tensor starts on a multiple of 8, so a receiver can view its bytes in place


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects of one tensor of the served model."""

    dtype: str  # one of SERVED_DTYPE_BYTES
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SERVED_DTYPE_BYTES[self.dtype]


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


@runtime_checkable
class BucketSource(Protocol):
    """A push's tensors, planned into buckets ahead of their bytes, then produced one bucket at a time.

    `specs` holds every tensor's name, shape and dtype in order (tensors on the meta device will do), so
    both push paths can describe every bucket before the first one's bytes exist; iterating yields each
    bucket of `plan` as {name: tensor}, in order, so a push holds one bucket rather than the whole model.
    """

    specs: Mapping[str, torch.Tensor]
    plan: list[list[str]]
    bucket_mb: float
    dtype: torch.dtype | None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...


class DictBuckets:
    """A BucketSource over tensors already in memory (a checkpoint, a test's tensors)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], bucket_mb: float, dtype: torch.dtype | None = None):
        self.specs = tensors
        self.plan = plan_buckets(tensors, bucket_mb, dtype)
        self.bucket_mb = bucket_mb
        self.dtype = dtype

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for names in self.plan:
            yield {name: self.specs[name] for name in names}


def as_buckets(weights: Mapping[str, torch.Tensor] | BucketSource, bucket_mb: float, dtype: torch.dtype | None) -> BucketSource:
    """`weights` as a BucketSource for a push with these settings; a source planned with other settings is refused
    (its buckets would not be the push's)."""
    if not isinstance(weights, BucketSource):
        return DictBuckets(weights, bucket_mb, dtype)
    if (weights.bucket_mb, weights.dtype) != (bucket_mb, dtype):
        raise ValueError(f"weights: planned for {weights.bucket_mb} MiB buckets in {weights.dtype}, "
                         f"the push sends {bucket_mb} MiB buckets in {dtype}")
    return weights


def _cast_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def bucket_slots(tensors: Mapping[str, torch.Tensor], names: Iterable[str], dtype: torch.dtype | None = None) -> tuple[tuple[TensorSlot, ...], int]:
    """Where each of `names` sits in its bucket (floating ones at `dtype` when given) and the bucket's bytes, without packing.

    The collective path sends this layout ahead of the bytes, so a receiver can check it and size its buffer.
    """
    slots, offset = [], 0
    for name in names:
        t = tensors[name]
        cast = _cast_dtype(t, dtype)
        nbytes = t.numel() * torch.empty((), dtype=cast).element_size()
        offset += -offset % ALIGN_BYTES
        slots.append(TensorSlot(name, dtype_name(cast), tuple(t.shape), offset, nbytes))
        offset += nbytes
    return tuple(slots), offset


def pack_into(tensors: Mapping[str, torch.Tensor], slots: Iterable[TensorSlot], out: torch.Tensor) -> torch.Tensor:
    """Writes each slot's tensor (cast to the slot's dtype) into the flat uint8 tensor `out`; returns `out`."""
    for s in slots:
        out[s.offset: s.offset + s.nbytes].view(torch_dtype(s.dtype)).view(s.shape).copy_(tensors[s.name].detach())
    return out


def pack_bucket(tensors: Mapping[str, torch.Tensor], names: Iterable[str], dtype: torch.dtype | None = None) -> WeightBucket:
    """Packs `names` of `tensors` (floating ones cast to `dtype` when given) into one bucket."""
    slots, nbytes = bucket_slots(tensors, names, dtype)
    flat = pack_into(tensors, slots, torch.zeros(nbytes, dtype=torch.uint8))
    return WeightBucket(flat.numpy().tobytes(), slots)


def chunk_messages(bucket: WeightBucket, version: int, bucket_index: int, num_buckets: int, *,
                   max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, forward_to: tuple[str, ...] = (),
                   num_tensors: int = 0) -> Iterator[rollout_pb2.WeightChunk]:
    """The WeightChunk messages of one bucket, each at most max_message_bytes on the wire.

    `forward_to` and `num_tensors` go on the first chunk of the push (bucket 0) only.
    """
    first = rollout_pb2.WeightChunk(
        version=version, bucket_index=bucket_index, num_buckets=num_buckets, bucket_nbytes=bucket.nbytes,
        tensors=[rollout_pb2.TensorMeta(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset, nbytes=s.nbytes)
                 for s in bucket.tensors],
    )
    if bucket_index == 0:
        first.forward_to.extend(forward_to)
        first.num_tensors = num_tensors
    room = max_message_bytes - first.ByteSize() - HEADER_SLACK_BYTES
    if room <= 0:
        raise ValueError(f"trainer.bucket_mb: bucket {bucket_index}'s metadata alone ({first.ByteSize()} bytes) "
                         f"exceeds the {max_message_bytes}-byte message limit; use smaller buckets")
    first.data = bucket.data[:room]
    yield first
    step = max_message_bytes - HEADER_SLACK_BYTES
    for offset in range(room, bucket.nbytes, step):
        yield rollout_pb2.WeightChunk(version=version, bucket_index=bucket_index, num_buckets=num_buckets,
                                      data=bucket.data[offset: offset + step], data_offset=offset)
