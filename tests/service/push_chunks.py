"""A whole push as WeightChunk messages, for tests that play the trainer: services/common/weight_wire.py's buckets,
sliced into chunks of at most `chunk_bytes` of data (the trainer's pusher slices by the gRPC message limit instead)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from services.common.pb import rollout_pb2
from services.common.weight_wire import MIB, pack_bucket, plan_buckets

DEFAULT_BUCKET_BYTES = 64 * MIB
DEFAULT_CHUNK_BYTES = 4 * MIB


def weight_chunks(named_tensors: Sequence[tuple[str, object]], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, forward_to: Sequence[str] = ()) -> Iterator[rollout_pb2.WeightChunk]:
    """Packs (name, tensor) pairs into buckets of at most `bucket_bytes` (a larger tensor alone), sent in `chunk_bytes` slices."""
    tensors = dict(named_tensors)
    plan = plan_buckets(tensors, bucket_bytes / MIB)
    for index, names in enumerate(plan):
        bucket = pack_bucket(tensors, names)
        for start in range(0, max(bucket.nbytes, 1), chunk_bytes):
            chunk = rollout_pb2.WeightChunk(version=version, bucket_index=index, data=bucket.data[start:start + chunk_bytes],
                                            data_offset=start)
            if start == 0:
                chunk.num_buckets = len(plan)
                chunk.bucket_nbytes = bucket.nbytes
                chunk.tensors.extend(rollout_pb2.TensorMeta(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset,
                                                            nbytes=s.nbytes) for s in bucket.tensors)
                if index == 0:
                    chunk.forward_to.extend(forward_to)
                    chunk.num_tensors = len(tensors)
            yield chunk
