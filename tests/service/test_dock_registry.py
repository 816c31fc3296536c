"""The replica registry against a real Redis: heartbeats keep replicas listed, silence drops them; a Dock hands out its
run's registry and timeline."""
import time

import pytest
import redis

from services.common.errors import InvalidArgument, NotFound
from services.dock.registry import ReplicaRegistry
from services.dock.schema import DockLayout, Keys
from services.dock.timeline import Span, Timeline

pytestmark = pytest.mark.service

TTL_S = 0.4


@pytest.fixture
def registry(dock_factory, redis_url):
    dock = dock_factory()  # only for its unique prefix and cleanup
    return ReplicaRegistry(redis.Redis.from_url(redis_url), dock.keys, ttl_s=TTL_S)


def test_register_list_heartbeat_expire_deregister(registry):
    registry.register("rollout-a", "127.0.0.1:50051", "rollout")
    registry.register("rollout-b", "127.0.0.1:50052", "rollout", version=2)
    registry.register("reward-a", "127.0.0.1:50061", "reward")
    assert [(r.replica_id, r.address, r.version) for r in registry.live("rollout")] == [
        ("rollout-a", "127.0.0.1:50051", 0), ("rollout-b", "127.0.0.1:50052", 2)]
    assert [r.replica_id for r in registry.live()] == ["reward-a", "rollout-a", "rollout-b"]
    for _ in range(3):  # rollout-a keeps heartbeating past the TTL; the others fall silent
        time.sleep(TTL_S / 2)
        registry.heartbeat("rollout-a", version=5)
    assert [(r.replica_id, r.version) for r in registry.live()] == [("rollout-a", 5)]
    with pytest.raises(NotFound, match="replica 'rollout-b' is not registered"):
        registry.heartbeat("rollout-b")
    registry.deregister("rollout-a")
    assert registry.live() == []


def test_registration_is_per_run(registry, redis_url):
    registry.register("rollout-a", "127.0.0.1:50051", "rollout")
    other_run = ReplicaRegistry(redis.Redis.from_url(redis_url), Keys(registry.keys.prefix, "other"), ttl_s=TTL_S)
    assert other_run.live() == []
    with pytest.raises(InvalidArgument, match="address: '' must be a non-empty string"):
        registry.register("rollout-c", "", "rollout")


def test_a_dock_gives_its_runs_registry_timeline_and_whether_the_pool_exists(dock_factory):
    dock = dock_factory()
    assert not dock.exists()
    dock.create(DockLayout(n_samples_per_prompt=2, capacity_groups=2))
    assert dock.exists()
    dock.registry(ttl_s=TTL_S).register("rollout-a", "127.0.0.1:50051", "rollout")
    assert [r.replica_id for r in ReplicaRegistry(dock.client, dock.keys, ttl_s=TTL_S).live()] == ["rollout-a"]
    dock.timeline().record(Span("rollout-a", "generate", 1.0, 2.0, rows=4))
    assert Timeline(dock.client, dock.keys).spans() == [Span("rollout-a", "generate", 1.0, 2.0, 4)]
    dock.destroy()
    assert not dock.exists()
