"""The sandbox service as a process on loopback: programs run and report how they ended, limits are asked for
within the configured maxima, bad requests name their field, a full pool refuses, the token guards Execute,
and `--dock` lists the replica in the run's registry."""
from __future__ import annotations

import concurrent.futures
import re
import time
import uuid

import grpc
import pytest
import redis
from sandbox_harness import sandbox_server

from services.common.pb import sandbox_pb2, sandbox_pb2_grpc
from services.common.sandbox_client import ExecStatus, Program, SandboxClient
from services.dock.registry import ReplicaRegistry
from services.dock.schema import Keys

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with sandbox_server(tmp_path_factory.mktemp("sandbox"), {"workers": 2, "queue": 1}) as (proc, target):
        yield target


def test_execute_runs_a_program_on_its_stdin(server):
    with SandboxClient(server) as client:
        result = client.execute(Program("a, b = map(int, input().split())\nprint(a * b)", b"6 7\n"))
    assert (result.status, result.exit_code, result.stdout, result.reason) == (ExecStatus.OK, 0, b"42\n", "exit status 0")


def test_execute_batch_answers_in_request_order(server):
    programs = [Program(f"import time\ntime.sleep({0.3 - i * 0.1:.1f})\nprint({i})") for i in range(3)]
    with SandboxClient(server) as client:
        results = client.execute_batch(programs)
    assert [r.stdout for r in results] == [b"0\n", b"1\n", b"2\n"]


def test_a_request_may_lower_a_limit_and_raise_it_to_the_maximum(server):
    with SandboxClient(server) as client:
        short = client.execute(Program("import time\ntime.sleep(1)", wall_s=0.3))
        longer = client.execute(Program("import time\ntime.sleep(2.5)\nprint('done')", wall_s=4.0))
        small = client.execute(Program("print('x' * 100)", output_bytes=10))
    assert short.status is ExecStatus.TIMEOUT and "0.3 s" in short.reason
    assert longer.status is ExecStatus.OK and longer.stdout == b"done\n"
    assert small.status is ExecStatus.OUTPUT_LIMIT and small.stdout == b"x" * 10 and small.stdout_truncated


@pytest.mark.parametrize("request_fields, message", [
    ({"code": ""}, r"^code: is empty"),
    ({"code": "print(1)", "language": "ruby"}, r"^language: 'ruby' is not one of python"),
    ({"code": "print(1)", "wall_s": 5.0}, r"^wall_s: must be in \(0, 4\] \(sandbox.max_wall_s\), or 0 for the default 2; got 5"),
    ({"code": "print(1)", "memory_mb": -1}, r"^memory_mb: must be in \(0, 4096\] \(sandbox.max_memory_mb\)"),
    ({"code": "print(1)", "output_bytes": 1 << 30}, r"^output_bytes: must be in \(0, 16777216\] \(sandbox.max_output_bytes\)"),
    ({"code": "print(1)", "stdin": b"x" * (16 * 1024 * 1024 + 1)}, r"^stdin: 16777217 bytes; at most 16777216 \(sandbox.max_stdin_bytes\)"),
])
def test_a_bad_request_is_invalid_argument_naming_the_field_and_the_limit(server, request_fields, message):
    with grpc.insecure_channel(server, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = sandbox_pb2_grpc.SandboxStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Execute(sandbox_pb2.ExecuteRequest(**request_fields), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, exc.value.details()), exc.value.details()


def test_a_bad_item_of_a_batch_is_named_by_its_index(server):
    with SandboxClient(server) as client, pytest.raises(grpc.RpcError) as exc:
        client.execute_batch([Program("print(1)"), Program("print(2)", wall_s=9.0)])
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("items[1].wall_s: must be in (0, 4]")


def test_more_programs_than_workers_and_queue_are_refused_while_the_rest_run(server):
    # 2 workers + 1 queued: a batch of 4 never fits (the request's fault); 3 single programs fit, a 4th beside them
    # is refused until they end
    with SandboxClient(server) as client:
        with pytest.raises(grpc.RpcError) as exc:
            client.execute_batch([Program("print(1)")] * 4)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details().startswith("items: 4 programs; at most sandbox.workers + sandbox.queue = 3")
        with concurrent.futures.ThreadPoolExecutor(3) as threads:
            running = [threads.submit(client.execute, Program("import time\ntime.sleep(1)\nprint('slept')")) for _ in range(3)]
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as exc:
                client.execute(Program("print(1)"))
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "sandbox.workers + sandbox.queue = 3" in exc.value.details()
            assert [r.result().stdout for r in running] == [b"slept\n"] * 3
        assert client.execute(Program("print(1)")).stdout == b"1\n"


def test_with_a_token_execute_needs_it(tmp_path):
    with sandbox_server(tmp_path, env={"DOCKRL_TOKEN": "sandbox-test-token"}) as (proc, target):
        for token in ("", "wrong"):
            with SandboxClient(target, token) as client, pytest.raises(grpc.RpcError) as exc:
                client.execute(Program("print(1)"))
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with SandboxClient(target, "sandbox-test-token") as client:
            assert client.execute(Program("print(1)")).stdout == b"1\n"


def test_with_dock_the_replica_is_listed_as_sandbox_until_it_stops(tmp_path, redis_url):
    prefix = f"test-sandbox-{uuid.uuid4().hex[:8]}"
    config = {"dock": {"redis_url": redis_url, "prefix": prefix, "run_id": "run"}}
    client = redis.Redis.from_url(redis_url)
    registry = ReplicaRegistry(client, Keys(prefix, "run"))
    try:
        with sandbox_server(tmp_path, config=config, flags=("--dock",)) as (proc, target):
            deadline = time.monotonic() + 10
            while not (live := registry.live("sandbox")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [r.address for r in live] == [target]
            with SandboxClient(live[0].address) as sandbox:
                assert sandbox.execute(Program("print(2 + 2)")).stdout == b"4\n"
        assert registry.live("sandbox") == []
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()
