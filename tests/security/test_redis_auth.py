"""The dock honours dock.redis_password against a redis-server started with --requirepass, and
dock.redis_tls never falls back to plaintext."""
from __future__ import annotations

import uuid

import pytest

from services.common.config import config_from_dict
from services.common.errors import Unauthenticated, Unavailable
from services.dock.client import Dock
from services.dock.schema import DockLayout
from tests.conftest import start_redis_server, stop_redis_server

pytestmark = pytest.mark.service

PASSWORD = "redis-pw-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def protected_redis(tmp_path_factory):
    proc, url = start_redis_server(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    yield url
    stop_redis_server(proc)


def dock_config(url: str, **dock):
    return config_from_dict({"dock": {"redis_url": url, "prefix": f"sec-{uuid.uuid4().hex[:8]}", "socket_timeout_s": 2.0, **dock},
                             "rl_config": {"n_samples_per_prompt": 2}})


def outcome(cfg) -> str:
    try:
        dock = Dock.from_config(cfg)
        dock.create(DockLayout(n_samples_per_prompt=2, capacity_groups=1))
        dock.put([0, 1], {"prompts": [[7], [8]]})
        return f"accepted: read back {[[int(t) for t in p] for p in dock.read([0, 1], ['prompts'])['prompts']]}"
    except (Unauthenticated, Unavailable) as exc:
        return f"{type(exc).__name__}: {str(exc)[:80]}"


def test_the_dock_needs_the_redis_password(protected_redis, fault_log):
    for what, dock in (("no dock.redis_password", {}), ("a wrong dock.redis_password", {"redis_password": "nope"})):
        observed = outcome(dock_config(protected_redis, **dock))
        fault_log.check("redis auth", f"dock against redis --requirepass with {what}", "Unauthenticated", observed,
                        observed.startswith("Unauthenticated"))
    observed = outcome(dock_config(protected_redis, redis_password=PASSWORD))
    fault_log.check("redis auth", "dock with the right dock.redis_password", "create, put and read work", observed,
                    observed == "accepted: read back [[7], [8]]")


def test_redis_tls_never_falls_back_to_plaintext(protected_redis, fault_log):
    observed = outcome(dock_config(protected_redis, redis_password=PASSWORD, redis_tls=True))
    fault_log.check("redis auth", "dock.redis_tls=true against a plaintext redis", "refused (Unavailable), no plaintext fallback",
                    observed, observed.startswith("Unavailable"))
