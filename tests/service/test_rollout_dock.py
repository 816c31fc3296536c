"""Dock worker mode on a real server and the shared Redis: the replica registers, claims prompts,
generates each sample over two partial-rollout claims and puts responses, logprobs and versions back."""
from __future__ import annotations

import re
import time

import httpx
import numpy as np
import pytest
import redis
import torch
from safetensors.torch import load_file

from push_chunks import weight_chunks
from rollout_harness import (
    DOCK_OVERRIDES, DOCK_PREFIX, DOCK_RUN, OVERRIDES, REDIS_URL, TOKEN, greedy_request, hf_greedy, hf_logprobs,
    load_hf_model, rollout_stub, shared_servers,
)
from services.common.auth import bearer_metadata
from services.common.config import InitModelConfig, load_config
from services.common.tiny_model import build_tiny_model
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


def metric(http: httpx.Client, replica, name: str) -> float:
    """One unlabelled series of the replica's /metrics (0 before it is first counted).

    `http` is one client for the whole test: `httpx.get` builds a client, and with it an SSL context
    (OpenSSL parsing the CA bundle, about 50 ms of CPU), on every call. While the replica's engine
    processes spin on both cores, that took this test's process 3-8 s per poll, and the rows it
    waited to see generating had finished by then.
    """
    found = re.search(rf"^{name} (\S+)$", http.get(f"{replica.http_base}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_rows_in_flight_stop_at_the_target_go_back_partial_and_resume_oldest_first(tmp_path):
    """Interruptible partial rollout: once the iteration's target of complete groups is reached (here by
    another worker's puts), the replica aborts its rows in flight and puts them back with the tokens they
    got; the next iteration resumes them before a fresh prompt and finishes them on the same response."""
    run = f"{DOCK_RUN}-interrupt"
    # Greedy on a random model reaches no EOS: each row runs to its budget. The demo's model decodes a round of
    # 240 tokens in about 0.1 s, faster than the test can see tokens and reach the target, so this replica
    # serves a wider, deeper model with room for 800-token rounds (several seconds): its rows are still
    # running when the target is reached. Without require_max_age_all_finished a group cut at the last
    # split's age waits for the next iteration too.
    max_tokens, split = 1600, 2
    model = build_tiny_model(tmp_path / "model", InitModelConfig(hidden_size=256, num_layers=4, num_attention_heads=4,
                                                                 intermediate_size=768, max_position_embeddings=2048))
    overrides = (f"dock.prefix={DOCK_PREFIX}", f"dock.run_id={run}", "rollout.heartbeat_ttl_s=3",
                 "rl_config.n_samples_per_prompt=2", "rl_config.actor_rollout_dispatch_size=2",
                 f"rl_config.partial_rollout_max_split={split}", "rl_config.require_max_age_all_finished=false",
                 f"rl_config.rollout_max_tokens={max_tokens}", f"generate_config.sampling_config.max_tokens={max_tokens}",
                 "generate_config.max_model_len=1700", "generate_config.sampling_config.temperature=0.0")
    cfg = load_config(None, OVERRIDES + overrides)
    n = cfg.rl_config.n_samples_per_prompt
    dock = Dock(redis.Redis.from_url(REDIS_URL), DOCK_PREFIX, run, TOKEN)
    dock.create(DockLayout.from_config(cfg))
    replica = spawn_replica(model, tmp_path, "interrupt", OVERRIDES + overrides, "tiny", {"OMP_NUM_THREADS": "1"},
                            extra_args=("--dock", REDIS_URL)).wait()
    http = httpx.Client(timeout=10)
    try:
        # The engine is frozen while the test looks (the replica's API process and dock worker keep running), so the
        # rows cannot finish their round unseen however slowly this process is scheduled: it runs in short steps until
        # the rows have tokens, and resumes only once the worker has seen the target and put them back.
        replica.freeze_engine()
        groups = dock.begin_iteration(2)[:3]  # a target of 2 complete groups; 3 prompts in the pool
        rows = dock.rows_of(groups)
        dock.put(rows, {"prompts": [np.asarray(PROMPTS[i // n], np.int32) for i in range(len(rows))]})
        other = dock.claim("actor_rollout", ["prompts"], count=2 * n, group=False, timeout_s=5)  # another worker's
        held = sorted(set(rows) - set(other.indexes))
        assert len(held) == n, other.indexes  # one group left: the replica's claim
        replica.step_engine_until(lambda: metric(http, replica, "dockrl_rollout_generated_tokens_total") >= 8)
        done = len(other)
        dock.put(other.indexes, {"responses": [np.asarray([7, 256], np.int32)] * done,
                                 "rollout_log_probs": [np.asarray([-1.0, -1.0], np.float32)] * done,
                                 "versions": [np.asarray([0, 0], np.int32)] * done,
                                 "response_length": [2] * done, "finish_reason": ["stop"] * done},
                 lease=other.lease, version=0)
        assert dock.rollout_done()
        deadline = time.monotonic() + 60
        while dock.stats().leased.get("actor_rollout", 0):  # the worker sees the target, aborts its rows, puts them back
            assert time.monotonic() < deadline, f"rows in flight were not given back: {dock.stats()}"
            time.sleep(0.05)
        replica.thaw_engine()
        stats = dock.stats()
        assert stats.ready["responses"] == done, "an interrupted row was put as finished"
        assert stats.groups_by_age.get(1) == 1, stats.groups_by_age  # the interrupted group, age + 1
        cut = dock.read(held, ["responses", "versions"])
        lengths = [len(r) for r in cut["responses"]]
        assert all(0 < k < max_tokens // split for k in lengths), f"not stopped mid-budget: {lengths}"
        assert all(len(v) == k and set(int(x) for x in v) == {0} for v, k in zip(cut["versions"], lengths))
        assert metric(http, replica, "dockrl_rollout_rows_interrupted_total") == 2

        # Next iteration (the trainer took and trained the complete groups): a target of 1 with a fresh prompt
        # beside the interrupted group. The older group is resumed and finished; the fresh one is not started.
        trained = dock.claim("actor_train", ["responses"], count=2 * n)
        dock.ack(trained.lease, trained.indexes)
        fresh = dock.rows_of(dock.begin_iteration(1)[:1])
        dock.put(fresh, {"prompts": [np.asarray(PROMPTS[3], np.int32)] * n})
        deadline = time.monotonic() + 120
        while not dock.rollout_done():
            assert time.monotonic() < deadline, f"the interrupted group was not finished: {dock.stats()}"
            time.sleep(0.1)
        got = dock.read(held + fresh, ["responses", "finish_reason"])
        for i, k in enumerate(lengths):
            response = [int(t) for t in got["responses"][i]]
            reason = got["finish_reason"][i]  # this model may reach EOS before the budget
            assert (reason == "length" and len(response) == max_tokens) or (reason == "stop" and k < len(response) < max_tokens), \
                (reason, len(response))
            assert response[:k] == [int(t) for t in cut["responses"][i]], "the resumed response does not continue the cut one"
        assert got["responses"][2] is None and got["responses"][3] is None, "a fresh prompt was started before the older group"
    finally:
        http.close()
        replica.stop()
        dock.destroy()


def test_a_synchronous_row_that_a_push_overtakes_goes_back_and_comes_again_under_the_new_version(tmp_path):
    """Synchronous whole-response rows come from vLLM as one output each (no per-token deltas), so a row's
    tokens cannot be told apart by version; a push that lands while rows run (a replica that lagged, caught up
    by the trainer) sends their groups back, and they are generated again under the new weights: every token
    of a row comes from the version it is labelled with."""
    run, max_tokens = f"{DOCK_RUN}-overtaken", 600
    model = build_tiny_model(tmp_path / "model", InitModelConfig(hidden_size=256, num_layers=4, num_attention_heads=4,
                                                                 intermediate_size=768, max_position_embeddings=2048))
    overrides = (f"dock.prefix={DOCK_PREFIX}", f"dock.run_id={run}", "rollout.heartbeat_ttl_s=3",
                 "rl_config.n_samples_per_prompt=2", f"rl_config.rollout_max_tokens={max_tokens}",
                 f"generate_config.sampling_config.max_tokens={max_tokens}", "generate_config.max_model_len=700",
                 "generate_config.sampling_config.temperature=0.0")
    cfg = load_config(None, OVERRIDES + overrides)
    dock = Dock(redis.Redis.from_url(REDIS_URL), DOCK_PREFIX, run, TOKEN)
    dock.create(DockLayout.from_config(cfg))
    replica = spawn_replica(model, tmp_path, "overtaken", OVERRIDES + overrides, "tiny", {"OMP_NUM_THREADS": "1"},
                            extra_args=("--dock", REDIS_URL)).wait()
    try:
        stub = rollout_stub(replica)
        before = stub.GetInfo(rollout_pb2.GetInfoRequest()).version
        rows = dock.rows_of(dock.begin_iteration(2)[:2])
        prompts = [PROMPTS[i // 2] for i in range(len(rows))]
        dock.put(rows, {"prompts": [np.asarray(p, np.int32) for p in prompts]})
        deadline = time.monotonic() + 60
        while dock.stats().leased.get("actor_rollout", 0) == 0:
            assert time.monotonic() < deadline, "the replica never claimed"
            time.sleep(0.01)
        time.sleep(0.5)  # its rows are generating: 600 tokens of this model take seconds
        gen = torch.Generator().manual_seed(5)
        perturbed = {k: t + 0.05 * torch.randn(t.shape, generator=gen) for k, t in load_file(str(model / "model.safetensors")).items()}
        chunks = weight_chunks(sorted(perturbed.items()), before + 1, 256 * 1024, 64 * 1024, ())
        assert stub.UpdateWeights(chunks, metadata=bearer_metadata(TOKEN)).version == before + 1
        while not dock.rollout_done():
            assert time.monotonic() < deadline + 60, f"the rows were not generated again: {dock.stats()}"
            time.sleep(0.1)
        got = dock.read(rows, ["responses", "versions"])
        for prompt, response, versions in zip(prompts, got["responses"], got["versions"]):
            now = stub.Generate(greedy_request(prompt, max_tokens)).completions[0]  # the pushed weights' greedy decode
            assert [int(t) for t in response] == list(now.token_ids)[:len(response)]
            assert set(int(v) for v in versions) == {before + 1}
        log = (tmp_path / "overtaken.log").read_text()
        assert re.search(r"claim done .*released=[1-9]", log), "the push did not overtake a running row"
    finally:
        replica.stop()
        dock.destroy()
