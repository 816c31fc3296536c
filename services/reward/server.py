"""gRPC `Reward` (Score, ListVerifiers) and grpc.health.v1 over the shared verifier pool and, when
reward_config.load is set, the reward model."""
from __future__ import annotations

import logging
import math
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from services.common.config import Config
from services.common.errors import DockrlError, InvalidArgument
from services.common.grpc_status import StatusInterceptor
from services.common.grpc_serving import start_with_health
from services.common.log import log_event
from services.common.metrics import counter, histogram
from services.common.pb import reward_pb2, reward_pb2_grpc
from services.reward.decoding import ResponseDecoder
from services.reward.model import MODEL_VERIFIER, ModelScorer
from services.reward.pool import VerifierRunner
from services.reward.scoring import SampleScore, ScoreInput, ScoringPlan, score_samples
from services.reward.verifiers import REGISTRY

logger = logging.getLogger("dockrl.reward.server")

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
SAMPLES_SCORED = counter("reward_samples_scored_total", "samples scored through gRPC")
SCORE_SECONDS = histogram("reward_score_seconds", "wall time of one Score call")


@dataclass(frozen=True)
class RequestLimits:
    """What one Score request may hold (the reward config section)."""

    max_items: int
    max_response_chars: int


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Validates a request, scores it through the runner (and the reward model when asked for),
    answers per-sample totals and parts."""

    def __init__(self, default_plan: ScoringPlan, runner: VerifierRunner, decoder: ResponseDecoder, limits: RequestLimits,
                 model: ModelScorer | None = None):
        self._default_plan = default_plan
        self._runner = runner
        self._decoder = decoder
        self._limits = limits
        self._model = model

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        started = time.perf_counter()
        try:
            plan = self._plan(request)
            inputs = [self._input(i, item, plan) for i, item in enumerate(self._items(request))]
            scored = score_samples(inputs, plan, self._runner, self._model)
        except DockrlError as exc:  # the status interceptor answers with its code
            log_event(logger, "score refused", logging.INFO, reason=str(exc))
            raise
        SAMPLES_SCORED.inc(len(scored))
        SCORE_SECONDS.observe(time.perf_counter() - started)
        return reward_pb2.ScoreResponse(results=[_result_pb(s) for s in scored])

    def ListVerifiers(self, request, context) -> reward_pb2.ListVerifiersResponse:
        verifiers = [reward_pb2.VerifierInfo(name=v.name, description=v.description, timeout_score=v.timeout_score)
                     for v in REGISTRY.values()]
        if self._model is not None:
            verifiers.append(reward_pb2.VerifierInfo(
                name=MODEL_VERIFIER, description="the reward model's score of prompt + response (reward_config.load)"))
        return reward_pb2.ListVerifiersResponse(verifiers=verifiers)

    def _plan(self, request: reward_pb2.ScoreRequest) -> ScoringPlan:
        """The request's verifiers and weights (1.0 each when only names are given), else the config's."""
        names, weights = list(request.verifier_function), list(request.verifier_weight)
        if not names:
            if weights:
                raise InvalidArgument("verifier_weight", "given without verifier_function")
            return self._default_plan
        for i, w in enumerate(weights):
            if not math.isfinite(w):
                raise InvalidArgument(f"verifier_weight[{i}]", f"must be a finite number, got {w}")
        return ScoringPlan.create(names, weights or [1.0] * len(names), self._default_plan.overlong)

    def _items(self, request: reward_pb2.ScoreRequest):
        if not request.items:
            raise InvalidArgument("items", "is empty; give at least one item to score")
        if len(request.items) > self._limits.max_items:
            raise InvalidArgument(
                "items", f"{len(request.items)} items; at most {self._limits.max_items} per request (reward.max_items)"
            )
        return request.items

    def _input(self, i: int, item: reward_pb2.ScoreItem, plan: ScoringPlan) -> ScoreInput:
        """One item as text + length: ids decoded, the length derived when 0 and the penalty needs it."""
        field = f"items[{i}]"
        if item.response and item.response_token_ids:
            raise InvalidArgument(field, "give response or response_token_ids, not both")
        if item.response_length < 0:
            raise InvalidArgument(f"{field}.response_length", f"must be >= 0, got {item.response_length}")
        length = item.response_length
        if item.response_token_ids:
            text = self._decode(f"{field}.response_token_ids", item.response_token_ids)
            length = length or len(item.response_token_ids)
        else:
            text = item.response
            if length == 0 and plan.overlong.enabled and text:
                if not self._decoder.available:
                    raise InvalidArgument(
                        f"{field}.response_length", "required: the overlong penalty is on and this server has no tokenizer"
                    )
                length = self._decoder.count_tokens(text)
        if len(text) > self._limits.max_response_chars:
            raise InvalidArgument(
                f"{field}.response",
                f"{len(text)} characters; at most {self._limits.max_response_chars} (reward.max_response_chars)",
            )
        if len(item.prompt) > self._limits.max_response_chars:
            raise InvalidArgument(
                f"{field}.prompt",
                f"{len(item.prompt)} characters; at most {self._limits.max_response_chars} (reward.max_response_chars)",
            )
        return ScoreInput(text, item.label, length, item.prompt)

    def _decode(self, field: str, ids) -> str:
        if not self._decoder.available:
            raise InvalidArgument(field, "this server has no tokenizer (megatron_training.tokenizer_name_or_path); send response text")
        vocab = self._decoder.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(field, f"token id {bad} is outside the tokenizer's vocabulary [0, {vocab})")
        return self._decoder.decode(ids)


def _result_pb(score: SampleScore) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        score=score.total,
        overlong_penalty=score.overlong_penalty,
        parts=[reward_pb2.VerifierPart(name=p.name, score=p.score, timed_out=p.timed_out) for p in score.parts],
    )


@dataclass
class RewardServer:
    """A started gRPC server and the port it bound."""

    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace_s: float = 2.0) -> None:
        """Reports NOT_SERVING, then stops within `grace_s`."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_server(cfg: Config, runner: VerifierRunner, host: str, port: int, model: ModelScorer | None = None) -> RewardServer:
    """Starts Reward and health on host:port (0 asks the OS for a free port); `model` serves `reward_model`."""
    rc = cfg.reward
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=rc.server_threads, thread_name_prefix="reward-grpc"),
        interceptors=[StatusInterceptor()],
        options=[("grpc.max_receive_message_length", rc.max_request_mb * 1024 * 1024)],
    )
    servicer = RewardServicer(
        ScoringPlan.from_rl_config(cfg.rl_config),
        runner,
        ResponseDecoder(cfg.megatron_training.tokenizer_name_or_path),
        RequestLimits(rc.max_items, rc.max_response_chars),
        model,
    )
    reward_pb2_grpc.add_RewardServicer_to_server(servicer, server)
    bound, health_servicer = start_with_health(server, host, port, SERVICE_NAME, "reward.grpc_port")
    log_event(logger, "reward server listening", host=host, port=bound, verifiers=",".join(cfg.rl_config.verifier_function))
    return RewardServer(server, bound, health_servicer)
