"""EPLB on a real vLLM-CPU replica serving a tiny Qwen2-MoE: the replica counts the tokens each MoE layer routes to each
expert (GET /v1/expert_load), `dockrl eplb` plans a map from those counts with vLLM's policy, and a replica started
with generate_config.expert_map_path reports the imbalance without and with the map; a map of another model stops it at start."""
import json
import pathlib
import sys
import urllib.error
import urllib.request

import grpc
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))
from trainer_helpers import tiny_hf_model  # noqa: E402

from replica_launcher import spawn_replica  # noqa: E402
from services.cli import main  # noqa: E402
from services.common.pb import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.rollout.eplb import read_expert_map  # noqa: E402

pytestmark = pytest.mark.service
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
TOP_K = 2  # init_model.num_experts_per_tok
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 3, 80], [12, 64, 90, 11, 25, 6, 8, 200, 4]]
MAX_TOKENS = 10


def expert_load(base: str) -> dict:
    with urllib.request.urlopen(base + "/v1/expert_load", timeout=30) as response:
        return json.load(response)


def generate(target: str) -> int:
    """Generates MAX_TOKENS for each prompt; returns the tokens the model computed (prompt + generated - 1 each: the
    last sampled token is never fed back)."""
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(target))
    fed = 0
    for prompt in PROMPTS:
        response = stub.Generate(rollout_pb2.GenerateRequest(
            token_ids=rollout_pb2.TokenIds(ids=prompt),
            sampling=rollout_pb2.SamplingParams(max_tokens=MAX_TOKENS, seed=3, ignore_eos=True)))
        generated = len(response.completions[0].token_ids)
        assert generated == MAX_TOKENS
        fed += len(prompt) + generated - 1
    return fed


def test_a_replica_counts_routed_tokens_and_reports_the_imbalance_of_a_map(tmp_path):
    model = tiny_hf_model(tmp_path / "model", architecture="qwen2_moe")
    num_layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    replica = spawn_replica(model, tmp_path, "counting", env=ENV).wait()
    try:
        start = expert_load(replica.http_base)
        assert start["num_experts"] == 4 and start["counts"] == [[0] * 4] * num_layers  # start-up runs not counted
        fed = generate(replica.grpc_target)
        load = expert_load(replica.http_base)
    finally:
        replica.stop()
    # every token the model computed was routed to top-k experts in every MoE layer, exactly once
    assert [sum(layer) for layer in load["counts"]] == [fed * TOP_K] * num_layers
    assert "imbalance_with_map" not in load  # no map given
    counts_file = tmp_path / "load.json"
    counts_file.write_text(json.dumps(load))
    map_path = tmp_path / "expert_map.json"
    assert main(["eplb", "--counts", str(counts_file), "--devices", "2", "--redundant-experts", "2", "--out", str(map_path)]) == 0
    placement = read_expert_map(map_path, num_layers, 4)

    # A replica started with the map reports what it does to the same load (same prompts and seeds: same routing).
    mapped = spawn_replica(model, tmp_path, "mapped", env=ENV, overrides=[f"generate_config.expert_map_path={map_path}"]).wait()
    try:
        assert generate(mapped.grpc_target) == fed
        report = expert_load(mapped.http_base)
    finally:
        mapped.stop()
    assert report["counts"] == load["counts"]
    assert report["devices"] == 2 and report["slots_per_device"] == 3 and report["expert_map_path"] == str(map_path)
    assert report["imbalance_with_map"] <= report["imbalance_contiguous"]
    assert len(placement) == num_layers

    # a map of another model (99 MoE layers) stops the replica at start, naming the key
    wrong = tmp_path / "wrong_map.json"
    wrong.write_text(map_path.read_text().replace('"moe_layer_count": %d' % num_layers, '"moe_layer_count": 99'))
    bad = spawn_replica(model, tmp_path, "bad", env=ENV, overrides=[f"generate_config.expert_map_path={wrong}"])
    with pytest.raises(RuntimeError) as failed:
        bad.wait()
    assert bad.proc.returncode == 2
    assert "generate_config.expert_map_path" in str(failed.value) and "moe_layer_count 99" in str(failed.value)


def test_qwen3_moe_counts_are_exact_too(tmp_path):
    """Qwen3-MoE hands its gate to vLLM's MoE runner instead of calling it: the router hook counts it all the same."""
    model = tiny_hf_model(tmp_path / "model", architecture="qwen3_moe")
    replica = spawn_replica(model, tmp_path, env=ENV).wait()
    try:
        fed = generate(replica.grpc_target)
        load = expert_load(replica.http_base)
    finally:
        replica.stop()
    assert [sum(layer) for layer in load["counts"]] == [fed * TOP_K] * len(load["counts"]) and len(load["counts"]) == 2


def test_a_dense_replica_has_no_expert_load(rollout_servers):
    with pytest.raises(urllib.error.HTTPError) as refused:
        expert_load(rollout_servers.a.http_base)  # the session's dense tiny replica
    assert refused.value.code == 404


def test_a_compiled_moe_replica_refuses_to_report_counts_it_cannot_take(tmp_path):
    """torch.compile traces the router before the counting hook exists: the counts would stay 0 (seen on vLLM-CPU)."""
    model = tiny_hf_model(tmp_path / "model", architecture="qwen2_moe")
    replica = spawn_replica(model, tmp_path, env=ENV, overrides=["generate_config.enforce_eager=false"]).wait(600)
    try:
        generate(replica.grpc_target)
        with pytest.raises(urllib.error.HTTPError) as refused:
            expert_load(replica.http_base)
    finally:
        replica.stop()
    assert refused.value.code == 409 and "enforce_eager" in json.load(refused.value)["error"]["message"]
