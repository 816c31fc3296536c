"""The dock on a three-master Redis Cluster started on loopback: same API, one slot per run, runs spread over nodes."""
import shutil
import subprocess
import time

import numpy as np
import pytest
import redis

from services.common.config import config_from_dict
from services.dock.client import Dock
from services.dock.schema import DockLayout
from tests.conftest import free_port, start_redis_server, stop_redis_server

pytestmark = pytest.mark.service

N, GROUPS = 4, 16


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory):
    """Three cluster-enabled redis-servers joined with `redis-cli --cluster create` (no replicas); yields one node's URL."""
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


def _cluster_dock(url: str, run_id: str) -> Dock:
    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": N},
                            "dock": {"redis_url": url, "redis_cluster": True, "prefix": "cl", "run_id": run_id}})
    return Dock.from_config(cfg)


def _run_an_iteration(dock: Dock) -> list[int]:
    """Prompts in, rollout and reward claims and puts, the trainer's claim and ack; returns the trained rows."""
    rows = dock.rows_of(dock.begin_iteration(GROUPS))
    dock.put(rows, {"prompts": [np.array([r], np.int32) for r in rows], "labels": [str(r % 2) for r in rows]})
    while (c := dock.claim("actor_rollout", ["prompts"], 2 * N)) is not None:
        dock.put(c.indexes, {"responses": [p + 1 for p in c.columns["prompts"]]}, lease=c.lease, version=1)
    while (c := dock.claim("rule_reward", ["responses", "labels"], 2 * N)) is not None:
        dock.put(c.indexes, {"rm_scores": [float(r[0] % 2) for r in c.columns["responses"]]}, lease=c.lease)
    trained = []
    while (c := dock.claim("actor_train", ["prompts", "responses", "rm_scores"], 4 * N)) is not None:
        assert all(r[0] == p[0] + 1 for p, r in zip(c.columns["prompts"], c.columns["responses"]))
        dock.ack(c.lease, c.indexes)
        trained += c.indexes
    return trained


def test_the_dock_runs_unchanged_on_a_cluster_with_each_run_on_one_slot(cluster_url):
    docks = [_cluster_dock(cluster_url, f"run{i}") for i in range(6)]
    assert isinstance(docks[0].client, redis.RedisCluster)
    for dock in docks:
        dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=GROUPS))
    for dock in docks:
        assert sorted(_run_an_iteration(dock)) == list(range(GROUPS * N))
        stats = dock.stats()
        assert (stats.complete_groups, stats.consumed["actor_train"], stats.leased["actor_train"]) == (GROUPS, GROUPS * N, 0)
        assert dock.begin_iteration(GROUPS) == list(range(GROUPS)) and dock.stats().unaccounted_rows() == 0
    # Each run's keys are on the one node that owns its slot; the six runs use more than one node.
    client = docks[0].client
    homes = set()
    for dock in docks:
        _run_an_iteration(dock)  # keys to look at: a full pool
        slot = client.keyslot(dock.keys.meta)
        home = client.nodes_manager.get_node_from_slot(slot)
        keys = [key for node in client.get_primaries() for key in client.scan_iter(dock.keys.pattern, target_nodes=node)]
        assert keys and {client.keyslot(key) for key in keys} == {slot}
        on_home = list(client.scan_iter(dock.keys.pattern, target_nodes=home))
        assert sorted(on_home) == sorted(keys)
        homes.add(home.name)
        dock.destroy()
    assert len(homes) > 1, homes
