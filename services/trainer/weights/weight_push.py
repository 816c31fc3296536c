"""Streams weight buckets to rollout replicas over gRPC `Rollout.UpdateWeights`.

Each bucket goes out as WeightChunk messages under the gRPC message limit: the first chunk of a
bucket carries its tensor metadata, every chunk a slice of its bytes. Fan-out opens one stream
per replica; chain opens one stream to the first replica and names the rest in `forward_to`
(the replica forwards as it receives). Packing fills a bounded queue per stream that gRPC drains
on its own thread, so the next bucket is packed while the previous one is on the wire, and memory
stays at a few buckets.

A replica that stops taking chunks (hung, stopped, its host swapping) would hold every stream
behind the bounded queue until the call's deadline; after `stall_s` without progress its stream
is cancelled and the replica listed as failed, so the others get the version at once.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Mapping

import torch

from services.common.weight_wire import DEFAULT_MAX_MESSAGE_BYTES, BucketSource, as_buckets, chunk_messages, pack_bucket

QUEUE_BUCKETS = 2  # buckets packed ahead of the slowest stream
PUSH_MODES = ("fanout", "chain")
_END = object()


@dataclass(frozen=True)
class PushFailure:
    """A replica that missed a push, and why."""

    address: str  # host:port of its gRPC server
    error: str  # the failed call as "CODE details", or why the stream was given up ("STALLED: ...")

    def __str__(self) -> str:
        return f"{self.address}: {self.error}"


@dataclass(frozen=True)
class PushResult:
    """What one push did."""

    version: int
    bytes_sent: int  # bucket bytes of the whole model (per stream)
    seconds: float  # wall time from the first bucket packed to the last replica's answer
    num_buckets: int
    replicas_updated: int  # replicas that answered with the new version (chain: counted by the head)
    failed: tuple[PushFailure, ...]  # each replica whose stream failed
    replica_peak_extra_bytes: int = 0  # collective path: the largest peak resident memory a replica's worker added while receiving


class _Stream:
    """One UpdateWeights call fed from a bounded queue of buckets' chunks."""

    def __init__(self, address: str, token: str, timeout_s: float, stall_s: float, max_message_bytes: int):
        import grpc

        from services.common.auth import bearer_metadata
        from services.common.pb import rollout_pb2_grpc

        self.address = address
        self.stall_s = stall_s
        self.stalled = False
        self.last_taken = time.monotonic()  # when gRPC last took chunks to send (the replica's progress)
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_BUCKETS)
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", max_message_bytes)])
        stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.future = stub.UpdateWeights.future(self._requests(), timeout=timeout_s, metadata=bearer_metadata(token) or None)

    def _requests(self):
        while True:
            item = self.queue.get()
            self.last_taken = time.monotonic()
            if item is _END:
                return
            yield from item

    def offer(self, chunks) -> bool:
        """Queues one bucket's chunks (or _END); False once the call has ended (failed, or cancelled as stalled)."""
        waiting_since = time.monotonic()
        while not self.future.done():
            try:
                self.queue.put(chunks, timeout=0.2)
                return True
            except queue.Full:
                if time.monotonic() - max(waiting_since, self.last_taken) > self.stall_s:
                    self.give_up()
                    return False
        return False

    def give_up(self) -> None:
        """Cancels a call whose replica made no progress for stall_s."""
        self.stalled = True
        self.future.cancel()

    def outcome(self, deadline: float):
        """The replica's answer, waited for until `deadline` (monotonic) at most."""
        import grpc

        try:
            return self.future.result(timeout=max(0.0, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            self.give_up()
            raise

    def close(self) -> None:
        self.channel.close()


def push_weights(tensors: Mapping[str, torch.Tensor] | BucketSource, addresses: list[str], version: int, *, bucket_mb: float,
                 mode: str = "fanout", token: str = "", dtype: torch.dtype | None = None, timeout_s: float = 600.0,
                 stall_s: float = 120.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> PushResult:
    """Pushes HF-named `tensors` as policy `version` to `addresses` (host:port), fan-out or chain.

    `tensors` is a dict, or a BucketSource planned with `bucket_mb` and `dtype` (HfWeightStream: the trainer's
    gather, one bucket at a time), which is iterated to its end even when every replica failed, since
    the other ranks take part in its collectives. Floating tensors are cast to `dtype` (the rollout's) when given. Replicas that fail, or take
    nothing for `stall_s` (or give no answer within `stall_s` of the last chunk), are listed in
    the result; the others are updated. `timeout_s` bounds each whole call.
    """
    if mode not in PUSH_MODES:
        raise ValueError(f"trainer.push_mode: {mode!r} is not one of {', '.join(PUSH_MODES)}")
    if not addresses:
        raise ValueError("addresses: no rollout replica to push to")
    source = as_buckets(tensors, bucket_mb, dtype)
    plan = source.plan
    heads = addresses if mode == "fanout" else addresses[:1]
    forward_to = () if mode == "fanout" else tuple(addresses[1:])
    start = time.perf_counter()
    streams = [_Stream(a, token, timeout_s, stall_s, max_message_bytes) for a in heads]
    sent = 0
    live = [True] * len(streams)
    try:
        for index, (names, tensors_of_bucket) in enumerate(zip(plan, source)):
            if not any(live):
                continue  # nobody takes it, but the source's collectives still run to the end
            bucket = pack_bucket(tensors_of_bucket, names, dtype)
            chunks = list(chunk_messages(bucket, version, index, len(plan), max_message_bytes=max_message_bytes,
                                         forward_to=forward_to, num_tensors=len(source.specs)))
            live = [s.offer(chunks) for s in streams]  # each offer is bounded by stall_s
            sent += bucket.nbytes
    except BaseException:  # a half push must not look complete
        for s in streams:
            s.future.cancel()
            s.close()
        raise
    finally:
        for s in streams:
            s.offer(_END)
    answer_deadline = time.monotonic() + stall_s
    updated, failed = 0, []
    for s in streams:
        try:
            response = s.outcome(answer_deadline)
            updated += max(1, response.replicas_updated)
        except Exception as exc:  # grpc.RpcError, cancellations and timeouts: this replica missed the push
            reason = f"STALLED: no progress for {stall_s:.0f} s (hung or stopped?)" if s.stalled else describe_rpc_error(exc)
            failed.append(PushFailure(s.address, reason))
    for s in streams:
        s.close()
    return PushResult(version, sent, time.perf_counter() - start, len(plan), updated, tuple(failed))


def describe_rpc_error(exc: BaseException) -> str:
    """A failed call as "CODE details" for a gRPC error, else the exception's repr."""
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name} {details()}"
    return repr(exc)
