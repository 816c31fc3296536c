"""With a token configured, every call that changes state is refused without it and accepted with it;
reads keep working without it. Real rollout replica (token set via --set auth.token) and Trainer service."""
from __future__ import annotations

import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rollout_harness import TOKEN as ROLLOUT_TOKEN

from services.common.auth import bearer_metadata
from services.common.pb import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.service

TRAINER_TOKEN = "trainer-security-token"
WITHOUT = {"no token": (), "a wrong token": bearer_metadata("not-the-token"), "a non-Bearer header": (("authorization", "Basic eA=="),)}
# POST routes of the rollout server (vLLM's app) that change nothing but the caller's own output; every
# other POST must be refused without the token. A route vLLM adds later is refused until it is listed here.
OPEN_HTTP_POSTS = {
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses", "/v1/messages",
    "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/ping", "/invocations", "/generative_scoring",
}


def code_of(call) -> grpc.StatusCode:
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


@pytest.fixture(scope="module")
def rollout(rollout_servers):
    channel = grpc.insecure_channel(rollout_servers.a.grpc_target)
    yield rollout_servers.a, rollout_pb2_grpc.RolloutStub(channel), channel
    channel.close()


def test_rollout_update_weights_needs_the_token(rollout, fault_log):
    _, stub, _ = rollout
    version = stub.GetInfo(rollout_pb2.GetInfoRequest()).version
    chunk = rollout_pb2.WeightChunk(version=version + 7, num_buckets=0)  # past auth it is refused as malformed
    for what, metadata in WITHOUT.items():
        code = code_of(lambda: stub.UpdateWeights(iter([chunk]), metadata=metadata, timeout=30))
        fault_log.check("rollout auth", f"UpdateWeights with {what}", "UNAUTHENTICATED, version unchanged",
                        f"{code.name}, version {stub.GetInfo(rollout_pb2.GetInfoRequest()).version}",
                        code == grpc.StatusCode.UNAUTHENTICATED and stub.GetInfo(rollout_pb2.GetInfoRequest()).version == version)
    code = code_of(lambda: stub.UpdateWeights(iter([chunk]), metadata=bearer_metadata(ROLLOUT_TOKEN), timeout=30))
    fault_log.check("rollout auth", "UpdateWeights with the token (a malformed push)", "past auth: INVALID_ARGUMENT for the push itself",
                    code.name, code == grpc.StatusCode.INVALID_ARGUMENT)


def test_rollout_collective_weight_rpcs_need_the_token(rollout, fault_log):
    # each would join a group, open or finish a transfer; past auth each request is refused as malformed
    _, stub, _ = rollout
    calls = {
        "JoinWeightGroup": lambda metadata: stub.JoinWeightGroup(rollout_pb2.JoinWeightGroupRequest(), metadata=metadata, timeout=30),
        "OpenWeightTransfer": lambda metadata: stub.OpenWeightTransfer(rollout_pb2.OpenWeightTransferRequest(), metadata=metadata, timeout=30),
        "FinishWeightTransfer": lambda metadata: stub.FinishWeightTransfer(
            rollout_pb2.FinishWeightTransferRequest(version=-1), metadata=metadata, timeout=30),
    }
    for rpc, call in calls.items():
        codes = {what: code_of(lambda: call(metadata)) for what, metadata in WITHOUT.items()}
        with_token = code_of(lambda: call(bearer_metadata(ROLLOUT_TOKEN)))
        fault_log.check("rollout auth", f"{rpc} with no token, a wrong token, a non-Bearer header; then with the token",
                        "UNAUTHENTICATED each time without it; with it, past auth (refused for the request itself)",
                        f"{sorted({c.name for c in codes.values()})}; with the token {with_token.name}",
                        set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}
                        and with_token in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION))


STREAM_N, STREAM_TOKENS = 64, 124  # ~8k tokens: ~2 s on a quiet machine (8 x 124 ended before the Abort once)
ABORT_TRIES = 3


