"""Durability and credentials on a redis-server this module starts itself (free port, temp dir)."""
import dataclasses
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import redis

from services.common.config import Config, DockConfig
from services.common.errors import Unauthenticated, Unavailable
from services.dock.client import Dock
from services.dock.schema import DockLayout
from services.dock.scripts import DockMissing
from tests.conftest import free_port, start_redis_server, stop_redis_server

pytestmark = pytest.mark.service


def _config(url: str, **dock) -> Config:
    return dataclasses.replace(Config(), dock=DockConfig(redis_url=url, prefix="dur", run_id="r1", **dock))


def _wait_for_aof(client: redis.Redis) -> None:
    for _ in range(200):
        info = client.info("persistence")
        if info["aof_enabled"] and not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"AOF did not settle: {info}")


def test_state_survives_a_redis_crash_with_durability_on(tmp_path):
    proc, url = start_redis_server(tmp_path)  # started with appendonly no
    try:
        dock = Dock.from_config(_config(url, durability=True))
        assert dock.client.config_get("appendonly") == {"appendonly": "yes"}
        assert dock.client.config_get("appendfsync") == {"appendfsync": "always"}
        _wait_for_aof(dock.client)
        dock.create(DockLayout(n_samples_per_prompt=2, capacity_groups=4))
        dock.put(list(range(8)), {"prompts": [np.arange(i + 1, dtype=np.int32) for i in range(8)]})
        claim = dock.claim("actor_rollout", ["prompts"], 4)
        dock.put(claim.indexes, {"responses": [[9, 9]] * 4}, lease=claim.lease, version=3)
        held = dock.claim("actor_rollout", ["prompts"], 2)
        before = dock.stats()
        proc.send_signal(signal.SIGKILL)  # a crash right after the last reply: no shutdown save, no time to fsync
        proc.wait()
    finally:
        stop_redis_server(proc)
    # The documented recovery: start redis-server again with --appendonly yes on the same dir.
    port = redis.Redis.from_url(url).connection_pool.connection_kwargs["port"]
    proc, url = start_redis_server(tmp_path, "--appendonly", "yes", port=port)
    try:
        after = Dock.from_config(_config(url))
        assert after.stats() == before
        assert [v.tolist() for v in after.read(range(8), ["prompts"])["prompts"]] == [list(range(i + 1)) for i in range(8)]
        assert after.client.hget(after.keys.base + "version", 0) == b"3"
        after.put(held.indexes, {"responses": [[1]] * 2}, lease=held.lease)  # the lease survived too
        assert after.claim("actor_rollout", ["prompts"], 8).indexes == [6, 7]
    finally:
        stop_redis_server(proc)


def test_the_client_uses_the_configured_password(tmp_path):
    proc, url = start_redis_server(tmp_path, "--requirepass", "pw-123")
    try:
        with pytest.raises(Unauthenticated, match="redis refused the credentials"):
            Dock.from_config(_config(url)).stats()
        dock = Dock.from_config(_config(url, redis_password="pw-123"))
        dock.create(DockLayout(n_samples_per_prompt=1, capacity_groups=1))
        assert dock.stats().capacity_rows == 1
    finally:
        stop_redis_server(proc)


def test_the_client_connects_over_tls_with_the_configured_ca(tmp_path):
    assert shutil.which("openssl"), "openssl is needed to make the test certificate (Debian package openssl)"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port),
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--save", "", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        tls = _config(f"redis://127.0.0.1:{port}/0", redis_tls=True, redis_tls_ca_file=str(cert))
        for _ in range(100):  # wait until the server answers over TLS
            try:
                Dock.from_config(tls).client.ping()
                break
            except redis.RedisError:
                time.sleep(0.05)
        dock = Dock.from_config(tls)
        dock.create(DockLayout(n_samples_per_prompt=1, capacity_groups=2))
        dock.put([0], {"prompts": [[1, 2]]})
        assert dock.read([0], ["prompts"])["prompts"][0].tolist() == [1, 2]
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):  # without the CA: not trusted
            Dock.from_config(_config(f"redis://127.0.0.1:{port}/0", redis_tls=True)).client.ping()
    finally:
        stop_redis_server(proc)


def test_the_client_waits_for_a_restarting_redis_and_a_lost_dock_is_never_half_made(tmp_path):
    proc, url = start_redis_server(tmp_path, "--appendonly", "yes")
    port = redis.Redis.from_url(url).connection_pool.connection_kwargs["port"]
    dock = Dock.from_config(_config(url, reconnect_timeout_s=120.0))
    dock.create(DockLayout(n_samples_per_prompt=2, capacity_groups=2))
    dock.put([0, 1], {"prompts": [[5], [6]]})
    stop_redis_server(proc)  # SIGTERM: Redis writes the AOF out as it stops
    restarted = []

    def restart_later():
        time.sleep(1.0)  # so the call below starts while Redis is down
        restarted.append(start_redis_server(tmp_path, "--appendonly", "yes", port=port))

    restart = threading.Thread(target=restart_later)
    restart.start()
    try:
        stats = dock.stats()  # issued while Redis is down: retried with backoff until it is back
        assert (stats.admitted_rows, stats.live_rows) == (2, 2)
    finally:
        restart.join()
        stop_redis_server(restarted[0][0])
    # Back without its AOF: the run's keys are gone, and recording a policy version must not make a half dock.
    proc, url = start_redis_server(tmp_path, "--appendonly", "no", port=port)
    try:
        with pytest.raises(DockMissing, match=r"no dock under dur:\{r1\}:"):
            dock.set_policy_version(3)
        assert not dock.client.exists(dock.keys.meta)
    finally:
        stop_redis_server(proc)
    gone = Dock.from_config(_config(url, reconnect_timeout_s=0.5))
    with pytest.raises(Unavailable, match="redis"):
        gone.stats()


def test_a_busy_redis_is_a_passing_unavailable_and_the_dock_serves_after_it(tmp_path):
    # A long script (another tenant's, or a huge put) makes Redis answer BUSY to everyone: callers
    # must see Unavailable, which every worker waits out, not a raw reply error that ends them.
    proc, url = start_redis_server(tmp_path, "--busy-reply-threshold", "100")
    try:
        dock = Dock.from_config(_config(url))
        dock.create(DockLayout(n_samples_per_prompt=2, capacity_groups=2))
        blocker = threading.Thread(target=lambda: pytest.raises(redis.ResponseError, redis.Redis.from_url(url).eval,
                                                                "while true do end", 0))
        blocker.start()
        admin = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                dock.policy_version()
            except Unavailable as exc:
                assert "BUSY" in str(exc)
                break
            time.sleep(0.05)
        else:
            raise AssertionError("Redis never answered BUSY while the script ran")
        admin.script_kill()
        blocker.join(10)
        dock.put([0, 1], {"prompts": [[5], [6]]})
        assert dock.stats().live_rows == 2
    finally:
        stop_redis_server(proc)
