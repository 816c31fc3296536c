"""The compose stack for real, in one stack: the README's command with its `--scale rollout=2`
(`up --build --attach trainer --exit-code-from trainer`) runs the tiny demo to its end and returns
with the trainer's exit code; while it runs, both replicas take work and the host reaches both
through one HTTP and one gRPC address; at the end both hold the final weights and nothing runs."""
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy.stack import Stack, per_replica

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.timeout(3000)]

LOGS = "/app/runs/tiny/logs"
ITERATIONS = 40  # configs/tiny_cpu.yaml's train_iters


def test_compose_up_with_two_replicas_runs_the_demo_to_its_end_through_both(built_image, tmp_path):
    from openai import OpenAI

    stack = Stack(built_image, "dockrl-demo")
    up = None
    try:
        t0 = time.monotonic()
        up = stack.start("up", "--build", "--attach", "trainer", "--exit-code-from", "trainer", "--scale", "rollout=2")
        stack.wait_http("/health", timeout_s=900, alive=up)
        client = OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=stack.token, max_retries=5)
        model = client.models.list().data[0].id
        # nginx picks one of the resolved addresses at random per request (not strictly in turn), so
        # enough requests that both replicas are reached with certainty (2 * 2**-24 to miss one).
        for _ in range(24):
            done = client.completions.create(model=model, prompt="1+2=", max_tokens=1, temperature=0)
            assert done.choices[0].text is not None
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            for _ in range(24):
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        upstreams = [m.group(1) for ms in per_replica(stack.logs("proxy"), r"upstream=(\S+)").values() for m in ms]
        for port in (8000, 50051):
            served_by = {u.rpartition(":")[0] for u in upstreams if u.endswith(f":{port}")}
            assert len(served_by) == 2, f"the proxy sent port {port}'s requests to {served_by}, not to both replicas"
        noauth = stack.compose("exec", "-T", "redis", "sh", "-c", "REDISCLI_AUTH= redis-cli ping", check=False)
        assert "NOAUTH" in noauth.stdout + noauth.stderr, "Redis answered without its password"

        code = up.wait(timeout=1800)
        built_image.timings["demo_up_s"] = time.monotonic() - t0
        assert code == 0, f"trainer exit {code}:\n{stack.output_path.read_text()[-4000:]}"
        logs = stack.copy_out("trainer", LOGS, tmp_path / "logs")
        summary = json.loads((logs / "summary.json").read_text())
        gain = summary["test_accuracy_after"] - summary["test_accuracy_before"]
        built_image.timings["demo_held_out"] = [summary["test_accuracy_before"], summary["test_accuracy_after"]]
        assert summary["steps"] == ITERATIONS and gain >= 0.20, summary
        assert (logs / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        states = stack.compose("ps", "-a", "--format", "json").stdout
        running = [json.loads(line)["Service"] for line in states.splitlines() if json.loads(line)["State"] == "running"]
        assert running == [], f"still running after the trainer ended: {running}"

        rollout_logs = stack.logs("rollout")
        rows = {name: sum(int(m.group(1)) for m in ms) for name, ms in per_replica(rollout_logs, r"claim done rows=(\d+)").items()}
        built_image.timings["rows_per_replica"] = rows
        assert len(rows) == 2 and all(n > 0 for n in rows.values()), rows
        # both replicas were serving the final weights: the last push each applied is the last iteration's
        applied = {name: int(ms[-1].group(1)) for name, ms in per_replica(rollout_logs, r"weights applied version=(\d+)").items()}
        assert applied == {name: ITERATIONS for name in rows}, applied
    finally:
        stack.down()
        if up is not None and up.poll() is None:  # a check failed while the run went on: `down` ended it
            up.wait(timeout=120)
