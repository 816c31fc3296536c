"""Weight push from the megatron model to real rollout replicas (vLLM): over gRPC (chain and fan-out) and
over the collective path (gloo groups, gRPC control), each consuming the streamed gather (HfWeightStream)
bucket by bucket as the trainer's push does.

The check is the one DESIGN.md asks every run to log: after a push, the rollout's log-probs of its
own samples match the trainer's to 1e-3 (train_rollout_logprob_diff).
"""
import json
import os
import pathlib
import subprocess
import sys
import time

import grpc
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))
from trainer_helpers import megatron_tp1, tiny_hf_model  # noqa: E402

from services.common.pb import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, compute_logprobs  # noqa: E402
from services.trainer.weights.gather import stream_hf_weights  # noqa: E402
from services.trainer.weights.collective_push import CollectiveSender  # noqa: E402
from services.trainer.weights.weight_push import push_weights  # noqa: E402

pytestmark = pytest.mark.service
REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT = [72, 101, 108, 108, 111, 32]
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two rollout replicas serving the tiny model; yields (model dir, addresses)."""
    work = tmp_path_factory.mktemp("push")
    hf_dir = tiny_hf_model(work / "model")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    procs, ready_files = [], []
    for i in range(2):
        ready = work / f"ready{i}.json"
        ready_files.append(ready)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "services.rollout", "serve", "--model", str(hf_dir), "--grpc-port", "0",
             "--http-port", "0", "--ready-file", str(ready)],
            cwd=REPO, env=env, stdout=open(work / f"replica{i}.log", "w"), stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc, ready in zip(procs, ready_files):
            while not ready.exists():
                assert proc.poll() is None, f"rollout replica exited; see {work}"
                assert time.monotonic() < deadline, "rollout replicas did not start in time"
                time.sleep(0.5)
        yield hf_dir, [f"127.0.0.1:{json.loads(r.read_text())['grpc_port']}" for r in ready_files]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


@pytest.fixture(scope="module")
def trained(replicas):
    """The trainer's model with weights moved away from the served ones (as an update moves them)."""
    model, layout = megatron_tp1(replicas[0])
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model, layout


def sample(address: str):
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(address))
    response = stub.Generate(rollout_pb2.GenerateRequest(
        token_ids=rollout_pb2.TokenIds(ids=PROMPT),
        sampling=rollout_pb2.SamplingParams(max_tokens=12, logprobs=1, seed=5, ignore_eos=True)))
    c = response.completions[0]
    return list(c.token_ids), torch.tensor(list(c.logprobs)), response.policy_version


def logprob_diff(model, tokens, rollout_logprobs) -> float:
    ours = compute_logprobs(model, ResponseBatch.from_token_ids([PROMPT], [tokens]), ForwardConfig())[0][0]
    return (ours - rollout_logprobs).abs().mean().item()


@pytest.mark.parametrize("mode,version", [("chain", 1), ("fanout", 2)])
def test_push_makes_rollout_match_the_trainer(replicas, trained, mode, version):
    _, addresses = replicas
    model, layout = trained
    stream = stream_hf_weights(model, layout, bucket_mb=0.25)
    result = push_weights(stream, addresses, version, bucket_mb=0.25, mode=mode, max_message_bytes=256 * 1024)
    assert result.failed == () and result.replicas_updated == 2 and result.num_buckets == len(stream.plan) > 1
    assert result.bytes_sent == sum(t.numel() * 4 for t in stream.specs.values())
    for address in addresses:
        tokens, rollout_logprobs, served_version = sample(address)
        assert served_version == version
        assert logprob_diff(model, tokens, rollout_logprobs) < 1e-3


def test_a_collective_push_makes_rollout_match_the_trainer(replicas, trained):
    _, addresses = replicas
    model, layout = trained
    version = max(sample(a)[2] for a in addresses) + 1
    sender = CollectiveSender(token="", stall_s=60.0, host="127.0.0.1")
    try:
        result = sender.push(stream_hf_weights(model, layout, bucket_mb=0.25), addresses, version, bucket_mb=0.25)
    finally:
        sender.close()
    assert result.failed == () and result.replicas_updated == 2 and result.num_buckets > 1
    for address in addresses:
        tokens, rollout_logprobs, served_version = sample(address)
        assert served_version == version
        assert logprob_diff(model, tokens, rollout_logprobs) < 1e-3


def test_a_refused_push_is_reported_and_leaves_the_served_version(replicas, trained):
    _, addresses = replicas
    model, layout = trained
    before = sample(addresses[0])[2]
    result = push_weights(stream_hf_weights(model, layout, 0.25, torch.bfloat16), addresses[:1], before + 1, bucket_mb=0.25,
                          dtype=torch.bfloat16)
    assert result.replicas_updated == 0
    assert len(result.failed) == 1 and "INVALID_ARGUMENT" in result.failed[0].error and "dtype" in result.failed[0].error
    assert sample(addresses[0])[2] == before


def test_a_stream_planned_for_other_buckets_is_refused(trained):
    model, layout = trained
    with pytest.raises(ValueError, match="planned for 0.25 MiB buckets"):
        push_weights(stream_hf_weights(model, layout, bucket_mb=0.25), ["127.0.0.1:1"], 1, bucket_mb=1)
