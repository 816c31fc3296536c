"""A reward replica with the reward model (`reward_config.load`): `services.reward serve --dock` as a
process on vLLM's pooling runner, checked against Hugging Face's AutoModelForSequenceClassification
on the same inputs, over gRPC and through the dock."""
import os
import pathlib
import subprocess
import sys
import time
import uuid

import grpc
import numpy as np
import pytest
import redis
import torch
import yaml

from services.common.pb import reward_pb2, reward_pb2_grpc
from services.common.ready_file import read_ready_file
from services.common.tiny_model import build_tiny_model
from services.dock.client import Dock
from services.dock.schema import DockLayout
from services.reward.client import RewardClient
from services.reward.scoring import ScoreInput
from services.reward.worker import CONSUMER

pytestmark = pytest.mark.service

SEQ_LENGTH = 24  # reward_config.seq_length: short, so that over-long inputs are easy to make
N = 2
START_S = 600  # a vLLM engine starts in ~40 s on an idle box, minutes on a busy one
ATOL = 1e-4  # fp32 on both sides


class HFReference:
    """Hugging Face's scores of the same text: the reward model's tokenizer, last SEQ_LENGTH tokens."""

    def __init__(self, model_dir: pathlib.Path):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()

    def ids(self, prompt: str, response: str) -> list[int]:
        return self.tok(prompt + response)["input_ids"][-SEQ_LENGTH:]

    def score(self, prompt: str, response: str) -> float:
        with torch.no_grad():
            return self.model(torch.tensor([self.ids(prompt, response)])).logits[0, 0].item()


@pytest.fixture(scope="module")
def served(tmp_path_factory, redis_url):
    """One `serve --dock` process with the tiny reward model (0.5 math_17k_acc + 0.5 reward_model);
    yields (gRPC target, Redis client, key prefix, HF reference)."""
    tmp = tmp_path_factory.mktemp("reward_model")
    model_dir = build_tiny_model(tmp / "rm", prompt_type="qwen", reward=True)
    prefix = f"test-reward-model-{uuid.uuid4().hex[:10]}"
    config = {
        "megatron_training": {"tokenizer_name_or_path": str(model_dir), "global_batch_size": 2},
        "rl_config": {"n_samples_per_prompt": N, "verifier_function": ["math_17k_acc", "reward_model"],
                      "verifier_weight": [0.5, 0.5], "verifier_parallel": 1, "verifier_timeout": 5},
        "generate_config": {"dtype": "float32", "max_num_seqs": 32, "cpu_kvcache_space_gb": 1},
        "reward_config": {"load": str(model_dir), "seq_length": SEQ_LENGTH},
        "dock": {"redis_url": redis_url, "prefix": prefix, "run_id": "rm"},
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(config))
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.reward", "serve", "--config", str(tmp / "run.yaml"), "--port", "0", "--dock",
         "--ready-file", str(tmp / "ready.json")],
        stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "DOCKRL_LOG_LEVEL": "WARNING"},
    )
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + START_S
        while not (tmp / "ready.json").exists():
            assert proc.poll() is None, (tmp / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "reward server with the model did not start"
            time.sleep(1)
        yield f"127.0.0.1:{read_ready_file(tmp / 'ready.json')['grpc_port']}", client, prefix, HFReference(model_dir)
    finally:
        proc.terminate()
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()
    assert code == 0, (tmp / "serve.log").read_text()[-4000:]  # SIGTERM stops the engine and the server cleanly


def test_model_scores_equal_hugging_face_on_the_same_inputs(served):
    target, _, _, hf = served
    samples = [("1+2=", r"\boxed{3}"), ("1+2=", r"\boxed{4}"), ("<|im_start|>user\n7+8=<|im_end|>\n", "15"),
               ("9+9=", "it is " * 2 + r"\boxed{18}"), ("4+4=", "")]  # an empty response: the prompt alone
    with RewardClient(target) as reward:
        results = reward.score([ScoreInput(r, "3", prompt=p) for p, r in samples], ["reward_model"], [1.0])
    with grpc.insecure_channel(target) as channel:
        verifiers = reward_pb2_grpc.RewardStub(channel).ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=600).verifiers
    names = [v.name for v in verifiers]
    assert "reward_model" in names
    for (prompt, response), result in zip(samples, results):
        assert [p.name for p in result.parts] == ["reward_model"]
        assert result.total == pytest.approx(hf.score(prompt, response), abs=ATOL)
    assert len({round(r.total, 6) for r in results}) == len(samples)  # the inputs give different scores


