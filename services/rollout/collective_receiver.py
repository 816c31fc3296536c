"""The replica's end of the collective weight path: gRPC control, bytes over a gloo group.

JoinWeightGroup puts this replica's vLLM workers into the trainer's group (vLLM's
`init_weight_transfer_engine`, our gloo backend in services/rollout/gloo_transfer.py).
OpenWeightTransfer checks the whole layout of version v against the served model, then, in the
background: generation pauses, the workers receive every bucket straight into the model
(`start_weight_update` / `update_weights`), the layers are finalised (`finish_weight_update`),
the version flips and generation resumes. FinishWeightTransfer answers with that outcome.

The weights are written in place, so a receive that breaks mid-way (the trainer's group failed or
stalled past its timeout) leaves a mix of two versions: the replica then keeps generation paused
and its old version number, so no token comes from the mix, until a complete push (either path)
lands; meanwhile new generation requests (gRPC, HTTP) answer UNAVAILABLE / 503 at once and the dock
worker claims nothing. It also leaves the group; the trainer has it join again before its next push.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.log import log_event
from services.common.pb import rollout_pb2
from services.common.weight_wire import TensorSpec
from services.rollout.engine import RolloutEngine, dead_engine_is_unavailable
from services.rollout.weight_receiver import check_all_present, check_bucket

log = logging.getLogger("dockrl.rollout.weights")
MAX_PORT = 65535
MAX_TIMEOUT_S = 86400.0  # a group timeout past a day is a mistake (and an infinite one cannot be a timedelta)


@dataclass
class _Transfer:
    version: int
    task: asyncio.Task  # -> UpdateWeightsResponse


class CollectiveReceiver:
    """Joins weight groups and runs collective transfers for one engine; one transfer at a time."""

    def __init__(self, engine: RolloutEngine, spec: dict[str, TensorSpec]):
        self.engine = engine
        self.spec = spec
        self.model_nbytes = sum(t.nbytes for t in spec.values())
        gen = engine.cfg.generate_config
        self.ranks = gen.infer_tensor_parallel_size * gen.infer_pipeline_parallel_size  # workers, one group rank each
        self.joined = False
        self._transfer: _Transfer | None = None

    async def join(self, request: rollout_pb2.JoinWeightGroupRequest) -> rollout_pb2.JoinWeightGroupResponse:
        """Joins the trainer's group (returns once every rank has); leaves any earlier group."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if not request.master_address:
            raise InvalidArgument("master_address", "give the trainer's host for the group's rendezvous")
        if not 0 < request.master_port <= MAX_PORT:
            raise InvalidArgument("master_port", f"must be in [1, {MAX_PORT}], got {request.master_port}")
        if request.world_size != 1 + self.ranks:
            raise InvalidArgument("world_size", f"this replica has {self.ranks} worker(s), so its group has {1 + self.ranks} "
                                                f"ranks with the trainer's; got {request.world_size}")
        if not 0 < request.timeout_s <= MAX_TIMEOUT_S:  # NaN fails this too
            raise InvalidArgument("timeout_s", f"must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {request.timeout_s}")
        if self.engine.weights_lock.locked():
            raise FailedPrecondition("JoinWeightGroup: a weight push or join is in progress on this replica; retry after it ends")
        init_info = {"master_address": request.master_address, "master_port": request.master_port,
                     "world_size": request.world_size, "timeout_s": request.timeout_s}
        async with self.engine.weights_lock:  # a second join meanwhile would queue behind this one's rendezvous in the engine
            self.joined = False
            with dead_engine_is_unavailable():
                await self.engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
            self.joined = True
        log_event(log, "joined weight group", master=f"{request.master_address}:{request.master_port}", ranks=self.ranks)
        return rollout_pb2.JoinWeightGroupResponse(ranks=self.ranks)

    async def open(self, request: rollout_pb2.OpenWeightTransferRequest) -> rollout_pb2.OpenWeightTransferResponse:
        """Checks the layout of the whole transfer, then starts receiving it in the background."""
        buckets = self._check_layout(request)
        if not self.joined:
            raise FailedPrecondition("OpenWeightTransfer: this replica is in no weight group; JoinWeightGroup first")
        if self.engine.weights_lock.locked():
            raise FailedPrecondition("OpenWeightTransfer: another push is in progress on this replica; retry after it ends")
        await self.engine.weights_lock.acquire()  # free (checked above), so this takes it with no wait in between
        self._transfer = _Transfer(request.version, asyncio.create_task(self._receive(request.version, buckets)))
        return rollout_pb2.OpenWeightTransferResponse()

    async def finish(self, request: rollout_pb2.FinishWeightTransferRequest) -> rollout_pb2.UpdateWeightsResponse:
        """Waits for the transfer `request.version` to load; answers once this replica serves it."""
        transfer = self._transfer
        if transfer is None or transfer.version != request.version:
            opened = "none" if transfer is None else f"version {transfer.version}"
            raise FailedPrecondition(f"FinishWeightTransfer: no transfer of version {request.version} is open here (open: {opened})")
        try:
            return await asyncio.shield(transfer.task)  # a caller that gives up must not cancel the receive
        finally:
            if transfer.task.done():
                self._transfer = None

    def _check_layout(self, request: rollout_pb2.OpenWeightTransferRequest) -> list[tuple[int, list]]:
        if not request.buckets:
            raise InvalidArgument("buckets", "a transfer needs at least one bucket")
        seen: set[str] = set()
        buckets = []
        for index, bucket in enumerate(request.buckets):
            check_bucket(self.spec, self.model_nbytes, f"buckets[{index}].nbytes", bucket.nbytes, bucket.tensors, seen)
            buckets.append((bucket.nbytes, [(t.name, t.dtype, list(t.shape), t.offset, t.nbytes) for t in bucket.tensors]))
        check_all_present(self.spec, seen)
        return buckets

    async def _receive(self, version: int, buckets: list[tuple[int, list]]) -> rollout_pb2.UpdateWeightsResponse:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        llm = self.engine.llm
        start = time.perf_counter()
        nbytes = sum(n for n, _ in buckets)
        try:
            with dead_engine_is_unavailable():
                await self.engine.pause_for_weights()
                await llm.start_weight_update()
                try:
                    await llm.update_weights(WeightTransferUpdateRequest(update_info={"buckets": buckets}))
                except Exception as exc:
                    self.joined = False  # the backend has left the broken group
                    self.engine.hold_generation(
                        f"weights incomplete: the weight transfer of version {version} broke off mid-way, so this replica "
                        f"generates nothing until the trainer's next complete push (it served version {self.engine.version})")
                    log_event(log, "collective transfer failed", level=logging.WARNING, version=version, error=str(exc)[:300])
                    raise Unavailable(f"weight transfer of version {version} broke off ({exc}); this replica holds generation "
                                      f"paused at version {self.engine.version} until a complete push") from None
                loaded = time.perf_counter()
                await llm.finish_weight_update()
                finish_s = time.perf_counter() - loaded
                if self.engine.cfg.generate_config.enable_prefix_caching:
                    await llm.reset_prefix_cache()
                self.engine.set_version(version)
                await llm.resume_generation()
                stats = await self.engine.collective_rpc("weight_transfer_stats")
        finally:
            self.engine.weights_lock.release()
        seconds = time.perf_counter() - start
        peak = max(s["peak_extra_bytes"] for s in stats)
        log_event(log, "weights applied", version=version, bytes=nbytes, seconds=f"{seconds:.3f}", path="collective",
                  mb_per_s=f"{nbytes / max(seconds, 1e-9) / 1e6:.1f}", peak_extra_mb=f"{peak / 2**20:.1f}",
                  wait_s=f"{max(s['wait_s'] for s in stats):.3f}", load_s=f"{max(s['load_s'] for s in stats):.3f}",
                  finish_s=f"{finish_s:.3f}")
        return rollout_pb2.UpdateWeightsResponse(version=version, bytes_received=nbytes, seconds=seconds, replicas_updated=1,
                                                 apply_seconds=seconds, peak_extra_bytes=peak)
