"""A weight push cut halfway (the client cancels the stream, or its connection closes) leaves the replica
on the old version with the old outputs; the next full push succeeds."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from rollout_harness import TOKEN

from services.common.auth import bearer_metadata
from services.common.pb import rollout_pb2, rollout_pb2_grpc
from services.rollout.weight_chunks import weight_chunks

pytestmark = pytest.mark.service

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61]]
MAX_TOKENS = 8
BUCKET_BYTES = 256 * 1024  # several buckets for the ~2 MB tiny model, so some are staged before the cut
CHUNK_BYTES = 64 * 1024
SENT_BEFORE_CUT = 10  # chunks: two buckets staged, the third half sent


@pytest.fixture(scope="module")
def weights(rollout_servers):
    """(served, perturbed) state dicts of the replica's model."""
    import torch
    from safetensors.torch import load_file

    served = load_file(str(rollout_servers.model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    return served, {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in served.items()}


def outputs(target: str) -> list[list[int]]:
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(target))
    sampling = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(stub.Generate(rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=p), sampling=sampling)).completions[0].token_ids)
            for p in PROMPTS]


def version(target: str) -> int:
    return rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(target)).GetInfo(rollout_pb2.GetInfoRequest()).version


def cut_push(target: str, state: dict, new_version: int, token: str, how: str) -> grpc.StatusCode:
    """Sends SENT_BEFORE_CUT chunks of a push, then cancels the call or closes the channel; returns the call's code."""
    chunks = list(weight_chunks(sorted(state.items()), new_version, BUCKET_BYTES, CHUNK_BYTES))
    assert len(chunks) > SENT_BEFORE_CUT + 4
    sent, release = threading.Event(), threading.Event()

    def stream():
        yield from chunks[:SENT_BEFORE_CUT]
        sent.set()
        release.wait(30)  # the stream stays open, as a trainer that died mid-push would leave it

    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    call = rollout_pb2_grpc.RolloutStub(channel).UpdateWeights.future(stream(), metadata=bearer_metadata(token))
    assert sent.wait(30)
    time.sleep(1.0)  # let the replica receive and stage what was sent
    if how == "cancel":
        call.cancel()
    else:
        channel.close()
    release.set()
    try:
        call.result(timeout=30)
        return grpc.StatusCode.OK
    except grpc.FutureCancelledError:
        return grpc.StatusCode.CANCELLED
    except grpc.RpcError as exc:
        return exc.code()


def full_push(target: str, state: dict, new_version: int, token: str) -> rollout_pb2.UpdateWeightsResponse:
    """A whole push; retried while the replica still tears the cut one down (FAILED_PRECONDITION)."""
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]))
    deadline = time.monotonic() + 30
    while True:
        try:
            return stub.UpdateWeights(weight_chunks(sorted(state.items()), new_version, BUCKET_BYTES, CHUNK_BYTES),
                                      metadata=bearer_metadata(token))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_cut_push_keeps_the_old_version_and_the_next_push_succeeds(rollout_servers, weights, fault_log):
    target, token = rollout_servers.a.grpc_target, TOKEN
    served, perturbed = weights
    old_version, old_outputs = version(target), outputs(target)
    for how, what in (("cancel", "the client cancels UpdateWeights"), ("close", "the client's channel closes")):
        code = cut_push(target, perturbed, old_version + 1, token, how)
        now_version, now_outputs = version(target), outputs(target)
        fault_log.check("rollout weight push", f"{what} after {SENT_BEFORE_CUT} of the push's chunks (2 buckets staged)",
                        f"version stays {old_version}, greedy outputs unchanged",
                        f"call ended {code.name}; version {now_version}; outputs {'unchanged' if now_outputs == old_outputs else 'CHANGED'}",
                        now_version == old_version and now_outputs == old_outputs)

    answer = full_push(target, perturbed, old_version + 1, token)
    new_outputs = outputs(target)
    fault_log.check("rollout weight push", "the next full push after the cuts", f"version {old_version + 1}, outputs of the new weights",
                    f"version {answer.version} (GetInfo {version(target)}), outputs {'changed' if new_outputs != old_outputs else 'UNCHANGED'}",
                    answer.version == version(target) == old_version + 1 and new_outputs != old_outputs)
    # the other rollout tests expect the served checkpoint at its version: put both back
    full_push(target, served, old_version, token)
    assert outputs(target) == old_outputs and version(target) == old_version
