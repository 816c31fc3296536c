"""Pushes weights to rollout replicas over gloo groups; gRPC carries only the control.

The trainer is rank 0 of one group per replica (that replica's vLLM workers are ranks 1..N; see
services/rollout/gloo_transfer.py). A push of version v:
  1. join: a replica without a group gets one (JoinWeightGroup, while the trainer opens its end);
  2. open: OpenWeightTransfer sends the layout of every bucket; the replica checks it all and
     waits for the bytes;
  3. broadcast: each tensor of a bucket is broadcast on every live group straight from the
     trainer's memory, with no packing copy (each group's sends run on its own gloo thread; the
     next bucket is gathered meanwhile); the replica loads each tensor as it arrives;
  4. finish: FinishWeightTransfer answers once the replica serves v.

Why a group per replica, not one for all: a replica that dies or stops mid-broadcast breaks or
stalls only its own group, so the others go on (a bucket that makes no progress on a group for
`stall_s` drops that replica, which is listed in the result and joins afresh next push), and a
replica that joins mid-run gets its group without disturbing the others'. The cost: the trainer
sends each bucket once per replica instead of relying on the collective's tree.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch

from services.common.weight_wire import BucketSource, TensorSlot, as_buckets, bucket_slots, torch_dtype
from services.trainer.weights.weight_push import PushFailure, PushResult, describe_rpc_error

TRAINER_RANK = 0


@dataclass
class _Member:
    """One replica's group, kept across pushes."""

    address: str
    group: object  # torch ProcessGroup (gloo)
    channel: object  # grpc.Channel
    stub: object  # RolloutStub


class CollectiveSender:
    """The trainer's end of the replicas' weight groups (rank 0 only)."""

    def __init__(self, token: str, stall_s: float, host: str):
        if stall_s <= 0:
            raise ValueError(f"trainer.push_stall_s: must be > 0, got {stall_s}")
        self.token = token
        self.stall_s = stall_s
        self.host = host  # where the replicas reach the trainer's rendezvous
        self._members: dict[str, _Member] = {}
        # groups given up on while a send was stuck in them: their gloo threads end at the group's
        # timeout; collecting one before would wait for that
        self._abandoned: list[object] = []

    def push(self, tensors: Mapping[str, torch.Tensor] | BucketSource, addresses: list[str], version: int, *, bucket_mb: float,
             dtype: torch.dtype | None = None) -> PushResult:
        """Pushes HF-named `tensors` as `version` to `addresses` (host:port); replicas that fail or stall are listed, the others updated.

        `tensors` is a dict, or a BucketSource planned with `bucket_mb` and `dtype` (HfWeightStream: the trainer's
        gather, one bucket at a time), iterated to its end even when every replica failed (the other ranks
        take part in its collectives).
        """
        if not addresses:
            raise ValueError("addresses: no rollout replica to push to")
        start = time.perf_counter()
        failed: dict[str, str] = {}
        self._join_missing(addresses, failed)
        source = as_buckets(tensors, bucket_mb, dtype)
        layouts = [bucket_slots(source.specs, names, dtype) for names in source.plan]
        calls = self._open([a for a in addresses if a not in failed], version, layouts)
        buckets = iter(source)
        first = next(buckets)  # gathered while the replicas check the layout and pause
        live = _answered(calls, "OpenWeightTransfer", failed)
        sent = self._broadcast(buckets, layouts, first, live, failed)
        updated, peak = self._finish(live, version, failed)
        for address in failed:
            self._drop(address)
        return PushResult(version, sent, time.perf_counter() - start, len(layouts), updated,
                          tuple(PushFailure(a, reason) for a, reason in failed.items()), peak)

    def close(self) -> None:
        """Leaves every group and closes the channels."""
        for address in list(self._members):
            self._drop(address)

    # ------------------------------------------------------------ the four steps

    def _join_missing(self, addresses: list[str], failed: dict[str, str]) -> None:
        """Builds a group with each replica that has none, all at once; a failure lists the replica."""
        threads = [threading.Thread(target=self._join, args=(a, failed), daemon=True) for a in addresses if a not in self._members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _join(self, address: str, failed: dict[str, str]) -> None:
        import grpc

        from services.common.auth import bearer_metadata
        from services.common.pb import rollout_pb2, rollout_pb2_grpc

        channel = grpc.insecure_channel(address)
        stub = rollout_pb2_grpc.RolloutStub(channel)
        try:
            ranks = stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=self.stall_s).weight_group_ranks
            listen = socket.create_server((self.host, 0))
            port, world = listen.getsockname()[1], 1 + ranks
            # The replica's operations may wait twice the stall limit: after it answers OpenWeightTransfer its first
            # bucket waits while we wait (up to stall_s) for the other replicas' answers, then up to stall_s itself.
            # With one limit a stopped replica made a running one time out too, whichever side's clock ran out first.
            joined = stub.JoinWeightGroup.future(rollout_pb2.JoinWeightGroupRequest(
                master_address=self.host, master_port=port, world_size=world, timeout_s=2 * self.stall_s),
                timeout=self.stall_s, metadata=bearer_metadata(self.token) or None)
            ours = _OurEnd(self.host, listen, world, self.stall_s)
            # the replica's answer first: after a refused join (a wrong token) our end waits for ranks that never come
            joined.result()
            group = ours.result(self.stall_s)
        except Exception as exc:  # grpc.RpcError, a timeout, a failed rendezvous: this replica misses the push
            channel.close()
            failed[address] = f"JoinWeightGroup: {describe_rpc_error(exc)}"
            return
        self._members[address] = _Member(address, group, channel, stub)

    def _open(self, addresses: list[str], version: int, layouts: list[tuple[tuple[TensorSlot, ...], int]]) -> dict:
        """Sends the transfer's layout to each replica; returns the calls in flight by address."""
        from services.common.auth import bearer_metadata
        from services.common.pb import rollout_pb2

        request = rollout_pb2.OpenWeightTransferRequest(version=version, buckets=[
            rollout_pb2.TransferBucket(nbytes=nbytes, tensors=[
                rollout_pb2.TensorMeta(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset, nbytes=s.nbytes) for s in slots])
            for slots, nbytes in layouts])
        metadata = bearer_metadata(self.token) or None
        return {a: self._members[a].stub.OpenWeightTransfer.future(request, timeout=self.stall_s, metadata=metadata) for a in addresses}

    def _broadcast(self, buckets: Iterator[dict[str, torch.Tensor]], layouts: list[tuple[tuple[TensorSlot, ...], int]],
                   first: dict[str, torch.Tensor], live: list[str], failed: dict[str, str]) -> int:
        """Sends every bucket's tensors (the first bucket already gathered, the rest from `buckets`) on every live group;
        returns the bytes of one copy of the buckets sent. `buckets` is drained even when no replica is left: the
        other ranks take part in the gather behind it."""
        sent = 0
        nxt: dict[str, torch.Tensor] | None = first
        for index, (slots, nbytes) in enumerate(layouts):
            if not live:
                for _ in buckets:
                    pass
                break
            tensors = [_wire_bytes(nxt[s.name], s) for s in slots if s.nbytes]
            works = {a: [self._members[a].group.broadcast(t, TRAINER_RANK) for t in tensors] for a in live}
            nxt = next(buckets) if index + 1 < len(layouts) else None  # gathered while the bytes are on the wire
            for address, posted in works.items():
                try:
                    for work in posted:
                        work.wait(timedelta(seconds=self.stall_s))
                except RuntimeError as exc:  # the peer died (connection reset) or took nothing for stall_s
                    stalled = "timed out" in str(exc)
                    failed[address] = (f"STALLED: bucket {index} made no progress for {self.stall_s:.0f} s (hung or stopped?)"
                                       if stalled else f"broadcast of bucket {index}: {exc}")
                    live.remove(address)
            sent += nbytes
        return sent

    def _finish(self, live: list[str], version: int, failed: dict[str, str]) -> tuple[int, int]:
        """Waits for every live replica to serve `version`; returns (replicas updated, largest peak extra memory)."""
        from services.common.auth import bearer_metadata
        from services.common.pb import rollout_pb2

        metadata = bearer_metadata(self.token) or None
        calls = {a: self._members[a].stub.FinishWeightTransfer.future(
            rollout_pb2.FinishWeightTransferRequest(version=version), timeout=self.stall_s, metadata=metadata) for a in live}
        answers = [calls[a].result() for a in _answered(calls, "FinishWeightTransfer", failed)]
        return len(answers), max((r.peak_extra_bytes for r in answers), default=0)

    def _drop(self, address: str) -> None:
        member = self._members.pop(address, None)
        if member is not None:
            member.channel.close()
            self._abandoned.append(member.group)


