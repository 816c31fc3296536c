"""A vLLM worker extension that stages a weight push and applies it in one reload.

vLLM mixes this class into its worker (`worker_extension_cls`), so `self.model_runner` is the
worker's model runner. Buckets arrive through `collective_rpc` as raw bytes plus metadata
(tensors would arrive as lists); they are kept as tensors until `commit_staged`, which hands all
of them to `model_runner.reload_weights` at once: vLLM fuses q/k/v and gate/up projections and
re-packs CPU GEMM weights after loading, so a fused layer must see all of its parts in one reload
(and MoE experts on the CPU are re-packed here: services.rollout.moe_reload).

vLLM imports this module in each worker process before the model loads, which is where its
weight-transfer factory must know the collective path's gloo backend: importing registers it.
"""
from __future__ import annotations

import logging

from services.rollout.gloo_transfer import register_backend

register_backend()


class _RotaryCacheNotice(logging.Filter):
    """Drops vLLM's `RotaryEmbedding: Failed to load weights`, logged at every push. The layer holds only its
    cos/sin cache, a buffer computed at start that no checkpoint carries; vLLM's layerwise reload counts it as
    loadable (reload/utils.py get_layer_size) and, finding it absent, puts the same buffer back. The cause is in
    vLLM; any other layer's failure to load still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryCacheNotice())


class WeightStagingExtension:
    """collective_rpc methods: stage_bucket, commit_staged, discard_staged, weight_transfer_stats, and for EPLB
    start_expert_counting, expert_counts (services.rollout.expert_counter), and for routing replay start_routing_record,
    take_routed_experts (services.rollout.routing_recorder)."""

    def stage_bucket(self, data: bytes, tensors: list[tuple[str, str, list[int], int, int]]) -> int:
        """Keeps the bucket's tensors (name, dtype, shape, offset, nbytes) for the next commit; returns how many are staged."""
        import warnings

        import torch

        from services.common.weight_wire import torch_dtype

        staged = self.__dict__.setdefault("_dockrl_staged", [])
        with warnings.catch_warnings():
            # the tensors only ever get read (reload copies them into the parameters), so they may
            # alias the read-only message bytes instead of a copy
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for name, dtype_name, shape, offset, nbytes in tensors:
                dtype = torch_dtype(dtype_name)
                flat = torch.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
                staged.append((name, flat.reshape(shape)))
        return len(staged)

    def commit_staged(self) -> int:
        """Loads every staged tensor into the model in place; returns how many were loaded."""
        from services.rollout.moe_reload import reloads_routed_experts, repack_cpu_moe_experts

        staged = self.__dict__.pop("_dockrl_staged", [])
        self.model_runner.reload_weights(weights_iterator=iter(staged))
        if reloads_routed_experts(name for name, _ in staged):
            repack_cpu_moe_experts(self.model_runner.model)
        return len(staged)

    def discard_staged(self) -> int:
        """Drops a staged push that will not be applied; returns how many tensors were dropped."""
        return len(self.__dict__.pop("_dockrl_staged", []))

    def weight_transfer_stats(self) -> dict:
        """The last collective transfer's peak_extra_bytes (resident memory above the worker's level at its start),
        wait_s (waiting for the buckets' bytes) and load_s (loading and processing them)."""
        return self.weight_transfer_engine.stats

    def start_expert_counting(self) -> tuple[int, int]:
        """Starts counting the tokens routed to each expert; returns (MoE layers, experts per layer), (0, 0) if dense.

        Called once the engine has started, so vLLM's start-up dummy runs are not counted.
        """
        from services.rollout.expert_counter import ExpertCounter

        counter = self.__dict__["_dockrl_expert_counter"] = ExpertCounter()
        return counter.attach(self.model_runner.model)

    def expert_counts(self) -> list[list[int]]:
        """Tokens routed to each expert since start_expert_counting, as [MoE layer][expert]."""
        return self.__dict__["_dockrl_expert_counter"].read()

    def start_routing_record(self) -> tuple[int, int]:
        """Starts recording each dock request's routed experts (after start_expert_counting, whose hook it keeps);
        returns (MoE layers, top-k), (0, 0) if dense."""
        from services.rollout.routing_recorder import RoutingRecorder

        recorder = self.__dict__["_dockrl_routing_recorder"] = RoutingRecorder(self.model_runner)
        return recorder.attach(self.model_runner.model)

    def take_routed_experts(self, request_id: str) -> tuple[bytes, list[int]]:
        """The routed experts recorded for `request_id`, removed: uint8 bytes and shape [positions, layers, top_k]."""
        return self.__dict__["_dockrl_routing_recorder"].take(request_id)
