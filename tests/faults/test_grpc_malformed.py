"""Malformed gRPC requests to every service (bytes that do not parse, wrong wire types, huge strings,
negative counts, NaN sampling parameters, empty batches): INVALID_ARGUMENT naming the field, never
INTERNAL or UNKNOWN, and the server keeps serving."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import grpc
import pytest
from rollout_harness import TOKEN as ROLLOUT_TOKEN

from services.common.auth import bearer_metadata
from services.common.config import DEFAULT_CONFIG, load_config
from services.common.pb import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.service

TRAINER_TOKEN = "malformed-trainer-token"
GARBAGE = b"\xff\xff\xff\xff"  # field 31, wire type 7: not a protobuf message
NAN = math.nan


@dataclasses.dataclass(frozen=True)
class Case:
    """One malformed call: what it sends and the field its error must name."""

    what: str
    call: Callable[[grpc.Channel], object]
    names: str  # a piece of the error message: the field or the method


def raw(method: str, payload: bytes, metadata=()) -> Callable[[grpc.Channel], object]:
    """Sends `payload` as the request bytes of `method`, bypassing the client's serializer."""
    return lambda ch: ch.unary_unary(method)(payload, metadata=metadata, timeout=30)


def generate(prompt=None, text=None, **sampling) -> Callable[[grpc.Channel], object]:
    request = rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(**sampling))
    if text is not None:
        request.text = text
    if prompt is not None:
        request.token_ids.CopyFrom(rollout_pb2.TokenIds(ids=prompt))
    return lambda ch: rollout_pb2_grpc.RolloutStub(ch).Generate(request, timeout=60)


def generate_stream(**sampling) -> Callable[[grpc.Channel], object]:
    request = rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=[1, 2]), sampling=rollout_pb2.SamplingParams(**sampling))
    return lambda ch: list(rollout_pb2_grpc.RolloutStub(ch).GenerateStream(request, timeout=60))


ROLLOUT_META = bearer_metadata(ROLLOUT_TOKEN)


