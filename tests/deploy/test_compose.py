"""The compose stack for real: images built, `docker compose up` runs the tiny demo to its end and
returns with the trainer's exit code, `--scale rollout=2` spreads the work over both replicas, and
the host reaches every replica through one HTTP and one gRPC address."""
import json
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy.stack import Stack, per_replica

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.timeout(3000)]

LOGS = "/app/runs/tiny/logs"


def test_compose_up_runs_the_demo_to_its_end(built_image, tmp_path):
    """The README's command: `up --build --attach trainer --exit-code-from trainer`."""
    stack = Stack(built_image, "dockrl-demo")
    try:
        t0 = time.monotonic()
        up = stack.compose("up", "--build", "--attach", "trainer", "--exit-code-from", "trainer", timeout=1800, check=False)
        built_image.timings["demo_up_s"] = time.monotonic() - t0
        assert up.returncode == 0, f"trainer exit {up.returncode}:\n{up.stdout[-4000:]}\n{up.stderr[-2000:]}"
        logs = stack.copy_out("trainer", LOGS, tmp_path / "logs")
        summary = json.loads((logs / "summary.json").read_text())
        gain = summary["test_accuracy_after"] - summary["test_accuracy_before"]
        built_image.timings["demo_held_out"] = [summary["test_accuracy_before"], summary["test_accuracy_after"]]
        assert summary["steps"] == 40 and gain >= 0.20, summary
        assert (logs / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        states = stack.compose("ps", "-a", "--format", "json").stdout
        running = [json.loads(line)["Service"] for line in states.splitlines() if json.loads(line)["State"] == "running"]
        assert running == [], f"still running after the trainer ended: {running}"
    finally:
        stack.down()


def test_two_rollout_replicas_share_the_work_and_the_proxy(built_image, tmp_path):
    """`--scale rollout=2`: both replicas take rows, both hold the final weights, and the host's one
    HTTP and one gRPC address reach both."""
    from openai import OpenAI

    iterations = 12
    stack = Stack(built_image, "dockrl-scaled", {"DOCKRL__MEGATRON_TRAINING__TRAIN_ITERS": str(iterations),
                                                 "DOCKRL__TRAINER__EVAL_INTERVAL": "0"})
    try:
        t0 = time.monotonic()
        stack.compose("up", "-d", "--build", "--scale", "rollout=2", timeout=1800)  # waits for prepare and healthy replicas
        stack.wait_http("/health", timeout_s=600)
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

        waited = stack.compose("wait", "trainer", timeout=1500, check=False)  # "container ... exited with status code N"
        built_image.timings["scaled_up_s"] = time.monotonic() - t0
        status = re.search(r"exited with status code (\d+)", waited.stdout + waited.stderr)
        assert status and status.group(1) == "0", f"trainer: {waited.stdout!r}:\n{stack.logs('trainer')[-4000:]}"
        rows = {name: sum(int(m.group(1)) for m in ms)
                for name, ms in per_replica(stack.logs("rollout"), r"claim done rows=(\d+)").items()}
        built_image.timings["scaled_rows_per_replica"] = rows
        assert len(rows) == 2 and all(n > 0 for n in rows.values()), rows
        summary = json.loads((stack.copy_out("trainer", LOGS, tmp_path / "logs") / "summary.json").read_text())
        assert summary["steps"] == iterations
        for index in (1, 2):
            shown = stack.compose("exec", "-T", "--index", str(index), "rollout", "python", "-c",
                                  "import urllib.request; print(urllib.request.urlopen("
                                  "'http://127.0.0.1:8000/v1/policy_version').read().decode())").stdout
            assert json.loads(shown)["policy_version"] == iterations, f"rollout-{index}: {shown}"
    finally:
        stack.down()