def test_an_over_long_input_keeps_its_last_seq_length_tokens(served):
    target, _, _, hf = served
    prompt, response = "2+2=", "x" * 60 + r"\boxed{4}"
    assert len(hf.tok(prompt + response)["input_ids"]) > SEQ_LENGTH
    with RewardClient(target) as reward:
        (result,) = reward.score([ScoreInput(response, "4", prompt=prompt)], ["reward_model"], [1.0])
    assert result.total == pytest.approx(hf.score(prompt, response), abs=ATOL)
    assert hf.ids(prompt, response) == hf.tok("x" * 15 + r"\boxed{4}")["input_ids"]  # what the model read


def test_rule_and_model_parts_are_weighted_per_sample(served):
    target, _, _, hf = served
    with RewardClient(target) as reward:  # the config's plan: 0.5 math_17k_acc + 0.5 reward_model
        right, wrong = reward.score([ScoreInput(r"\boxed{3}", "3", prompt="1+2="), ScoreInput(r"\boxed{4}", "3", prompt="1+2=")])
    for result, rule, response in ((right, 1.0, r"\boxed{3}"), (wrong, 0.0, r"\boxed{4}")):
        model = hf.score("1+2=", response)
        assert [(p.name, round(p.score, 4)) for p in result.parts] == [("math_17k_acc", rule), ("reward_model", round(model, 4))]
        assert result.total == pytest.approx(0.5 * rule + 0.5 * model, abs=ATOL)


def test_no_token_at_all_is_invalid_argument_naming_the_item(served):
    target = served[0]
    with RewardClient(target) as reward:
        with pytest.raises(grpc.RpcError) as err:
            reward.score([ScoreInput("ok", "1", prompt="1="), ScoreInput("", "1")], ["reward_model"], [1.0])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].response: is empty and so is the prompt" in err.value.details()


def test_dock_rows_get_both_parts_and_their_weighted_sum(served):
    _, client, prefix, hf = served
    tok = hf.tok
    dock = Dock(client, prefix, "rm")
    dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=2, dispatch_sizes={CONSUMER: N}))  # rm_parts is a default column
    prompts = ["<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"] * 2 + ["<|im_start|>user\n5+4=<|im_end|>\n<|im_start|>assistant\n"] * 2
    responses = [r"\boxed{3}", r"\boxed{2}", "", "x" * 40 + r"\boxed{9}"]  # right, wrong, empty, over-long
    labels = ["3", "3", "9", "9"]
    rows = dock.rows_of([0, 1])
    dock.put(rows, {"prompts": [np.array(tok.encode(p), np.int32) for p in prompts],
                    "prompt_length": [len(tok.encode(p)) for p in prompts], "labels": labels})
    ids = [np.array(tok.encode(r) + [tok.eos_token_id], np.int32) for r in responses]  # as rollout ends them
    dock.put(rows, {"responses": ids, "response_length": [len(i) for i in ids]})
    deadline = time.monotonic() + 120
    while not dock.all_consumed(CONSUMER) and time.monotonic() < deadline:
        time.sleep(0.2)
    got = dock.read(rows, ["rm_scores", "rm_parts"])
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        rule = 1.0 if i in (0, 3) else 0.0
        model = hf.score(prompt, response)  # the response's end-of-text token is dropped, as for the rules
        assert [float(v) for v in got["rm_parts"][i]] == pytest.approx([rule, model], abs=ATOL)
        assert float(got["rm_scores"][i]) == pytest.approx(0.5 * rule + 0.5 * model, abs=ATOL)
