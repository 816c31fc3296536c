"""Dock worker mode on a real server and the shared Redis: the replica registers, claims prompts,
generates each sample over two partial-rollout claims and puts responses, logprobs and versions back."""
from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from rollout_harness import (
    DOCK_OVERRIDES, DOCK_PREFIX, DOCK_RUN, OVERRIDES, REDIS_URL, TOKEN, hf_greedy, hf_logprobs, load_hf_model,
    rollout_stub, shared_servers,
)
from services.common.config import load_config
from services.common.pb import rollout_pb2
from services.dock.client import Dock
from services.dock.registry import ReplicaRegistry
from services.dock.schema import DockLayout
from replica_launcher import spawn_replica

pytestmark = pytest.mark.service

EOS_IDS = (256, 258)
PROMPTS = [[49, 43, 50, 61], [72, 105], [55, 42, 56, 61], [97, 98, 99]]


@pytest.fixture(scope="module")
def servers(request):
    return shared_servers(request)


@pytest.fixture
def dock():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail(f"no Redis at {REDIS_URL}: start one with scripts/ensure_redis.sh")
    dock = Dock(client, DOCK_PREFIX, DOCK_RUN, TOKEN)
    yield dock
    dock.destroy()


def reference(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """HF greedy continuation, ending after the first EOS as vLLM's does."""
    out = hf_greedy(hf_model, prompt, max_tokens)
    ends = [i for i, t in enumerate(out) if t in EOS_IDS]
    return out[: ends[0] + 1] if ends else out


def test_dock_worker_fills_every_row_across_partial_claims(servers, dock):
    cfg = load_config(None, OVERRIDES + DOCK_OVERRIDES)
    max_tokens = cfg.generate_config.sampling_config.max_tokens
    n = cfg.rl_config.n_samples_per_prompt
    registry = ReplicaRegistry(dock.client, dock.keys)
    assert servers.b.grpc_target in [r.address for r in registry.live("rollout")]

    dock.create(DockLayout.from_config(cfg))
    groups = dock.begin_iteration(len(PROMPTS))[: len(PROMPTS)]
    rows = dock.rows_of(groups)
    prompts = [np.asarray(p, np.int32) for p in PROMPTS for _ in range(n)]
    dock.put(rows, {"prompts": prompts, "prompt_length": [len(p) for p in prompts]})
    deadline = time.monotonic() + 120
    while not dock.rollout_done():
        assert time.monotonic() < deadline, f"rollout did not finish: {dock.stats()}"
        time.sleep(0.2)

    got = dock.read(rows, ["responses", "response_length", "rollout_log_probs", "versions", "finish_reason"])
    version = rollout_stub(servers.b).GetInfo(rollout_pb2.GetInfoRequest()).version
    hf_model = load_hf_model(servers.model_dir)
    for i, prompt in enumerate(p for p in PROMPTS for _ in range(n)):
        response = [int(t) for t in got["responses"][i]]
        assert response == reference(hf_model, prompt, max_tokens), "a continued partial sample differs from one greedy decode"
        assert got["response_length"][i] == len(response)
        assert [float(x) for x in got["rollout_log_probs"][i]] == pytest.approx(hf_logprobs(hf_model, prompt, response), abs=1e-4)
        assert [int(v) for v in got["versions"][i]] == [version] * len(response)
        assert got["finish_reason"][i] == ("stop" if response[-1] in EOS_IDS else "length")
    assert max(len(r) for r in got["responses"]) > max_tokens // cfg.rl_config.partial_rollout_max_split, "no sample needed a second claim"


def test_sigterm_returns_unfinished_claims_and_deregisters(servers, tmp_path):
    """A replica stopped mid-claim leaves no row leased: each is finished or back in the pool."""
    run = f"{DOCK_RUN}-stop"
    long_rollout = ("rl_config.rollout_max_tokens=96", "generate_config.sampling_config.max_tokens=96",
                    f"dock.prefix={DOCK_PREFIX}", f"dock.run_id={run}", "rollout.heartbeat_ttl_s=3")
    cfg = load_config(None, OVERRIDES + long_rollout)
    dock = Dock(redis.Redis.from_url(REDIS_URL), DOCK_PREFIX, run, TOKEN)
    dock.create(DockLayout.from_config(cfg))
    groups = dock.begin_iteration(cfg.megatron_training.global_batch_size)
    rows = dock.rows_of(groups)[: cfg.rl_config.actor_rollout_dispatch_size]
    dock.put(rows, {"prompts": [np.asarray(PROMPTS[i % len(PROMPTS)], np.int32) for i in range(len(rows))]})
    replica = spawn_replica(servers.model_dir, tmp_path, "c", OVERRIDES + long_rollout, "tiny", {"OMP_NUM_THREADS": "1"},
                            extra_args=("--dock", REDIS_URL)).wait()
    try:
        registry = ReplicaRegistry(dock.client, dock.keys)
        assert replica.grpc_target in [r.address for r in registry.live("rollout")]
        deadline = time.monotonic() + 60
        while dock.stats().leased.get("actor_rollout", 0) == 0:
            assert time.monotonic() < deadline, "the replica never claimed"
            time.sleep(0.05)
        replica.stop()
        assert replica.proc.returncode == 0
        stats = dock.stats()
        assert stats.leased["actor_rollout"] == 0
        assert stats.consumed["actor_rollout"] == stats.ready["responses"], "a claimed row was neither finished nor returned"
        assert replica.grpc_target not in [r.address for r in registry.live("rollout")]
        again = dock.claim("actor_rollout", ["prompts"])  # the returned rows are claimable at once
        assert (len(again) if again else 0) == len(rows) - stats.ready["responses"]
    finally:
        replica.stop()
        dock.destroy()