class _OurEnd:
    """Opens the trainer's end (rank 0) of a group on a thread: it blocks until every rank has joined."""

    def __init__(self, host: str, listen: socket.socket, world: int, timeout_s: float):
        self._done = threading.Event()
        self._group = None
        self._error: BaseException | None = None
        threading.Thread(target=self._open, args=(host, listen, world, timeout_s), daemon=True).start()

    def _open(self, host: str, listen: socket.socket, world: int, timeout_s: float) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        try:
            self._group = stateless_init_torch_distributed_process_group(
                host, listen.getsockname()[1], TRAINER_RANK, world, "gloo", listen_socket=listen, timeout=timedelta(seconds=timeout_s))
        except BaseException as exc:  # kept for result(); a join that was refused leaves nobody to ask
            self._error = exc
        finally:
            self._done.set()

    def result(self, timeout_s: float):
        """The group, once every rank has joined; raises what the rendezvous raised, or TimeoutError."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"the group's rendezvous did not complete within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._group


def _answered(calls: dict, rpc: str, failed: dict[str, str]) -> list[str]:
    """The addresses whose call succeeded; each other one is listed in `failed` with its error."""
    ok = []
    for address, call in calls.items():
        try:
            call.result()
            ok.append(address)
        except Exception as exc:  # grpc.RpcError or a deadline: refused (a layout it does not serve), unreachable, or stalled
            failed[address] = f"{rpc}: {describe_rpc_error(exc)}"
    return ok


def _wire_bytes(tensor: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """`tensor` as the slot's dtype in CPU memory, viewed as its bytes; a copy only for a cast, a device move or a
    non-contiguous layout."""
    t = tensor.detach().to(device="cpu", dtype=torch_dtype(slot.dtype)).contiguous()
    return t.view(-1).view(torch.uint8)
