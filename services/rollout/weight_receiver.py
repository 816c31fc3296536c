"""Receives a weight push (a stream of WeightChunk), validates all of it, then applies it at once.

A push is a sequence of buckets; each bucket is a flat byte buffer holding several tensors
(Hugging Face names) at the offsets its metadata gives. Complete buckets are staged in the vLLM
workers while the old weights keep serving. Only when the last bucket has arrived and every
tensor of the served model is present with its dtype and shape does the engine pause, load the
staged tensors and flip the version. Anything missing, unknown, mis-shaped or out of order
rejects the whole push (INVALID_ARGUMENT) and the staged tensors are dropped.
"""
from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.log import log_event
from services.common.pb import rollout_pb2
from services.common.weight_wire import TensorSpec
from services.rollout.chain import ChainForwarder
from services.rollout.engine import RolloutEngine

log = logging.getLogger("dockrl.rollout.weights")

def served_weight_spec(model_dir: str | pathlib.Path, dtype: str) -> dict[str, TensorSpec]:
    """HF tensor names and shapes from the checkpoint's safetensors headers, at the serving dtype."""
    files = sorted(pathlib.Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {model_dir}")
    spec: dict[str, TensorSpec] = {}
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__":
                spec[name] = TensorSpec(dtype=dtype, shape=tuple(entry["shape"]))
    return spec


def check_tensor(spec: dict[str, TensorSpec], meta: rollout_pb2.TensorMeta, seen: set[str], bucket_nbytes: int) -> None:
    """Raises InvalidArgument unless `meta` is a tensor of the served model, new in this push, and inside its bucket."""
    expected = spec.get(meta.name)
    where = f"tensors[{meta.name!r}]"
    if expected is None:
        raise InvalidArgument(where, "is not a parameter of the served model")
    if meta.name in seen:
        raise InvalidArgument(where, "appears twice in one push")
    if meta.dtype != expected.dtype:
        raise InvalidArgument(f"{where}.dtype", f"the served model holds {expected.dtype}, got {meta.dtype!r}")
    if tuple(meta.shape) != expected.shape:
        raise InvalidArgument(f"{where}.shape", f"the served model expects {list(expected.shape)}, got {list(meta.shape)}")
    if meta.nbytes != expected.nbytes:
        raise InvalidArgument(f"{where}.nbytes", f"{list(expected.shape)} of {expected.dtype} is {expected.nbytes} bytes, got {meta.nbytes}")
    if meta.offset < 0 or meta.offset + meta.nbytes > bucket_nbytes:
        raise InvalidArgument(f"{where}.offset", f"[{meta.offset}, {meta.offset + meta.nbytes}) lies outside the bucket's {bucket_nbytes} bytes")


def check_bucket(spec: dict[str, TensorSpec], model_nbytes: int, field: str, nbytes: int,
                 tensors, seen: set[str]) -> None:
    """Raises InvalidArgument unless a bucket of `nbytes` (named `field`) fits in the served model's
    `model_nbytes` and each of its `tensors` passes check_tensor; adds their names to `seen`.
    The size is checked first: a receiver allocates the bucket after, and a huge one must not exhaust memory."""
    if not 0 < nbytes <= model_nbytes:
        raise InvalidArgument(field, f"must be in [1, {model_nbytes}] (the served model's bytes), got {nbytes}")
    for meta in tensors:
        check_tensor(spec, meta, seen, nbytes)
        seen.add(meta.name)


def check_all_present(spec: dict[str, TensorSpec], seen: set[str]) -> None:
    """Raises InvalidArgument naming the served model's tensors a push lacks."""
    missing = sorted(set(spec) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise InvalidArgument("tensors", f"the push lacks {len(missing)} of the served model's {len(spec)} tensors: {shown}")


@dataclass
class _Bucket:
    index: int
    tensors: list[rollout_pb2.TensorMeta]
    buffer: bytearray
    filled: int = 0


@dataclass
class _Push:
    version: int
    num_buckets: int
    num_tensors: int
    seen: set[str] = field(default_factory=set)
    bucket: _Bucket | None = None
    buckets_done: int = 0
    bytes_received: int = 0


class WeightReceiver:
    """Assembles, validates and applies pushes for one engine; one push at a time."""

    def __init__(self, engine: RolloutEngine, spec: dict[str, TensorSpec], token: str):
        self.engine = engine
        self.spec = spec
        self.model_nbytes = sum(t.nbytes for t in spec.values())  # no bucket can be larger than the whole model
        self.token = token

    async def receive(self, chunks: AsyncIterator[rollout_pb2.WeightChunk]) -> rollout_pb2.UpdateWeightsResponse:
        """Consumes one push; answers once it serves the new version (here and down the chain)."""
        if self.engine.weights_lock.locked():
            raise FailedPrecondition("UpdateWeights: another push is in progress on this replica; retry after it ends")
        async with self.engine.weights_lock:
            start = time.perf_counter()
            forwarder: ChainForwarder | None = None
            push: _Push | None = None
            try:
                async for chunk in chunks:
                    if push is None:
                        push = self._begin(chunk)
                        if chunk.forward_to:
                            forwarder = ChainForwarder(chunk.forward_to[0], list(chunk.forward_to[1:]), self.token)
                    if forwarder is not None:
                        await forwarder.send(chunk)
                    await self._take(push, chunk)
                self._check_complete(push)
            except BaseException:
                await self.engine.collective_rpc("discard_staged")
                if forwarder is not None:
                    await forwarder.cancel()
                raise
            received = time.perf_counter()
            await self.engine.commit_staged_weights(push.version)
            apply_seconds = time.perf_counter() - received
            downstream = await forwarder.finish() if forwarder is not None else 0
            seconds = time.perf_counter() - start
            log_event(
                log, "weights applied", version=push.version, bytes=push.bytes_received, seconds=f"{seconds:.3f}",
                receive_and_stage_s=f"{received - start:.3f}", apply_s=f"{apply_seconds:.3f}",
                mb_per_s=f"{push.bytes_received / max(seconds, 1e-9) / 1e6:.1f}", forwarded_to=downstream,
            )
            return rollout_pb2.UpdateWeightsResponse(version=push.version, bytes_received=push.bytes_received, seconds=seconds,
                                                     replicas_updated=1 + downstream, apply_seconds=apply_seconds)

    def _begin(self, chunk: rollout_pb2.WeightChunk) -> _Push:
        if chunk.num_buckets < 1:
            raise InvalidArgument("num_buckets", f"the first chunk of a push must give num_buckets >= 1, got {chunk.num_buckets}")
        return _Push(version=chunk.version, num_buckets=chunk.num_buckets, num_tensors=chunk.num_tensors)

    async def _take(self, push: _Push, chunk: rollout_pb2.WeightChunk) -> None:
        if chunk.version != push.version:
            raise InvalidArgument("version", f"chunk of version {chunk.version} inside a push of version {push.version}")
        if chunk.tensors:
            self._open_bucket(push, chunk)
        bucket = push.bucket
        if bucket is None or chunk.bucket_index != bucket.index:
            raise InvalidArgument(
                "bucket_index", f"chunk for bucket {chunk.bucket_index} arrived before that bucket's metadata chunk"
            )
        if chunk.data_offset != bucket.filled:
            raise InvalidArgument("data_offset", f"expected {bucket.filled} in bucket {bucket.index}, got {chunk.data_offset} (chunks go in order)")
        end = bucket.filled + len(chunk.data)
        if end > len(bucket.buffer):
            raise InvalidArgument("data", f"bucket {bucket.index} overflows its bucket_nbytes {len(bucket.buffer)} (got {end} bytes)")
        bucket.buffer[bucket.filled:end] = chunk.data
        bucket.filled = end
        push.bytes_received += len(chunk.data)
        if bucket.filled == len(bucket.buffer):
            metas = [(t.name, t.dtype, list(t.shape), t.offset, t.nbytes) for t in bucket.tensors]
            await self.engine.collective_rpc("stage_bucket", bucket.buffer, metas)
            push.buckets_done += 1
            push.bucket = None

    def _open_bucket(self, push: _Push, chunk: rollout_pb2.WeightChunk) -> None:
        if push.bucket is not None:
            raise InvalidArgument(
                "bucket_index", f"bucket {chunk.bucket_index} began before bucket {push.bucket.index} was complete "
                f"({push.bucket.filled} of {len(push.bucket.buffer)} bytes)"
            )
        if chunk.bucket_index != push.buckets_done or chunk.bucket_index >= push.num_buckets:
            raise InvalidArgument(
                "bucket_index", f"expected bucket {push.buckets_done} of {push.num_buckets}, got {chunk.bucket_index}"
            )
        check_bucket(self.spec, self.model_nbytes, "bucket_nbytes", chunk.bucket_nbytes, chunk.tensors, push.seen)
        push.bucket = _Bucket(chunk.bucket_index, list(chunk.tensors), bytearray(chunk.bucket_nbytes))

    def _check_complete(self, push: _Push | None) -> None:
        if push is None:
            raise InvalidArgument("UpdateWeights", "the stream ended without a chunk")
        if push.bucket is not None:
            raise InvalidArgument(
                "data", f"the stream ended inside bucket {push.bucket.index} ({push.bucket.filled} of {len(push.bucket.buffer)} bytes)"
            )
        if push.buckets_done != push.num_buckets:
            raise InvalidArgument("num_buckets", f"the push announced {push.num_buckets} buckets but sent {push.buckets_done}")
        check_all_present(self.spec, push.seen)
        if push.num_tensors and push.num_tensors != len(push.seen):
            raise InvalidArgument("num_tensors", f"the push announced {push.num_tensors} tensors but sent {len(push.seen)}")