class LongStream:
    """A GenerateStream of STREAM_N completions x STREAM_TOKENS tokens read on a thread: long enough to abort mid-way."""

    def __init__(self, stub, request_id: str):
        self.chunks: list[rollout_pb2.GenerateChunk] = []
        self.error = ""
        self.started = threading.Event()
        request = rollout_pb2.GenerateRequest(request_id=request_id, token_ids=rollout_pb2.TokenIds(ids=[1, 2, 3]),
                                              sampling=rollout_pb2.SamplingParams(temperature=1.0, n=STREAM_N, max_tokens=STREAM_TOKENS,
                                                                                                ignore_eos=True))
        self.thread = threading.Thread(target=self._read, args=(stub, request))
        self.thread.start()
        assert self.started.wait(60)

    def _read(self, stub, request) -> None:
        try:
            for chunk in stub.GenerateStream(request, timeout=120):
                self.chunks.append(chunk)
                self.started.set()
        except grpc.RpcError as exc:  # shown in the finish reasons, so a failed check says why the stream ended
            self.error = exc.code().name
            self.started.set()

    def finish_reasons(self) -> set[str]:
        self.thread.join(120)
        return {c.finish_reason for c in self.chunks if c.finish_reason} | ({f"error {self.error}"} if self.error else set())


def test_rollout_abort_needs_the_token(rollout, fault_log):
    _, stub, _ = rollout
    running = LongStream(stub, "security-abort-refused")
    for what, metadata in WITHOUT.items():
        code = code_of(lambda: stub.Abort(rollout_pb2.AbortRequest(request_id="security-abort-refused"), metadata=metadata))
        fault_log.check("rollout auth", f"Abort of a running request with {what}", "UNAUTHENTICATED", code.name,
                        code == grpc.StatusCode.UNAUTHENTICATED)
    reasons = running.finish_reasons()
    fault_log.check("rollout auth", "the request those Aborts named", "runs to its end (finish_reason 'length')", str(sorted(reasons)),
                    reasons == {"length"})
    # A stream can end (~2 s) before an Abort sent after its first chunk is served when the machine is
    # loaded; only such a race earns another try, with a fresh request.
    for attempt in range(1, ABORT_TRIES + 1):
        running = LongStream(stub, f"security-abort-accepted-{attempt}")
        answer = stub.Abort(rollout_pb2.AbortRequest(request_id=f"security-abort-accepted-{attempt}"), metadata=bearer_metadata(ROLLOUT_TOKEN))
        reasons = running.finish_reasons()
        generated = sum(len(c.token_ids) for c in running.chunks)
        if answer.aborted or reasons != {"length"}:
            break
    fault_log.check("rollout auth", "Abort of a running request with the token", "aborted: finish_reason 'abort'",
                    f"aborted={answer.aborted}, finish reasons {sorted(reasons)} after {generated} of {STREAM_N} x {STREAM_TOKENS} tokens"
                    f" (try {attempt} of {ABORT_TRIES})",
                    answer.aborted and "abort" in reasons and generated < STREAM_N * STREAM_TOKENS)


