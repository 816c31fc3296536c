"""A bounded burst beyond `rollout.max_queue` on a real replica: the excess is refused fast (HTTP 429 /
gRPC RESOURCE_EXHAUSTED), memory stays bounded, and normal requests succeed afterwards."""
from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import httpx
import psutil
import pytest

from services.common.pb import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.service

BURST = 48  # requests sent at once, 12 times the replica's max_queue of 4
MAX_TOKENS = 48
RSS_GROWTH_LIMIT = 256 << 20
# The HTTP server shares its asyncio loop with vLLM's output handling, so on a busy 2-core box refusals come
# back between generation steps (about when the admitted requests finish), not at once; this bounds that wait.
REFUSAL_LIMIT_S = 5.0
PROMPT = [72, 101, 108, 108, 111]


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (vLLM's engine core is a child)."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


async def timed_post(client: httpx.AsyncClient, body: dict) -> tuple[int, float, dict]:
    start = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    return response.status_code, time.perf_counter() - start, {**response.json(), "retry_after": response.headers.get("retry-after")}


async def burst(base: str, n: int, body: dict) -> list[tuple[int, float, dict]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(timed_post(client, body) for _ in range(n)))


def test_http_burst_beyond_the_queue_is_refused_fast_and_memory_stays_bounded(rollout_servers, fault_log):
    replica = rollout_servers.a
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    rss_before = tree_rss(replica.proc.pid)
    results = asyncio.run(burst(replica.http_base, BURST, body))
    rss_after = tree_rss(replica.proc.pid)
    codes = [code for code, _, _ in results]
    refused = [(t, answer) for code, t, answer in results if code == 429]
    served = [t for code, t, _ in results if code == 200]
    tried = f"{BURST} concurrent /v1/completions ({MAX_TOKENS} tokens each) at max_queue 4"
    fault_log.check("rollout HTTP load", tried, "only 200 or 429, most of the burst 429",
                    f"{len(served)} x 200, {len(refused)} x 429, others {sorted(set(codes) - {200, 429})}",
                    set(codes) <= {200, 429} and len(refused) >= BURST // 2 and served)
    slowest_refusal = max(t for t, _ in refused)
    fault_log.check("rollout HTTP load", "how fast the 429s come back", f"each 429 within {REFUSAL_LIMIT_S} s",
                    f"429 min {min(t for t, _ in refused):.2f} s, median {statistics.median(t for t, _ in refused):.2f} s, max {slowest_refusal:.2f} s; "
                    f"200 median {statistics.median(served):.2f} s", slowest_refusal < REFUSAL_LIMIT_S)
    error, retry_after = refused[0][1]["error"], refused[0][1]["retry_after"]
    fault_log.check("rollout HTTP load", "the 429's body and headers", "vLLM's error shape naming rollout.max_queue, Retry-After",
                    f"type {error['type']!r}: {error['message']}; Retry-After {retry_after}",
                    error["type"] == "RateLimitError" and "max_queue" in error["message"] and retry_after == "1")
    growth = rss_after - rss_before
    fault_log.check("rollout HTTP load", "resident memory of the replica's process tree over the burst",
                    f"grows by less than {RSS_GROWTH_LIMIT >> 20} MiB",
                    f"{rss_before / 2**20:.0f} MiB -> {rss_after / 2**20:.0f} MiB ({growth / 2**20:+.0f} MiB)", growth < RSS_GROWTH_LIMIT)

    after = httpx.post(f"{replica.http_base}/v1/completions", json={**body, "max_tokens": 8}, timeout=60)
    info = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(replica.grpc_target)).GetInfo(rollout_pb2.GetInfoRequest())
    fault_log.check("rollout HTTP load", "a normal request right after the burst", "200 with 8 tokens, queue empty",
                    f"{after.status_code}, {len((after.json().get('choices') or [{}])[0].get('text', ''))} chars, queue_depth {info.queue_depth}",
                    after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8 and info.queue_depth == 0)


def test_grpc_burst_beyond_the_queue_is_resource_exhausted(rollout_servers, fault_log):
    replica = rollout_servers.a
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(replica.grpc_target))
    request = rollout_pb2.GenerateRequest(
        token_ids=rollout_pb2.TokenIds(ids=PROMPT),
        sampling=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    calls = [stub.Generate.future(request, timeout=120) for _ in range(16)]
    codes = []
    for call in calls:
        try:
            call.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    counts = {code.name: codes.count(code) for code in set(codes)}
    fault_log.check("rollout gRPC load", "16 concurrent Generate calls at max_queue 4", "OK or RESOURCE_EXHAUSTED only, some of each",
                    str(counts), set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED})
    after = stub.Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=PROMPT),
                                                      sampling=rollout_pb2.SamplingParams(max_tokens=4, ignore_eos=True)))
    fault_log.check("rollout gRPC load", "Generate right after the burst", "4 tokens", f"{len(after.completions[0].token_ids)} tokens",
                    len(after.completions[0].token_ids) == 4)
