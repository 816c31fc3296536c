"""Generation on a real vLLM-CPU rollout server: gRPC, HTTP and vLLM offline agree; logprobs match HF;
bad requests get clear errors; the queue bound answers 429 / RESOURCE_EXHAUSTED."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_harness import (
    MAX_MODEL_LEN, MAX_QUEUE, TOKEN, greedy_request, hf_greedy, hf_logprobs, load_hf_model, offline_vllm_generate,
    shared_servers, rollout_stub,
)
from services.common.auth import bearer_metadata
from services.common.pb import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.service

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61], [84, 104, 101, 32, 113, 117, 105, 99, 107]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def servers(request):
    return shared_servers(request)


@pytest.fixture(scope="module")
def hf_model(servers):
    return load_hf_model(servers.model_dir)


def http_completion(base: str, prompt, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt, **fields}, timeout=60)


def test_greedy_is_identical_over_grpc_http_and_offline_vllm(servers, hf_model):
    stub = rollout_stub(servers.a)
    grpc_ids = [list(stub.Generate(greedy_request(p, MAX_TOKENS)).completions[0].token_ids) for p in PROMPTS]
    again = [list(stub.Generate(greedy_request(p, MAX_TOKENS)).completions[0].token_ids) for p in PROMPTS]
    http_ids = []
    for p in PROMPTS:
        body = http_completion(servers.a.http_base, p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, return_token_ids=True).json()
        http_ids.append(body["choices"][0]["token_ids"])
    offline_ids = offline_vllm_generate(servers.model_dir, PROMPTS, MAX_TOKENS)
    assert all(len(ids) == MAX_TOKENS for ids in grpc_ids)
    assert grpc_ids == again, "greedy generation is not deterministic"
    assert grpc_ids == http_ids
    assert grpc_ids == offline_ids
    assert grpc_ids == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]


def test_streamed_tokens_equal_unary_ones(servers):
    stub = rollout_stub(servers.a)
    unary = stub.Generate(greedy_request(PROMPTS[0], MAX_TOKENS)).completions[0]
    chunks = list(stub.GenerateStream(greedy_request(PROMPTS[0], MAX_TOKENS)))
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx(list(unary.logprobs), abs=1e-6)
    assert chunks[-1].finish_reason == "length"


def test_logprobs_match_hf_recomputation(servers, hf_model):
    stub = rollout_stub(servers.a)
    for prompt in PROMPTS:
        completion = stub.Generate(greedy_request(prompt, MAX_TOKENS)).completions[0]
        expected = hf_logprobs(hf_model, prompt, list(completion.token_ids))
        assert list(completion.logprobs) == pytest.approx(expected, abs=1e-4)
        assert list(completion.versions) == [0] * MAX_TOKENS
    # sampled (temperature 1) tokens too: vLLM reports the raw model's log p of what it sampled
    sampled = stub.Generate(rollout_pb2.GenerateRequest(
        token_ids=rollout_pb2.TokenIds(ids=PROMPTS[1]),
        sampling=rollout_pb2.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, logprobs=1, n=2, seed=7, ignore_eos=True),
    ))
    assert len(sampled.completions) == 2
    for completion in sampled.completions:
        assert list(completion.logprobs) == pytest.approx(hf_logprobs(hf_model, PROMPTS[1], list(completion.token_ids)), abs=1e-4)


def test_text_prompt_and_info_and_health(servers):
    stub = rollout_stub(servers.a)
    response = stub.Generate(rollout_pb2.GenerateRequest(text="Hello", model="tiny", sampling=rollout_pb2.SamplingParams(temperature=0, max_tokens=4)))
    assert response.prompt_tokens == 5 and len(response.completions[0].token_ids) <= 4
    info = stub.GetInfo(rollout_pb2.GetInfoRequest())
    assert (info.model, info.max_queue, info.max_model_len) == ("tiny", MAX_QUEUE, MAX_MODEL_LEN)
    assert info.tokens_per_second > 0
    channel = grpc.insecure_channel(servers.a.grpc_target)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="dockrl.rollout.v1.Rollout"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(f"{servers.a.http_base}/health").status_code == 200  # vLLM's /health: 200, no body
    assert "dockrl_rollout_generated_tokens_total" in httpx.get(f"{servers.a.http_base}/metrics").text


@pytest.mark.parametrize("sampling, message", [
    (rollout_pb2.SamplingParams(temperature=-0.5), r"temperature: must be in \[0.0, 100.0\], got -0.5"),
    (rollout_pb2.SamplingParams(top_p=1.5), r"top_p: must be in \(0.0, 1.0\], got 1.5"),
    (rollout_pb2.SamplingParams(top_k=0), r"top_k: must be -1 \(off\) or >= 1, got 0"),
    (rollout_pb2.SamplingParams(max_tokens=500), r"max_tokens: must be in \[1, 123\] \(max_model_len 128 - 5 prompt tokens\), got 500"),
    (rollout_pb2.SamplingParams(n=2, temperature=0), r"n: must be 1 with temperature 0"),
])
def test_grpc_rejects_bad_sampling(servers, sampling, message):
    with pytest.raises(grpc.RpcError) as info:
        rollout_stub(servers.a).Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=PROMPTS[0]), sampling=sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert __import__("re").search(message, info.value.details()), info.value.details()


def test_grpc_rejects_oversize_prompt_and_unknown_model(servers):
    stub = rollout_stub(servers.a)
    with pytest.raises(grpc.RpcError, match=r"prompt: has 200 tokens; max_model_len is 128, so at most 127 fit") as info:
        stub.Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=[65] * 200)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError, match=r"model: 'gpt-9' is not served here; this server serves 'tiny'") as info:
        stub.Generate(rollout_pb2.GenerateRequest(text="hi", model="gpt-9"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError, match=r"prompt: token id 999 is outside the vocabulary \[0, 320\)"):
        stub.Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=[999])))


# vLLM's own answers (its app serves HTTP): each names the field in the message and in `param`
@pytest.mark.parametrize("fields, status, param, message", [
    ({"temperature": -1}, 400, "temperature", "temperature must be non-negative, got -1.0"),
    ({"temperature": "hot"}, 400, "body.temperature", "Input should be a valid number"),
    ({"max_tokens": 0}, 400, "max_tokens", "max_tokens must be at least 1, got 0"),
    ({"max_tokens": 500}, 400, "max_tokens", "max_tokens=500 cannot be greater than max_model_len=128"),
    ({"logprobs": 50}, 400, "logprobs", "Requested sample logprobs of 50, which is greater than max allowed: 20"),
    ({"prompt": "x" * 300}, 400, "input_tokens", "This model's maximum context length is 128 tokens"),
    ({"model": "gpt-9"}, 404, "model", "The model `gpt-9` does not exist"),
])
def test_http_rejects_bad_requests(servers, fields, status, param, message):
    response = httpx.post(f"{servers.a.http_base}/v1/completions", json={"model": "tiny", "prompt": "Hello", **fields}, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_queue_bound_answers_429_and_resource_exhausted(servers):
    """Six times the queue bound at once over HTTP and gRPC: the bound is admitted, the rest refused, then served."""
    burst = 3 * MAX_QUEUE  # per API
    body = {"model": "tiny", "prompt": [65] * 8, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    request = greedy_request([65] * 8, 120)

    async def grpc_call(stub):
        try:
            return await stub.Generate(request)
        except grpc.aio.AioRpcError as exc:
            return exc

    async def main():
        async with httpx.AsyncClient(base_url=servers.a.http_base, timeout=120) as client, \
                grpc.aio.insecure_channel(servers.a.grpc_target) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            calls = [client.post("/v1/completions", json=body) for _ in range(burst)] + [grpc_call(stub) for _ in range(burst)]
            results = await asyncio.gather(*calls)
            after = await client.post("/v1/completions", json={**body, "max_tokens": 2})
            return results[:burst], results[burst:], after

    http_results, grpc_results, after = asyncio.run(main())
    refused = [r for r in http_results if r.status_code == 429]
    exhausted = [r for r in grpc_results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in http_results if r.status_code == 200] + [r for r in grpc_results if not isinstance(r, grpc.aio.AioRpcError)]
    assert refused and exhausted, "nothing was refused past the queue bound"
    assert len(served) >= MAX_QUEUE and len(served) + len(refused) + len(exhausted) == 2 * burst
    bound = f"rollout.max_queue: {MAX_QUEUE} requests are waiting or running (limit {MAX_QUEUE}); retry later"
    assert all(bound in r.json()["error"]["message"] and r.headers["retry-after"] == "1" for r in refused)
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and bound in e.details() for e in exhausted)
    assert after.status_code == 200
    assert rollout_stub(servers.a).GetInfo(rollout_pb2.GetInfoRequest()).queue_depth == 0


def test_abort_needs_the_token_and_stops_a_request(servers):
    """The replica's engine is frozen before the request is sent, so no token of it can be generated and
    the Abort cannot race the request's end (CI's run of 6291e93 saw a 120-token request finish between
    its first streamed chunk and a freeze that came after it)."""
    stub = rollout_stub(servers.a)
    request_id = "abort-me"
    servers.a.freeze_engine()
    try:
        stream = stub.GenerateStream(rollout_pb2.GenerateRequest(
            request_id=request_id, token_ids=rollout_pb2.TokenIds(ids=PROMPTS[0]),
            sampling=rollout_pb2.SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
        ), timeout=120)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            chunks = pool.submit(list, stream)
            with pytest.raises(grpc.RpcError) as info:
                stub.Abort(rollout_pb2.AbortRequest(request_id=request_id))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # the request reaches the engine's table a moment after the stream opens: abort it once it is there
            deadline = time.monotonic() + 60
            while not stub.Abort(rollout_pb2.AbortRequest(request_id=request_id), metadata=bearer_metadata(TOKEN)).aborted:
                assert time.monotonic() < deadline, "the request never reached the replica's engine"
                time.sleep(0.05)
            servers.a.thaw_engine()
            chunks = chunks.result(timeout=60)
    finally:
        servers.a.thaw_engine()
    assert chunks and chunks[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in chunks) < 120
    assert not stub.Abort(rollout_pb2.AbortRequest(request_id=request_id), metadata=bearer_metadata(TOKEN)).aborted


def test_seeded_samples_whose_prompts_exceed_one_engine_step_are_served_and_repeat(servers):
    """80 seeded samples of a 110-token prompt: 8800 prompt tokens, more than one engine step's 8192.

    vLLM's CPU generators cannot rewind, so a seeded sample whose prompt an engine step would split
    killed the engine ("CPU Generator does not use offset"); every dock row carries a seed.
    """
    stub = rollout_stub(servers.a)
    request = rollout_pb2.GenerateRequest(
        token_ids=rollout_pb2.TokenIds(ids=[(7 * i) % 250 + 3 for i in range(110)]),
        sampling=rollout_pb2.SamplingParams(temperature=1.0, n=80, max_tokens=4, seed=11, ignore_eos=True))
    first = [list(c.token_ids) for c in stub.Generate(request, timeout=300).completions]
    again = [list(c.token_ids) for c in stub.Generate(request, timeout=300).completions]
    assert len(first) == 80 and all(len(ids) == 4 for ids in first)
    assert again == first  # the same seeds give the same samples
    assert len({tuple(ids) for ids in first}) > 1  # and each sample has its own
