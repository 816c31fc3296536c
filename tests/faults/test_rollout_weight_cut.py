"""A weight push cut halfway (the client cancels the stream, or its connection closes) leaves the replica
on the old version with the old outputs; the next full push succeeds. A replica whose vLLM worker dies
mid-push answers UNAVAILABLE and exits, instead of leaving the push waiting. A replica that hangs
(SIGSTOP) misses the trainer's push after push_stall_s while the others get it, keeps its old version
and takes the next push once it runs again."""
from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import grpc
import pytest
from rollout_harness import DOCK_PREFIX, OVERRIDES, REDIS_URL, TOKEN

from services.common.auth import bearer_metadata
from services.common.config import load_config
from services.common.pb import rollout_pb2, rollout_pb2_grpc
from replica_launcher import spawn_replica
from services.dock.client import Dock
from services.dock.schema import DockLayout
from push_chunks import weight_chunks
from services.trainer.weights.weight_push import push_weights
from tests.faults.loop_harness import descendants

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


def test_a_replica_whose_engine_dies_mid_push_answers_unavailable_and_exits(rollout_servers, weights, tmp_path, fault_log):
    # As when the kernel's OOM killer takes the vLLM worker: the push must end at once, the rows the
    # replica holds as a dock worker must go back to the pool, and the replica must exit so its
    # supervisor sees it, not keep answering with a dead engine.
    _, perturbed = weights
    # 512 rows of up to 96 tokens: tens of seconds of generation on a CPU, so rows are in flight at the kill
    run = ("dock.prefix=" + DOCK_PREFIX, "dock.run_id=doomed", "dock.lease_seconds=600", "megatron_training.global_batch_size=64",
           "rl_config.n_samples_per_prompt=8", "rl_config.rollout_max_tokens=96", "generate_config.sampling_config.max_tokens=96",
           # claims of one group, and a queue with room beside them for the streamed request below
           "rl_config.actor_rollout_dispatch_size=8", "rollout.max_queue=64")
    cfg = load_config(None, OVERRIDES + run)
    dock = Dock.from_config(cfg, token=TOKEN, redis_url=REDIS_URL)
    dock.create(DockLayout.from_config(cfg))
    rows = dock.rows_of(dock.begin_iteration(cfg.megatron_training.global_batch_size))
    dock.put(rows, {"prompts": [[1, 2, 3]] * len(rows)})
    replica = spawn_replica(rollout_servers.model_dir, tmp_path, "doomed", OVERRIDES + run, "tiny", {"OMP_NUM_THREADS": "1"},
                            extra_args=("--dock", REDIS_URL)).wait()
    try:
        deadline = time.monotonic() + 120
        while dock.stats().leased.get("actor_rollout", 0) == 0:
            assert time.monotonic() < deadline, "the replica never claimed"
            time.sleep(0.05)
        held = dock.stats().leased["actor_rollout"]
        workers = [pid for pid in descendants(replica.proc.pid)
                   if "VLLM::Worker" in pathlib.Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
        assert workers, "no vLLM worker process under the replica"
        chunks = list(weight_chunks(sorted(perturbed.items()), 1, BUCKET_BYTES, CHUNK_BYTES))
        sent, killed = threading.Event(), threading.Event()

        def stream():
            yield from chunks[:SENT_BEFORE_CUT]
            sent.set()
            killed.wait(30)
            yield from chunks[SENT_BEFORE_CUT:]

        stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(replica.grpc_target))
        call = stub.UpdateWeights.future(stream(), metadata=bearer_metadata(TOKEN))
        assert sent.wait(30)
        time.sleep(1.0)  # the replica stages what was sent
        # A streamed generation under way when the engine dies must end UNAVAILABLE too (not UNKNOWN).
        streaming = stub.GenerateStream(rollout_pb2.GenerateRequest(
            token_ids=rollout_pb2.TokenIds(ids=[1, 2, 3]), sampling=rollout_pb2.SamplingParams(max_tokens=96, n=8, temperature=1.0)), timeout=120)
        first_chunk = next(streaming)
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        # The stream is read to its end before the rest of the push goes: what ends it is then the
        # engine's death alone, not the push's commit racing vLLM's notice of that death.
        stream_ends = []
        try:
            stream_ends = [chunk.finish_reason for chunk in streaming if chunk.finish_reason]
            stream_code, stream_details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            stream_code, stream_details = exc.code(), exc.details() or ""
        killed.set()
        try:
            call.result(timeout=120)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        answered_s = time.monotonic() - t0
        exit_code = replica.proc.wait(timeout=120)
        exited_s = time.monotonic() - t0
        stats = dock.stats()
    finally:
        replica.stop()
        dock.destroy()
    fault_log.check("rollout weight push", f"the replica's vLLM worker SIGKILLed after {SENT_BEFORE_CUT} chunks of a push, "
                    f"while the replica held {held} dock rows (600 s lease)",
                    "UpdateWeights ends UNAVAILABLE at once; the rows go back to the pool before the lease ends; the "
                    "replica exits non-zero (its supervisor restarts it)",
                    f"call ended {code.name} after {answered_s:.1f} s ({details[:70]!r}); replica exited {exit_code} after "
                    f"{exited_s:.1f} s; rows leased afterwards {stats.leased.get('actor_rollout', 0)}, "
                    f"finished {stats.ready.get('responses', 0)} of {len(rows)}",
                    code == grpc.StatusCode.UNAVAILABLE and exit_code not in (0, None)
                    and stats.leased.get("actor_rollout", 0) == 0 and stats.ready.get("responses", 0) < len(rows))
    fault_log.check("rollout weight push", "the same kill while a GenerateStream was mid-stream (first chunk received)",
                    "the stream ends UNAVAILABLE (the status interceptor maps the engine's error), not UNKNOWN",
                    f"first chunk {len(first_chunk.token_ids)} tokens; then {stream_code.name} ({stream_details[:70]!r}), "
                    f"completions ended {stream_ends}",
                    stream_code == grpc.StatusCode.UNAVAILABLE)


