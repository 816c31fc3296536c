"""The dock on a three-master Redis Cluster started on loopback: same API, one slot per run, runs spread over nodes."""
import time

import numpy as np
import pytest
import redis

from services.common.config import config_from_dict
from services.dock.client import Dock
from services.dock.schema import DockLayout
from services.dock.scripts import StaleLease

pytestmark = pytest.mark.service

N, GROUPS = 4, 16


def _cluster_dock(url: str, run_id: str, **dock_keys) -> Dock:
    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": N},
                            "dock": {"redis_url": url, "redis_cluster": True, "prefix": "cl", "run_id": run_id, **dock_keys}})
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


def test_the_dock_runs_unchanged_on_a_cluster_with_each_run_on_one_slot(redis_cluster_url):
    docks = [_cluster_dock(redis_cluster_url, f"run{i}") for i in range(6)]
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


def test_ordered_claims_priority_and_leases_hold_on_the_cluster(redis_cluster_url):
    """The dock's contract on a cluster node: guarantee_order's rank ranges, partial rollout's oldest-first, lease expiry."""
    ordered = _cluster_dock(redis_cluster_url, "ordered")
    ordered.create(DockLayout(n_samples_per_prompt=2, capacity_groups=8, guarantee_order=True))
    rows = ordered.rows_of(ordered.begin_iteration(8))
    ordered.put(rows, {"prompts": [[r] for r in rows]})
    ordered.put(rows[::-1], {"responses": [[r] for r in rows[::-1]]})  # ready in reverse: the order must not follow it
    # MindSpeed-RL's ranges: rank r of 2 owns rows [8 r, 8 r + 8), served in index order in chunks of 4.
    taken = {rank: [ordered.claim("actor_train", ["responses"], 4, dp_rank=rank, dp_size=2).indexes for _ in range(2)]
             for rank in (0, 1)}
    assert taken == {0: [[0, 1, 2, 3], [4, 5, 6, 7]], 1: [[8, 9, 10, 11], [12, 13, 14, 15]]}

    partial = _cluster_dock(redis_cluster_url, "partial")
    partial.create(DockLayout(n_samples_per_prompt=2, capacity_groups=4, partial_rollout_max_split=3))
    partial.put(list(range(8)), {"prompts": [[1]] * 8})
    first = partial.claim("actor_rollout", ["prompts"], 4, partial_columns=["responses"])  # groups 0, 1
    partial.put(first.indexes, {"responses": [[5]] * 4}, lease=first.lease, partial=True, append=True)
    again = partial.claim("actor_rollout", ["prompts"], 8, partial_columns=["responses"])
    assert again.indexes == [0, 1, 2, 3, 4, 5, 6, 7] and again.ages == [1, 1, 1, 1, 0, 0, 0, 0]  # the older groups first

    leased = _cluster_dock(redis_cluster_url, "leased", lease_seconds=0.3)
    leased.create(DockLayout(n_samples_per_prompt=2, capacity_groups=2))
    leased.put([0, 1, 2, 3], {"prompts": [[1]] * 4})
    slow = leased.claim("actor_rollout", ["prompts"], 2)
    time.sleep(0.4)
    fast = leased.claim("actor_rollout", ["prompts"], 2)
    assert fast.indexes == slow.indexes and leased.stats().requeued == 2
    with pytest.raises(StaleLease, match="no longer holds rows 0,1"):
        leased.put(slow.indexes, {"responses": [[6]] * 2}, lease=slow.lease)
    leased.put(fast.indexes, {"responses": [[7]] * 2}, lease=fast.lease)
    for dock in (ordered, partial, leased):
        dock.destroy()
