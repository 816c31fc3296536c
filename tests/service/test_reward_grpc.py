"""The reward server through real gRPC on loopback: scores, token ids, timeouts, bad input, health."""
import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import config_from_dict
from services.common.pb import reward_pb2, reward_pb2_grpc
from services.common.templates import load_templates
from services.common.tiny_model import build_tokenizer
from services.reward.pool import VerifierPool
from services.reward.server import SERVICE_NAME, start_server

pytestmark = pytest.mark.service

TIMEOUT_S = 1.5
WELL_FORMED = r"<think>6*7=42, minus 8</think><answer>\boxed{34}</answer>"
HANGS = r"\boxed{(x+1)^{10000}-1}"  # sympy simplifies this for minutes


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, load_templates()["qwen"])
    return out


@pytest.fixture(scope="module")
def stub(tokenizer_dir):
    cfg = config_from_dict({
        "megatron_training": {"tokenizer_name_or_path": str(tokenizer_dir)},
        "rl_config": {
            "n_samples_per_prompt": 2, "rollout_max_tokens": 20, "overlong_buffer_enable": True, "overlong_buffer": 4,
            "verifier_function": ["acc", "format"], "verifier_weight": [1.0, 0.5],
            "verifier_parallel": 2, "verifier_timeout": TIMEOUT_S,
        },
        "generate_config": {"max_model_len": 4096, "sampling_config": {"max_tokens": 20}},
        "reward": {"max_items": 64, "max_response_chars": 200_000},
    })
    with VerifierPool(cfg.rl_config.verifier_parallel, cfg.rl_config.verifier_timeout) as pool:
        server = start_server(cfg, pool, "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        yield reward_pb2_grpc.RewardStub(channel), channel, server
        channel.close()
        server.stop()


def score(stub, items, verifiers=(), weights=()):
    request = reward_pb2.ScoreRequest(items=items, verifier_function=list(verifiers), verifier_weight=list(weights))
    return stub[0].Score(request, timeout=60).results


def item(response="", label="34", **kw):
    return reward_pb2.ScoreItem(response=response, label=label, **kw)


def test_health_reports_serving(stub):
    health = health_pb2_grpc.HealthStub(stub[1])
    for service in ("", SERVICE_NAME):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING


def test_the_code_verifier_is_refused_and_unlisted_without_a_sandbox(stub):
    assert "sandbox_fusion" not in {v.name for v in stub[0].ListVerifiers(reward_pb2.ListVerifiersRequest()).verifiers}
    with pytest.raises(grpc.RpcError) as exc:
        stub[0].Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response="```\nprint(1)\n```", label="{}")],
                                              verifier_function=["sandbox_fusion"]), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details() == ("verifier_function: sandbox_fusion runs programs in the sandbox service and this server has "
                                   "none (reward.sandbox_address is empty and rl_config.verifier_function does not list it)")


def test_list_verifiers(stub):
    infos = {v.name: v for v in stub[0].ListVerifiers(reward_pb2.ListVerifiersRequest()).verifiers}
    assert set(infos) == {"format", "strict_format", "base_acc", "acc", "math_17k_acc", "math_verify", "math_verify_reward", "acc_for_dapo", "acc_for_ppo",
                          "step"}
    assert infos["acc"].timeout_score == -0.5 and "boxed" in infos["acc"].description


def test_config_plan_weighted_sum(stub):
    right, wrong, unboxed = score(stub, [item(WELL_FORMED, response_length=5), item(r"\boxed{35}", response_length=5),
                                         item("34", response_length=5)])
    assert [(p.name, p.score) for p in right.parts] == [("acc", 1.0), ("format", 1.0)]
    assert right.score == 1.5
    assert [p.score for p in wrong.parts] == [-0.5, 0.0] and wrong.score == -0.5
    assert unboxed.score == -1.0


def test_request_plan_and_overlong_penalty(stub):
    response = "<think>a</think> <answer>34</answer>"
    (result,) = score(stub, [item(response, response_length=18)], ["format", "step"], [2.0, 1.0])
    assert [(p.name, p.score) for p in result.parts] == [("format", 1.0), ("step", 0.0)]
    assert result.overlong_penalty == -0.5  # expected 16 tokens, 2 over a buffer of 4
    assert result.score == pytest.approx(1.5)


def test_token_ids_are_decoded_with_the_run_tokenizer(stub, tokenizer_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tokenizer_dir)).encode(r"So \boxed{\frac12}<|im_end|>", add_special_tokens=False)
    assert len(ids) == 19  # 18 bytes and <|im_end|>
    (result,) = score(stub, [reward_pb2.ScoreItem(response_token_ids=ids, label="0.5")], ["acc"])
    assert result.parts[0].score == 1.0
    assert result.overlong_penalty == -0.75  # length from the ids: 19 tokens, 3 over 16


def test_a_hung_sample_times_out_while_other_calls_are_served(stub):
    slow = {}

    def call_slow():
        started = time.monotonic()
        slow["results"] = score(stub, [item(HANGS, response_length=1), item(WELL_FORMED, response_length=1)], ["acc"])
        slow["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=call_slow)
    thread.start()
    time.sleep(0.2)
    started = time.monotonic()
    (fast,) = score(stub, [item(r"\boxed{34}", response_length=1)], ["acc"])
    fast_seconds = time.monotonic() - started
    thread.join(30)
    assert fast.score == 1.0 and fast_seconds < TIMEOUT_S
    hung, fine = slow["results"]
    assert (hung.parts[0].score, hung.parts[0].timed_out, hung.score) == (-0.5, True, -0.5)
    assert (fine.parts[0].score, fine.parts[0].timed_out) == (1.0, False)
    assert TIMEOUT_S <= slow["seconds"] < TIMEOUT_S + 3
    # the replaced worker serves at once
    assert [r.score for r in score(stub, [item(r"\boxed{34}", response_length=1)] * 4, ["acc"])] == [1.0] * 4


def test_100k_character_response(stub):
    (result,) = score(stub, [item("x" * 100_000 + r" \boxed{34}", response_length=1)], ["acc", "math_17k_acc"])
    assert [p.score for p in result.parts] == [1.0, 1.0]


@pytest.mark.parametrize(
    "items, verifiers, weights, message",
    [
        ([item("x", response_length=1)], ["acc", "nope"], [], r"verifier_function: unknown verifier 'nope'; known: format"),
        ([item("x", response_length=1)], ["acc", "format"], [1.0], r"verifier_weight: 1 weights for 2 verifier_function"),
        ([item("x", response_length=1)], [], [1.0], r"verifier_weight: given without verifier_function"),
        ([item("x", response_length=1)], ["acc"], [float("nan")], r"verifier_weight\[0\]: must be a finite number"),
        ([item("x", response_length=1)] * 65, [], [], r"items: 65 items; at most 64 per request \(reward.max_items\)"),
        ([item("x", response_token_ids=[1])], [], [], r"items\[0\]: give response or response_token_ids, not both"),
        ([reward_pb2.ScoreItem(response_token_ids=[1, 999])], [], [], r"items\[0\].response_token_ids: token id 999 is outside"),
        ([item("x", response_length=-1)], [], [], r"items\[0\].response_length: must be >= 0, got -1"),
        ([item("x" * 200_001, response_length=1)], [], [], r"items\[0\].response: 200001 characters; at most 200000"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(stub, items, verifiers, weights, message):
    with pytest.raises(grpc.RpcError) as info:
        score(stub, items, verifiers, weights)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details()), info.value.details()
    (ok,) = score(stub, [item(r"\boxed{34}", response_length=1)], ["acc"])  # and the server keeps serving
    assert ok.score == 1.0
