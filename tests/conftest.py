"""Fixtures shared by every test tier."""
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

# tests/service/rollout_harness.py holds the session's shared rollout replicas; every tier imports it by that name
SERVICE_TESTS = str(pathlib.Path(__file__).parent / "service")
if SERVICE_TESTS not in sys.path:
    sys.path.insert(0, SERVICE_TESTS)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """The default tiny Qwen2-layout model, built once per test session."""
    from services.common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS had free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_answers(url: str, password: str = "") -> bool:
    """True when a Redis at `url` answers PING (authenticating with `password` if given)."""
    import redis

    try:
        return bool(redis.Redis.from_url(url, password=password or None, socket_timeout=1, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def start_redis_server(directory: pathlib.Path, *flags: str, port: int | None = None, password: str = "") -> tuple[subprocess.Popen, str]:
    """Starts `redis-server` on loopback (a free port unless given) with data in `directory`; returns it and its URL.

    With `password` the server requires it (`--requirepass`); the URL does not carry it.
    """
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh")
    port = port or free_port()
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", str(directory), *flags,
         *(("--requirepass", password) if password else ())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        if redis_answers(url, password) or proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is not None:
        raise RuntimeError(f"redis-server exited with {proc.returncode} on port {port}")
    return proc, url


def stop_redis_server(proc: subprocess.Popen) -> None:
    """Stops a server from start_redis_server and waits for it."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A Redis URL: the shared one at 127.0.0.1:6379, or a redis-server started for this session."""
    shared = "redis://127.0.0.1:6379/0"
    if redis_answers(shared):
        yield shared
        return
    proc, url = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield url
    stop_redis_server(proc)


@pytest.fixture(scope="module")
def redis_cluster_url(tmp_path_factory):
    """Three cluster-enabled redis-servers joined with `redis-cli --cluster create` (no replicas); yields one node's URL."""
    import redis

    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli is not installed: run scripts/setup.sh")
    procs, urls = [], []
    try:
        for i in range(3):
            # an explicit bus port: the default (port + 10000) does not exist for a free port above 55535
            proc, url = start_redis_server(tmp_path_factory.mktemp(f"cluster{i}"), "--cluster-enabled", "yes",
                                           "--cluster-config-file", "nodes.conf", "--cluster-port", str(free_port()),
                                           "--appendonly", "no")
            procs.append(proc)
            urls.append(url)
        nodes = [url.split("//")[1].split("/")[0] for url in urls]
        subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        for url in urls:  # every node must agree the cluster is up before a client asks for the slot map
            node = redis.Redis.from_url(url)
            deadline = time.monotonic() + 30
            while node.cluster("info").get("cluster_state") != "ok":
                assert time.monotonic() < deadline, f"cluster state at {url}: {node.cluster('info')}"
                time.sleep(0.1)
            node.close()
        yield urls[0]
    finally:
        for proc in procs:
            stop_redis_server(proc)


@pytest.fixture
def dock_factory(redis_url):
    """Makes Docks with a created layout under a unique prefix; deletes every key they made afterwards."""
    import uuid

    import redis

    from services.dock.client import Dock

    client = redis.Redis.from_url(redis_url)
    prefix = f"test-{uuid.uuid4().hex[:12]}"

    def make(layout=None, run_id: str = "run", token: str = "", lease_seconds: float = 30.0) -> Dock:
        dock = Dock(client, prefix, run_id, token, lease_seconds, poll_s=0.01)
        if layout is not None:
            dock.create(layout)
        return dock

    yield make
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
def fault_log(request):
    """The session's table of what was tried and what held (tests/fault_log.py); `.check(...)` records a row."""
    from tests.fault_log import SESSION_LOG

    SESSION_LOG.test = request.node.nodeid
    return SESSION_LOG


def pytest_configure(config):
    """Before any test starts a process: mark this pytest's environment so that nothing it starts outlives it
    (tests/reaper.py)."""
    from tests import reaper

    reaper.start()


def pytest_unconfigure(config):
    """As pytest ends, however: the watchdog learns what is still running (tests/reaper.py)."""
    from tests import reaper

    reaper.hand_over()


def pytest_sessionfinish(session, exitstatus):
    """Writes the fault table when fault or security tests recorded rows."""
    from tests.fault_log import SESSION_LOG

    if SESSION_LOG.rows:
        SESSION_LOG.write()


@pytest.fixture(scope="session")
def rollout_servers(request):
    """The session's shared rollout replicas (tests/service/rollout_harness.py), for tests outside tests/service."""
    import rollout_harness

    return rollout_harness.shared_servers(request)