def join(**fields) -> Callable[[grpc.Channel], object]:
    request = rollout_pb2.JoinWeightGroupRequest(**{"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "timeout_s": 5.0, **fields})
    return lambda ch: rollout_pb2_grpc.RolloutStub(ch).JoinWeightGroup(request, metadata=ROLLOUT_META, timeout=30)


def open_transfer(*buckets: rollout_pb2.TransferBucket) -> Callable[[grpc.Channel], object]:
    request = rollout_pb2.OpenWeightTransferRequest(version=1, buckets=buckets)
    return lambda ch: rollout_pb2_grpc.RolloutStub(ch).OpenWeightTransfer(request, metadata=ROLLOUT_META, timeout=30)


def push(*chunks: rollout_pb2.WeightChunk) -> Callable[[grpc.Channel], object]:
    return lambda ch: rollout_pb2_grpc.RolloutStub(ch).UpdateWeights(iter(chunks), metadata=ROLLOUT_META, timeout=60)


EMBED = rollout_pb2.TensorMeta(name="model.embed_tokens.weight", dtype="float32", shape=[320, 128], offset=0, nbytes=320 * 128 * 4)
ROLLOUT = "/dockrl.rollout.v1.Rollout/"
ROLLOUT_CASES = [
    Case("Generate: bytes that are not a message", raw(ROLLOUT + "Generate", GARBAGE), "Generate: the request is not a valid"),
    Case("GetInfo: bytes that are not a message", raw(ROLLOUT + "GetInfo", GARBAGE), "GetInfo: the request is not a valid"),
    Case("Abort (with the token): bytes that are not a message", raw(ROLLOUT + "Abort", GARBAGE, ROLLOUT_META), "Abort: the request is not a valid"),
    Case("UpdateWeights (with the token): a chunk that is not a message",
         lambda ch: ch.stream_unary(ROLLOUT + "UpdateWeights")(iter([GARBAGE]), metadata=ROLLOUT_META, timeout=30), "UpdateWeights: the request is not a valid"),
    Case("Generate: `text` sent as a varint (wrong wire type)", raw(ROLLOUT + "Generate", b"\x10\x05"), "prompt"),
    Case("Generate: empty token_ids", generate(prompt=[]), "prompt"),
    Case("Generate: a 1 MB text prompt", generate(text="x" * (1 << 20)), "prompt"),
    Case("Generate: token id -5", generate(prompt=[1, -5]), "prompt"),
    Case("Generate: token id 10**6", generate(prompt=[10**6]), "prompt"),
    Case("Generate: max_tokens -1", generate(prompt=[1, 2], max_tokens=-1), "max_tokens"),
    Case("Generate: n -3", generate(prompt=[1, 2], n=-3), "n"),
    Case("Generate: n 10**6", generate(prompt=[1, 2], n=10**6, temperature=1.0), "n"),
    Case("Generate: logprobs -2", generate(prompt=[1, 2], logprobs=-2), "logprobs"),
    Case("Generate: temperature NaN", generate(prompt=[1, 2], temperature=NAN), "temperature"),
    Case("Generate: temperature +inf", generate(prompt=[1, 2], temperature=math.inf), "temperature"),
    Case("Generate: top_p NaN", generate(prompt=[1, 2], top_p=NAN), "top_p"),
    Case("Generate: min_p NaN", generate(prompt=[1, 2], min_p=NAN), "min_p"),
    Case("Generate: top_k -7", generate(prompt=[1, 2], top_k=-7), "top_k"),
    Case("Generate: 1000 stop strings", generate(prompt=[1, 2], stop=["s"] * 1000), "stop"),
    Case("Generate: model 'nope'", lambda ch: rollout_pb2_grpc.RolloutStub(ch).Generate(
        rollout_pb2.GenerateRequest(model="nope", token_ids=rollout_pb2.TokenIds(ids=[1]))), "model"),
    Case("GenerateStream: temperature NaN", generate_stream(temperature=NAN), "temperature"),
    Case("UpdateWeights: an empty stream", push(), "UpdateWeights"),
    Case("UpdateWeights: num_buckets -1", push(rollout_pb2.WeightChunk(num_buckets=-1)), "num_buckets"),
    Case("UpdateWeights: bucket_nbytes 2**50", push(rollout_pb2.WeightChunk(num_buckets=1, bucket_nbytes=1 << 50, tensors=[EMBED])), "bucket_nbytes"),
    Case("UpdateWeights: bucket_nbytes -1", push(rollout_pb2.WeightChunk(num_buckets=1, bucket_nbytes=-1, tensors=[EMBED])), "bucket_nbytes"),
    Case("UpdateWeights: a tensor of shape [-320, 128]", push(rollout_pb2.WeightChunk(
        num_buckets=1, bucket_nbytes=EMBED.nbytes, tensors=[rollout_pb2.TensorMeta(name=EMBED.name, dtype="float32", shape=[-320, 128], nbytes=EMBED.nbytes)])), "shape"),
    Case("UpdateWeights: negative data_offset", push(rollout_pb2.WeightChunk(
        num_buckets=1, bucket_nbytes=EMBED.nbytes, tensors=[EMBED], data=b"\0" * 8, data_offset=-8)), "data_offset"),
    Case("JoinWeightGroup: no master_address", join(master_address=""), "master_address"),
    Case("JoinWeightGroup: master_port 70000", join(master_port=70000), "master_port"),
    Case("JoinWeightGroup: world_size 5 for a replica of 1 worker", join(world_size=5), "world_size"),
    Case("JoinWeightGroup: timeout_s NaN", join(timeout_s=NAN), "timeout_s"),
    Case("JoinWeightGroup: timeout_s infinite", join(timeout_s=math.inf), "timeout_s"),
    Case("OpenWeightTransfer: no buckets", open_transfer(), "buckets"),
    Case("OpenWeightTransfer: a bucket of 2**50 bytes", open_transfer(rollout_pb2.TransferBucket(nbytes=1 << 50, tensors=[EMBED])),
         "buckets[0].nbytes"),
    Case("OpenWeightTransfer: a tensor the model lacks", open_transfer(rollout_pb2.TransferBucket(nbytes=64, tensors=[
        rollout_pb2.TensorMeta(name="model.extra.weight", dtype="float32", shape=[4], offset=0, nbytes=16)])), "model.extra.weight"),
]

REWARD = "/dockrl.reward.v1.Reward/"
def score(*items: reward_pb2.ScoreItem, names=(), weights=()) -> Callable[[grpc.Channel], object]:
    request = reward_pb2.ScoreRequest(items=items, verifier_function=names, verifier_weight=weights)
    return lambda ch: reward_pb2_grpc.RewardStub(ch).Score(request, timeout=60)


REWARD_CASES = [
    Case("Score: bytes that are not a message", raw(REWARD + "Score", GARBAGE), "Score: the request is not a valid"),
    Case("ListVerifiers: bytes that are not a message", raw(REWARD + "ListVerifiers", GARBAGE), "ListVerifiers: the request is not a valid"),
    Case("Score: an empty batch", score(), "items"),
    Case("Score: a 2 MB response", score(reward_pb2.ScoreItem(response="x" * (2 << 20), label="1", response_length=3)), "items[0].response"),
    Case("Score: response_length -4", score(reward_pb2.ScoreItem(response="1", label="1", response_length=-4)), "items[0].response_length"),
    Case("Score: verifier_weight NaN", score(reward_pb2.ScoreItem(response="1", label="1", response_length=1), names=["acc"], weights=[NAN]), "verifier_weight[0]"),
    Case("Score: an unknown verifier", score(reward_pb2.ScoreItem(response="1", label="1", response_length=1), names=["nope"]), "nope"),
    Case("Score: 3 weights for 1 verifier", score(reward_pb2.ScoreItem(response="1", label="1", response_length=1), names=["acc"], weights=[1, 1, 1]), "verifier_weight"),
    Case("Score: response and response_token_ids both", score(reward_pb2.ScoreItem(response="1", response_token_ids=[1], label="1")), "items[0]"),
]

TRAINER = "/dockrl.trainer.v1.Trainer/"
TRAINER_META = bearer_metadata(TRAINER_TOKEN)
TRAINER_CASES = [
    Case("Status: bytes that are not a message", raw(TRAINER + "Status", GARBAGE), "Status: the request is not a valid"),
    Case("Checkpoint (with the token): bytes that are not a message", raw(TRAINER + "Checkpoint", GARBAGE, TRAINER_META), "Checkpoint: the request is not a valid"),
    Case("Checkpoint: a 5000-character path", lambda ch: trainer_pb2_grpc.TrainerStub(ch).Checkpoint(
        trainer_pb2.CheckpointRequest(path="p" * 5000), metadata=TRAINER_META), "path"),
    Case("Checkpoint: a path with NUL", lambda ch: trainer_pb2_grpc.TrainerStub(ch).Checkpoint(
        trainer_pb2.CheckpointRequest(path="a\0b"), metadata=TRAINER_META), "path"),
]


@pytest.fixture(scope="module")
def rollout_channel(rollout_servers):
    with grpc.insecure_channel(rollout_servers.a.grpc_target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield channel


@pytest.fixture(scope="module")
def reward_channel():
    from services.reward.pool import VerifierPool
    from services.reward.server import start_server

    cfg = load_config(DEFAULT_CONFIG, ["rl_config.verifier_function=[acc]", "rl_config.verifier_weight=[1.0]"])
    with VerifierPool(1, 5.0) as pool:
        server = start_server(cfg, pool, "127.0.0.1", 0)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            yield channel
        server.stop()


@pytest.fixture(scope="module")
def trainer_channel():
    from services.trainer.loop.control import TrainerControl
    from services.trainer.loop.server import start_server

    server, port = start_server(TrainerControl(train_iters=4), "127.0.0.1", 0, token=TRAINER_TOKEN)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(grace=None).wait()


def outcome(case: Case, channel: grpc.Channel) -> tuple[grpc.StatusCode, str]:
    try:
        case.call(channel)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def check_case(area: str, case: Case, channel: grpc.Channel, fault_log) -> None:
    code, details = outcome(case, channel)
    fault_log.check(area, case.what, f"INVALID_ARGUMENT naming {case.names!r}", f"{code.name}: {details[:110]}",
                    code == grpc.StatusCode.INVALID_ARGUMENT and case.names in details)


@pytest.mark.parametrize("case", ROLLOUT_CASES, ids=lambda c: c.what)
def test_rollout_refuses_malformed_requests(case, rollout_channel, fault_log):
    check_case("rollout gRPC input", case, rollout_channel, fault_log)


@pytest.mark.parametrize("case", REWARD_CASES, ids=lambda c: c.what)
def test_reward_refuses_malformed_requests(case, reward_channel, fault_log):
    check_case("reward gRPC input", case, reward_channel, fault_log)


@pytest.mark.parametrize("case", TRAINER_CASES, ids=lambda c: c.what)
def test_trainer_refuses_malformed_requests(case, trainer_channel, fault_log):
    check_case("trainer gRPC input", case, trainer_channel, fault_log)


def test_every_server_still_serves_after_the_malformed_requests(rollout_channel, reward_channel, trainer_channel, fault_log):
    completion = rollout_pb2_grpc.RolloutStub(rollout_channel).Generate(rollout_pb2.GenerateRequest(
        token_ids=rollout_pb2.TokenIds(ids=[1, 2]), sampling=rollout_pb2.SamplingParams(max_tokens=3, ignore_eos=True))).completions[0]
    scored = reward_pb2_grpc.RewardStub(reward_channel).Score(reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(response=r"\boxed{4}", label="4", response_length=5)]))
    status = trainer_pb2_grpc.TrainerStub(trainer_channel).Status(trainer_pb2.StatusRequest())
    fault_log.check("all gRPC services", f"a valid call after the {len(ROLLOUT_CASES) + len(REWARD_CASES) + len(TRAINER_CASES)} malformed ones",
                    "rollout generates, reward scores, trainer answers Status",
                    f"{len(completion.token_ids)} tokens; score {scored.results[0].score}; trainer state {status.state!r}",
                    len(completion.token_ids) == 3 and scored.results[0].score == 1.0 and status.train_iters == 4)
