"""gRPC `Reward` (Score, ListVerifiers) and grpc.health.v1 over the shared verifier pool and, when
reward_config.load is set, the reward model."""
from __future__ import annotations

import contextlib
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
from services.reward.code_tests import CODE_VERIFIER, code_sandbox
from services.reward.decoding import ResponseDecoder
from services.reward.model import MODEL_VERIFIER, ModelScorer, RewardModelScorer
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
                 model: ModelScorer | None = None, code_sandbox: bool = False):
        self._code_sandbox = code_sandbox  # whether the code verifier has a sandbox (reward.sandbox_address, or the run's own)
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
                     for v in REGISTRY.values() if v.name != CODE_VERIFIER or self._code_sandbox]
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
        if CODE_VERIFIER in names and not self._code_sandbox:
            raise InvalidArgument("verifier_function", f"{CODE_VERIFIER} runs programs in the sandbox service and this server "
                                                       "has none (reward.sandbox_address is empty and rl_config.verifier_function does not list it)")
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
        code_sandbox(cfg) is not None,
    )
    reward_pb2_grpc.add_RewardServicer_to_server(servicer, server)
    bound, health_servicer = start_with_health(server, host, port, SERVICE_NAME, "reward.grpc_port")
    log_event(logger, "reward server listening", host=host, port=bound, verifiers=",".join(cfg.rl_config.verifier_function))
    return RewardServer(server, bound, health_servicer)


def serve(cfg: Config, kind: str, dock: bool, host: str | None, port: int | None, ready_file: str | None) -> int:
    """`dockrl reward serve`: the gRPC server and, with `dock`, the `kind` dock worker on a thread of
    its own, until SIGINT / SIGTERM or the worker's failure; 1 when the worker failed, else 0.
    `host` / `port` None: reward.host / reward.grpc_port; `ready_file`: where to write the bound port."""
    import signal
    import threading

    from services.common.errors import FailedPrecondition
    from services.common.grpc_serving import advertised_address
    from services.common.log import setup_logging
    from services.common.ready_file import write_ready_file
    from services.reward.pool import VerifierPool
    from services.reward.worker import RewardWorker

    split = cfg.reward_config.model_replicas > 0
    if kind == "model" and not split:
        raise FailedPrecondition("--kind model: reward_config.model_replicas is 0, so every reward replica serves the reward "
                                 "model itself; set it > 0 to run reward-model replicas apart")
    run_log = setup_logging("reward-model" if kind == "model" else "reward")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # A rule replica of a split run loads no reward model: that is what the reward-model replicas are
    # for; its gRPC Score calls that list reward_model get that part from one of them.
    with (VerifierPool(cfg.rl_config.verifier_parallel, cfg.rl_config.verifier_timeout, code_sandbox(cfg)) as pool,
          reward_model(cfg, kind == "model" or not split) as model, _remote_model(cfg, kind == "rule" and split) as remote):
        # a bad dock config fails before serving
        worker = RewardWorker.from_config(cfg, pool, model, kind) if dock else None
        host = host or cfg.reward.host
        server = start_server(cfg, pool, host, cfg.reward.grpc_port if port is None else port, model or remote)
        if cfg.reward.metrics_port:
            import prometheus_client

            from services.common.metrics import REGISTRY

            prometheus_client.start_http_server(cfg.reward.metrics_port, addr=host, registry=REGISTRY)
        # the file first: whoever reads the line may look for the file at once
        if ready_file:
            write_ready_file(ready_file, grpc_port=server.port)
        print(f"reward server listening on {host}:{server.port}", flush=True)
        worker_thread, worker_failed = None, threading.Event()

        def run_worker() -> None:
            # A worker that dies must take the process down: a server that only answers gRPC would
            # stall the run where a supervisor (`dockrl up`, compose, k8s) can restart a dead one.
            try:
                worker.run_until(stop, advertised_address(host, server.port))
            except Exception:
                run_log.exception("reward dock worker failed; stopping the server")
                worker_failed.set()
                stop.set()

        if worker is not None:
            worker_thread = threading.Thread(target=run_worker, name="reward-dock-worker", daemon=True)
            worker_thread.start()
        stop.wait()
        log_event(run_log, "reward server stopping")
        server.stop()
        if worker_thread is not None:
            worker_thread.join(30)
    return 1 if worker_failed.is_set() else 0


@contextlib.contextmanager
def reward_model(cfg: Config, wanted: bool = True):
    """The reward model's engine when `wanted` and reward_config.load is set (else None), stopped on exit."""
    if not (wanted and cfg.reward_config.load):
        yield None
        return
    with RewardModelScorer.start(cfg) as model:
        yield model


@contextlib.contextmanager
def _remote_model(cfg, wanted: bool):
    """A rule replica's way to a split run's reward-model replicas (through the run's registry), or None."""
    if not wanted:
        yield None
        return
    from services.common.auth import resolve_token
    from services.dock.client import Dock
    from services.reward.client import RemoteRewardModel

    dock = Dock.from_config(cfg, token=resolve_token(cfg.auth))
    with RemoteRewardModel(dock.registry(cfg.rollout.heartbeat_ttl_s)) as remote:
        yield remote