def test_rollout_reads_need_no_token(rollout, fault_log):
    replica, stub, channel = rollout
    completion = stub.Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=[1, 2]),
                                                           sampling=rollout_pb2.SamplingParams(max_tokens=3, ignore_eos=True))).completions[0]
    info = stub.GetInfo(rollout_pb2.GetInfoRequest())
    serving = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    fault_log.check("rollout auth", "gRPC Generate, GetInfo, health without a token", "answered",
                    f"{len(completion.token_ids)} tokens; model {info.model!r}; health {health_pb2.HealthCheckResponse.ServingStatus.Name(serving)}",
                    len(completion.token_ids) == 3 and info.model == "tiny" and serving == health_pb2.HealthCheckResponse.SERVING)
    with httpx.Client(base_url=replica.http_base, timeout=60) as http:
        codes = {
            "POST /v1/completions": http.post("/v1/completions", json={"model": "tiny", "prompt": "1+1=", "max_tokens": 3}).status_code,
            "POST /v1/chat/completions": http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).status_code,
            "GET /v1/models": http.get("/v1/models").status_code,
            "GET /health": http.get("/health").status_code,
            "GET /metrics": http.get("/metrics").status_code,
            "GET /v1/policy_version": http.get("/v1/policy_version").status_code,
            "POST /tokenize": http.post("/tokenize", json={"model": "tiny", "prompt": "1+1="}).status_code,
        }
        paths = http.get("/openapi.json").json()["paths"]
        posts = sorted(path for path, methods in paths.items() if "post" in methods)
        # the body is never read without the token: an empty one shows the refusal is the middleware's
        refused = {path: http.post(path.replace("{response_id}", "resp-x"), json={}).status_code for path in posts if path not in OPEN_HTTP_POSTS}
        past_auth = {path: http.post(path.replace("{response_id}", "resp-x"), json={}, headers={"authorization": f"Bearer {ROLLOUT_TOKEN}"}).status_code
                     for path in refused}
    fault_log.check("rollout auth", "HTTP reads and generation without a token", "200 each", str(codes), set(codes.values()) == {200})
    fault_log.check("rollout auth", "HTTP POST routes outside the open list (abort, cancel, scaling, ...) without a token",
                    "401 each", str(refused), refused and set(refused.values()) == {401})
    fault_log.check("rollout auth", "the same routes with the token", "past auth: no 401", str(past_auth), 401 not in past_auth.values())


@pytest.fixture(scope="module")
def trainer():
    from services.trainer.loop.control import TrainerControl
    from services.trainer.loop.server import start_server

    control = TrainerControl(train_iters=5)
    server, port = start_server(control, "127.0.0.1", 0, token=TRAINER_TOKEN)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield control, trainer_pb2_grpc.TrainerStub(channel)
    channel.close()
    server.stop(grace=None).wait()


def test_trainer_pause_resume_checkpoint_need_the_token(trainer, fault_log):
    control, stub = trainer
    calls = {"Pause": lambda md: stub.Pause(trainer_pb2.PauseRequest(), metadata=md),
             "Resume": lambda md: stub.Resume(trainer_pb2.ResumeRequest(), metadata=md),
             "Checkpoint": lambda md: stub.Checkpoint(trainer_pb2.CheckpointRequest(), metadata=md)}
    for name, call in calls.items():
        for what, metadata in WITHOUT.items():
            code = code_of(lambda: call(metadata))
            fault_log.check("trainer auth", f"{name} with {what}", "UNAUTHENTICATED, run state unchanged",
                            f"{code.name}, paused={control.paused}", code == grpc.StatusCode.UNAUTHENTICATED and not control.paused)
    token = bearer_metadata(TRAINER_TOKEN)
    paused = stub.Pause(trainer_pb2.PauseRequest(), metadata=token).paused
    status = stub.Status(trainer_pb2.StatusRequest())  # a read: no token
    fault_log.check("trainer auth", "Pause with the token, then Status without one", "paused; Status answers paused=True",
                    f"Pause -> paused={paused}; Status.paused={status.paused}", paused and status.paused and control.paused)
    stub.Resume(trainer_pb2.ResumeRequest(), metadata=token)
    fault_log.check("trainer auth", "Resume with the token", "not paused", f"paused={control.paused}", not control.paused)
    code = code_of(lambda: stub.Checkpoint(trainer_pb2.CheckpointRequest(), metadata=token))
    fault_log.check("trainer auth", "Checkpoint with the token before a model is loaded", "past auth: FAILED_PRECONDITION",
                    code.name, code == grpc.StatusCode.FAILED_PRECONDITION)