STALL_S = 5.0


def test_a_hung_replica_misses_the_push_after_the_stall_limit_and_the_others_get_it(rollout_servers, weights, tmp_path, fault_log):
    # A hung replica (stopped, swapping) takes nothing more once its socket buffers are full; without a
    # limit it held the whole fan-out (every stream waits on the slowest) until the call's deadline.
    served, _ = weights
    healthy = rollout_servers.a.grpc_target
    old_version = version(healthy)
    hung = spawn_replica(rollout_servers.model_dir, tmp_path, "hung", OVERRIDES, "tiny", {"OMP_NUM_THREADS": "1"}).wait()
    stopped = [hung.proc.pid, *descendants(hung.proc.pid)]
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        result = push_weights(served, [healthy, hung.grpc_target], old_version + 1, bucket_mb=0.25, token=TOKEN, stall_s=STALL_S)
        took = time.monotonic() - t0
        healthy_version = version(healthy)
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        hung_version = version(hung.grpc_target)
        again = push_weights(served, [hung.grpc_target], old_version + 1, bucket_mb=0.25, token=TOKEN, stall_s=STALL_S)
        hung_after = version(hung.grpc_target)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        hung.stop()
        full_push(healthy, served, old_version, TOKEN)  # the other rollout tests expect the served version
    fault_log.check("rollout weight push", f"a fan-out push to two replicas, one of them stopped (SIGSTOP), push_stall_s {STALL_S:.0f}",
                    f"the push ends within ~push_stall_s: the running replica at version {old_version + 1}, the stopped one "
                    "listed as STALLED; once resumed it still serves its old version and takes the next push",
                    f"push ended after {took:.1f} s: {result.replicas_updated} updated (running replica version {healthy_version}), "
                    f"failed {[f.error[:40] for f in result.failed]}; resumed replica at version {hung_version}, "
                    f"after the next push {hung_after} ({again.replicas_updated} updated)",
                    result.replicas_updated == 1 and healthy_version == old_version + 1 and took < STALL_S + 30
                    and len(result.failed) == 1 and result.failed[0].address == hung.grpc_target and result.failed[0].error.startswith("STALLED")
                    and hung_version == 0 and again.replicas_updated == 1 and hung_after == old_version + 1)
