"""dockrl's gloo backend for vLLM's weight-transfer engines (`vllm/distributed/weight_transfer`).

vLLM's own backends (nccl, ipc, ...) all need CUDA; this one moves the same buckets over a gloo
group, so the collective path runs on the CPU platform too. It runs in each vLLM worker process:
`register_backend` puts it in vLLM's engine factory under BACKEND (the worker extension module
calls it on import, which happens in the worker before the model loads), and the serve arguments
name BACKEND in `--weight-transfer-config`.

One group per replica: the trainer is rank 0, this replica's workers ranks 1..N. A transfer is
`start_weight_update` (vLLM's layerwise reload: each layer's old tensors move aside), then
`update_weights` with the transfer's layout: each tensor is broadcast on its own, received into a
tensor of its own shape, and handed to `model.load_weights` as it arrives, so a layer is loaded and
processed (q/k/v and gate/up fused, CPU GEMM weights repacked) as soon as all of its parts are in.
The next tensor's receive is posted before the current one loads, so the wire and the load overlap.
Buckets are the sender's unit (what it gathers and has in flight); a replica never holds one whole.
Extra memory is about the parts of the layers still loading, the layer being processed and one
tensor on the wire, not a copy of the model.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from services.common.weight_wire import torch_dtype
from services.rollout.engine import GLOO_BACKEND as BACKEND

TRAINER_RANK = 0  # the sender in every group
# The heap is trimmed after every this many bytes received (malloc_trim costs a few ms a call): the peak
# then holds the layers still loading plus up to this much memory freed since the last trim.
TRIM_EVERY_BYTES = 16 * 2**20


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's rendezvous is and this replica's place in the group."""

    master_address: str
    master_port: int
    world_size: int  # 1 (the trainer) + this replica's workers
    timeout_s: float  # a broadcast that makes no progress this long raises (trainer.push_stall_s)
    rank_offset: int = 1  # the trainer holds rank 0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """A whole transfer's layout: per bucket its bytes and its tensors (name, dtype, shape, offset, nbytes)."""

    buckets: list[tuple[int, list[tuple[str, str, list[int], int, int]]]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives broadcast buckets straight into the model through vLLM's layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = None
        # of the last transfer: peak resident memory above the level at its start, and where its time went
        self.stats = {"peak_extra_bytes": 0, "wait_s": 0.0, "load_s": 0.0}
        self.experts_reloaded = False  # the last receive_weights rewrote MoE experts: finish_weight_update re-packs them

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Joins the trainer's group (blocks until every rank has); leaves a previous group first."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.data_parallel_index * self.parallel_config.world_size + self.parallel_config.rank
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, "gloo",
            timeout=timedelta(seconds=init_info.timeout_s),
        )

    def start_weight_update(self) -> None:
        """Moves the layers' tensors aside so each loads and processes as soon as its parts arrive."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Processes what is left (attention layers, anything not loaded) and puts the tensors back in place;
        re-packs reloaded MoE experts for the CPU kernel (services.rollout.moe_reload)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from services.rollout.moe_reload import repack_cpu_moe_experts

        finalize_layerwise_reload(self.model, self.model_config)
        if self.experts_reloaded:
            repack_cpu_moe_experts(self.model)
            self.experts_reloaded = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receives the whole transfer. Unlike the base class, no accelerator sync: gloo's wait() is the end of a
        broadcast. On failure (a broken or stalled group) the layers are put back before the error goes up, so the
        model holds tensors again, and the group is left: the trainer builds a new one for its next push."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.finish_weight_update()
            self.shutdown()
            raise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receives each tensor from the trainer and loads it into the model."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self.group is None:
            raise RuntimeError("weight transfer: this worker has not joined a weight group (JoinWeightGroup first)")
        from services.rollout.moe_reload import reloads_routed_experts

        baseline = _reset_peak_rss()
        start = time.perf_counter()
        waited = [0.0]
        arriving = self._arriving(update_info.buckets, waited)
        with disable_mtp_completeness_check():
            self.model.load_weights(arriving)
        for _ in arriving:  # a model that stopped reading early must still take every byte the trainer sends
            pass
        # Set only once every tensor is in: a partial push must not be repacked.
        self.experts_reloaded = reloads_routed_experts(name for _, tensors in update_info.buckets for name, *_ in tensors)
        load_s = time.perf_counter() - start - waited[0]
        self.stats = {"peak_extra_bytes": _peak_rss() - baseline, "wait_s": waited[0], "load_s": load_s}

    def _arriving(self, buckets: list[tuple[int, list]], waited: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) in the layout's order as each arrives, the next one's receive already posted;
        adds the time spent waiting for bytes to waited[0]."""
        receives = map(self._post_receive, (slot for _, tensors in buckets for slot in tensors))  # posted one at a time
        following = next(receives, None)
        untrimmed = 0
        while following is not None:
            (name, tensor, work), following = following, next(receives, None)  # the next one goes on the wire first
            if work is not None:
                start = time.perf_counter()
                work.wait()
                waited[0] += time.perf_counter() - start
            yield name, tensor
            untrimmed += tensor.nbytes
            del tensor  # the layer still loading holds its own reference until it is processed
            if untrimmed >= TRIM_EVERY_BYTES:
                # glibc keeps freed memory resident and, with several arenas, often allocates the next tensors
                # elsewhere: untrimmed, resident memory grew by about the model's size over a push (measured)
                _trim_heap()
                untrimmed = 0

    def _post_receive(self, slot: tuple[str, str, list[int], int, int]) -> tuple[str, torch.Tensor, Any]:
        """(name, a tensor of the slot's shape, its posted receive); no receive for a tensor of no bytes (none is sent)."""
        name, dtype, shape, _, nbytes = slot
        tensor = torch.empty(shape, dtype=torch_dtype(dtype))
        return name, tensor, self.group.broadcast(tensor.view(-1).view(torch.uint8), TRAINER_RANK) if nbytes else None

    def shutdown(self) -> None:
        """Leaves the group, if any."""
        self.group = None  # gloo closes its connections when the group is collected


def register_backend() -> None:
    """Puts this engine in vLLM's factory under BACKEND (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # the factory refuses a second registration
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, GlooWeightTransferEngine.__name__)


def _reset_peak_rss() -> int:
    """Resets this process's peak resident size to its current one (Linux); returns the current size in bytes.

    Freed heap first goes back to the system (glibc's malloc_trim): the buckets of an earlier push
    would otherwise still be resident, and this push's buckets would reuse them without raising the peak.
    """
    _trim_heap()
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then counts from the process's start
        pass
    return _status_bytes("VmRSS")


def _trim_heap() -> None:
    """Returns the heap's free memory to the system (glibc's malloc_trim; nothing elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
