"""The sending side of UpdateWeights: named tensors -> buckets -> WeightChunk messages.

The trainer's pusher speaks the same wire format (proto/rollout.proto); this packer is what the
rollout tests and benchmarks push with, and the reference for that format.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from services.common.pb import rollout_pb2

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # well under the 64 MiB gRPC message limit


def _buckets(named: list[tuple[str, "object"]], bucket_bytes: int) -> list[list[tuple[str, "object"]]]:
    buckets: list[list] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def weight_chunks(
    named_tensors: Sequence[tuple[str, "object"]],
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    forward_to: Sequence[str] = (),
) -> Iterator[rollout_pb2.WeightChunk]:
    """Packs torch tensors (HF names) into buckets of about `bucket_bytes`, sent in `chunk_bytes` slices."""
    import torch

    named = [(name, t.detach().contiguous().cpu()) for name, t in named_tensors]
    buckets = _buckets(named, bucket_bytes)
    for index, bucket in enumerate(buckets):
        metas, parts, offset = [], [], 0
        for name, tensor in bucket:
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
            metas.append(rollout_pb2.TensorMeta(
                name=name, dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape), offset=offset, nbytes=len(raw),
            ))
            parts.append(raw)
            offset += len(raw)
        data = b"".join(parts)
        for start in range(0, max(len(data), 1), chunk_bytes):
            chunk = rollout_pb2.WeightChunk(version=version, bucket_index=index, data=data[start:start + chunk_bytes], data_offset=start)
            if start == 0:
                chunk.num_buckets = len(buckets)
                chunk.tensors.extend(metas)
                chunk.bucket_nbytes = len(data)
                if index == 0:
                    chunk.forward_to.extend(forward_to)
                    chunk.num_tensors = len(named)
            yield chunk
