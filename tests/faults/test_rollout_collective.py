"""The collective weight path on real vLLM-CPU replicas: gRPC control, bytes over one gloo group per
replica (services/trainer/weights/collective_push.py -> services/rollout/gloo_transfer.py).

After a push both replicas serve the pushed weights (greedy tokens and logprobs of the HF model with
those weights); a refused join or layout is listed and changes nothing; a replica stopped (SIGSTOP)
or whose worker is SIGKILLed mid-broadcast is listed within push_stall_s while the other replica
takes the version, and a stopped one takes the next push once it runs again; a replica started
mid-run joins at the next push while the others keep their groups; a trainer killed mid-broadcast
leaves the replica refusing generation (weights half new) until the next complete push.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from replica_launcher import spawn_replica
from rollout_harness import OVERRIDES, TOKEN, greedy_request, hf_greedy, hf_logprobs, load_hf_model, rollout_stub
from services.common.pb import rollout_pb2
from tests.faults.loop_harness import descendants

pytestmark = [pytest.mark.service, pytest.mark.slow]  # starts three replicas of its own: about 2 min on 2 cores

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61]]
MAX_TOKENS = 10
BUCKET_MB = 0.25  # several buckets for the ~2 MB tiny model
STALL_S = 5.0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """(model dir, [x, y]): two replicas of the tiny model, each in its own process group."""
    from services.common.tiny_model import build_tiny_model

    work = tmp_path_factory.mktemp("collective")
    model_dir = build_tiny_model(work / "model")
    pending = [spawn_replica(model_dir, work, name, OVERRIDES, "tiny", {"OMP_NUM_THREADS": "1"}) for name in ("x", "y")]
    started = [p.wait() for p in pending]
    yield model_dir, started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def weights(replicas):
    """(served, perturbed) state dicts of the replicas' model."""
    import torch
    from safetensors.torch import load_file

    served = load_file(str(replicas[0] / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    return served, {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in served.items()}


@pytest.fixture(scope="module")
def sender():
    from services.trainer.weights.collective_push import CollectiveSender

    sender = CollectiveSender(TOKEN, STALL_S, "127.0.0.1")
    yield sender
    sender.close()


def version(replica) -> int:
    return rollout_stub(replica).GetInfo(rollout_pb2.GetInfoRequest()).version


def assert_serves(replica, hf_model, expected_version: int) -> None:
    for prompt in PROMPTS:
        completion = rollout_stub(replica).Generate(greedy_request(prompt, MAX_TOKENS)).completions[0]
        assert list(completion.token_ids) == hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert list(completion.logprobs) == pytest.approx(hf_logprobs(hf_model, prompt, list(completion.token_ids)), abs=1e-4)
        assert list(completion.versions) == [expected_version] * MAX_TOKENS


def test_a_collective_push_serves_the_new_weights_on_both_replicas(replicas, weights, sender):
    model_dir, (x, y) = replicas
    served, perturbed = weights
    hf_perturbed = load_hf_model(model_dir, perturbed)
    assert hf_greedy(hf_perturbed, PROMPTS[0], MAX_TOKENS) != hf_greedy(load_hf_model(model_dir), PROMPTS[0], MAX_TOKENS)

    result = sender.push(perturbed, [x.grpc_target, y.grpc_target], 1, bucket_mb=BUCKET_MB)
    assert result.failed == () and result.replicas_updated == 2 and result.num_buckets > 1
    assert result.bytes_sent >= sum(t.numel() * t.element_size() for t in perturbed.values())
    assert 0 < result.replica_peak_extra_bytes
    for replica in (x, y):
        assert version(replica) == 1
        assert_serves(replica, hf_perturbed, 1)

    # the groups stay: the next push joins nothing and brings the served weights back
    assert sender.push(served, [x.grpc_target, y.grpc_target], 2, bucket_mb=BUCKET_MB).replicas_updated == 2
    for replica in (x, y):
        assert_serves(replica, load_hf_model(model_dir), 2)


def test_a_refused_join_or_layout_is_listed_and_changes_nothing(replicas, weights, sender):
    import torch

    from services.trainer.weights.collective_push import CollectiveSender

    _, (x, _) = replicas
    served, _ = weights
    before = version(x)
    intruder = CollectiveSender("wrong-token", STALL_S, "127.0.0.1")
    result = intruder.push(served, [x.grpc_target], before + 1, bucket_mb=BUCKET_MB)
    assert result.replicas_updated == 0 and result.failed[0].error.startswith("JoinWeightGroup: UNAUTHENTICATED")

    result = sender.push(served, [x.grpc_target], before + 1, bucket_mb=BUCKET_MB, dtype=torch.bfloat16)
    assert result.replicas_updated == 0
    assert result.failed[0].error.startswith("OpenWeightTransfer: INVALID_ARGUMENT") and ".dtype: the served model holds float32, got 'bfloat16'" in result.failed[0].error
    assert version(x) == before
    rollout_stub(x).Generate(greedy_request(PROMPTS[0], 2), timeout=30)  # still generating (not paused)


def push_until_taken(sender, state: dict, replica, new_version: int, within_s: float):
    """Pushes to `replica` until it takes `new_version` (a replica that was stopped mid-transfer first ends that one)."""
    deadline = time.monotonic() + within_s
    while True:
        result = sender.push(state, [replica.grpc_target], new_version, bucket_mb=BUCKET_MB)
        if result.replicas_updated == 1 or time.monotonic() > deadline:
            return result
        time.sleep(1.0)


def test_a_stopped_replica_is_listed_after_the_stall_limit_and_takes_the_next_push(replicas, weights, sender, fault_log):
    _, (x, y) = replicas
    served, perturbed = weights
    old = version(x)
    stopped = [y.proc.pid, *descendants(y.proc.pid)]
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        result = sender.push(perturbed, [x.grpc_target, y.grpc_target], old + 1, bucket_mb=BUCKET_MB)
        took = time.monotonic() - t0
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    x_version, y_version = version(x), version(y)
    again = push_until_taken(sender, perturbed, y, old + 1, within_s=6 * STALL_S)
    y_after = version(y)
    for replica in (x, y):  # the served weights back, for the next test
        assert push_until_taken(sender, served, replica, old + 2, within_s=6 * STALL_S).replicas_updated == 1
    fault_log.check("rollout weight push (collective)", f"a collective push to two replicas, one stopped (SIGSTOP), push_stall_s {STALL_S:.0f}",
                    f"the push ends within ~push_stall_s: the running replica at version {old + 1}, the stopped one listed; "
                    "once resumed it keeps its old version and takes the next push",
                    f"push ended after {took:.1f} s: {result.replicas_updated} updated (running replica version {x_version}), "
                    f"failed {[f.error[:60] for f in result.failed]}; resumed replica at version {y_version}, "
                    f"after the next push {y_after} ({again.replicas_updated} updated)",
                    result.replicas_updated == 1 and x_version == old + 1 and took < 2 * STALL_S + 10
                    and len(result.failed) == 1 and result.failed[0].address == y.grpc_target
                    and y_version == old and again.replicas_updated == 1 and y_after == old + 1)


def test_a_replica_that_starts_mid_run_joins_at_the_next_push_without_rebuilding_the_others(replicas, weights, sender, tmp_path):
    model_dir, (x, _) = replicas
    served, perturbed = weights
    old = version(x)
    group_of_x = sender._members[x.grpc_target].group
    late = spawn_replica(model_dir, tmp_path, "late", OVERRIDES, "tiny", {"OMP_NUM_THREADS": "1"}).wait()
    try:
        assert version(late) == 0
        result = sender.push(perturbed, [x.grpc_target, late.grpc_target], old + 1, bucket_mb=BUCKET_MB)
        assert result.failed == () and result.replicas_updated == 2
        assert sender._members[x.grpc_target].group is group_of_x  # x kept its group
        hf_perturbed = load_hf_model(model_dir, perturbed)
        for replica in (x, late):
            assert_serves(replica, hf_perturbed, old + 1)
    finally:
        late.stop()
    assert sender.push(served, [x.grpc_target], old + 2, bucket_mb=BUCKET_MB).replicas_updated == 1


# The trainer's side of a push that dies mid-broadcast: bucket 0 is sent and bucket 1 on the wire when the
# process SIGKILLs itself, as when the OOM killer takes the trainer mid-push.
DYING_SENDER = """
import os, signal, sys
from safetensors.torch import load_file
from services.common.weight_wire import DictBuckets
from services.trainer.weights import collective_push

path, address, version, token, stall_s, bucket_mb = sys.argv[1:]


class DieAtTheThirdBucket(DictBuckets):
    def __iter__(self):
        for index, bucket in enumerate(super().__iter__()):
            if index == 2:  # the third bucket is gathered while bucket 1 is on the wire
                os.kill(os.getpid(), signal.SIGKILL)
            yield bucket


sender = collective_push.CollectiveSender(token, float(stall_s), "127.0.0.1")
sender.push(DieAtTheThirdBucket(load_file(path), float(bucket_mb)), [address], int(version), bucket_mb=float(bucket_mb))
"""


def test_a_trainer_killed_mid_broadcast_leaves_the_replica_refusing_generation_until_a_complete_push(
        replicas, weights, sender, tmp_path, fault_log):
    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from safetensors.torch import save_file

    from services.rollout.grpc_server import SERVICE

    model_dir, (x, _) = replicas
    served, perturbed = weights
    old = version(x)
    save_file(perturbed, str(tmp_path / "perturbed.safetensors"))
    died = subprocess.run([sys.executable, "-c", DYING_SENDER, str(tmp_path / "perturbed.safetensors"), x.grpc_target,
                           str(old + 1), TOKEN, str(STALL_S), str(BUCKET_MB)], timeout=120, capture_output=True, text=True)
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]

    deadline = time.monotonic() + STALL_S + 30  # the replica's receive fails once the group's peer is gone
    while not (info := rollout_stub(x).GetInfo(rollout_pb2.GetInfoRequest())).weights_incomplete and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as refused:
        rollout_stub(x).Generate(greedy_request(PROMPTS[0], 2), timeout=30)
    http = httpx.post(f"{x.http_base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    with grpc.insecure_channel(x.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        held_health = [health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status for name in (SERVICE, "")]
    gauge_held = "dockrl_rollout_weights_incomplete 1.0" in httpx.get(f"{x.http_base}/metrics", timeout=30).text

    mended = push_until_taken(sender, served, x, old + 1, within_s=6 * STALL_S)
    after = rollout_stub(x).GetInfo(rollout_pb2.GetInfoRequest())
    with grpc.insecure_channel(x.grpc_target) as channel:
        mended_health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status
    assert_serves(x, load_hf_model(model_dir), old + 1)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    fault_log.check("rollout weight push (collective)", "the trainer SIGKILLed mid-broadcast (bucket 1 of a collective push on the wire)",
                    "the replica keeps its old version and refuses generation (gRPC UNAVAILABLE, HTTP 503, Rollout health NOT_SERVING, "
                    "GetInfo and /metrics say why) while staying alive; the next complete push mends it",
                    f"version {info.version}, held: {info.weights_incomplete[:70]!r}; Generate {refused.value.code().name}, HTTP "
                    f"{http.status_code}, health Rollout/server {[health_pb2.HealthCheckResponse.ServingStatus.Name(h) for h in held_health]}, "
                    f"gauge 1: {gauge_held}; next push: {mended.replicas_updated} updated, version {after.version}, "
                    f"held {after.weights_incomplete!r}, health {health_pb2.HealthCheckResponse.ServingStatus.Name(mended_health)}",
                    info.version == old and info.weights_incomplete.startswith("weights incomplete")
                    and refused.value.code() == grpc.StatusCode.UNAVAILABLE and http.status_code == 503
                    and held_health == [not_serving, serving] and gauge_held
                    and mended.replicas_updated == 1 and after.version == old + 1 and after.weights_incomplete == ""
                    and mended_health == serving)

def test_a_replica_whose_worker_is_killed_mid_broadcast_is_listed_and_the_other_takes_the_push(replicas, weights, sender, fault_log):
    # The worker stops first, so the broadcast is certainly under way when it dies (as when the OOM killer
    # takes it mid-push); the replica's gRPC server answered OpenWeightTransfer before.
    model_dir, (x, y) = replicas
    served, perturbed = weights
    old = version(x)
    workers = [pid for pid in descendants(y.proc.pid) if "VLLM::Worker" in pathlib.Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    assert workers, "no vLLM worker process under the replica"
    os.kill(workers[0], signal.SIGSTOP)
    outcome = {}

    def push():
        t0 = time.monotonic()
        outcome["result"] = sender.push(perturbed, [x.grpc_target, y.grpc_target], old + 1, bucket_mb=BUCKET_MB)
        outcome["took"] = time.monotonic() - t0

    thread = threading.Thread(target=push)
    thread.start()
    time.sleep(1.0)
    os.kill(workers[0], signal.SIGKILL)
    thread.join(4 * STALL_S + 30)
    result, took = outcome["result"], outcome["took"]
    x_version = version(x)
    assert_serves(x, load_hf_model(model_dir, perturbed), old + 1)
    exit_code = y.proc.wait(timeout=120)
    sender.push(served, [x.grpc_target], old + 2, bucket_mb=BUCKET_MB)
    fault_log.check("rollout weight push (collective)", "a collective push to two replicas; one replica's vLLM worker SIGKILLed mid-broadcast",
                    f"the push ends within push_stall_s ({STALL_S:.0f} s): the other replica at version {old + 1}, the dead one listed; "
                    "the dead replica exits non-zero (its supervisor restarts it)",
                    f"push ended after {took:.1f} s: {result.replicas_updated} updated (other replica version {x_version}), "
                    f"failed {[f.error[:60] for f in result.failed]}; replica exited {exit_code}",
                    result.replicas_updated == 1 and x_version == old + 1 and took < STALL_S + 5
                    and len(result.failed) == 1 and result.failed[0].address == y.grpc_target and exit_code not in (0, None))
