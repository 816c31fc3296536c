"""The trainer's push to its run's live replicas when none can take it: the run goes on, and the weight
stream is still read to its end (in a multi-rank trainer the other ranks take part in its gathers)."""
import socket

import pytest
import torch

from services.common.config import load_config
from services.common.weight_wire import DictBuckets
from services.dock.registry import ReplicaRegistry
from services.trainer.weights.rollout_sync import ReplicaSync

pytestmark = pytest.mark.service


class CountedBuckets(DictBuckets):
    """A BucketSource that counts the buckets read from it."""

    read = 0

    def __iter__(self):
        for bucket in super().__iter__():
            self.read += 1
            yield bucket


def _dead_address() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("transport", ["grpc", "collective"])
@pytest.mark.parametrize("replicas", ["none", "one that just died"])
def test_a_push_no_replica_takes_is_logged_and_the_run_goes_on(dock_factory, caplog, transport, replicas):
    dock = dock_factory()
    registry = ReplicaRegistry(dock.client, dock.keys, ttl_s=30)
    if replicas != "none":
        registry.register("rollout-0", _dead_address(), "rollout")
    cfg = load_config(None, [f"trainer.weight_transport={transport}", "trainer.push_stall_s=5", "trainer.bucket_mb=1",
                             "generate_config.dtype=float32"])
    sync = ReplicaSync(cfg, registry, token="")
    weights = CountedBuckets({f"w{i}": torch.ones(512, 512) for i in range(4)}, bucket_mb=1, dtype=torch.float32)
    with caplog.at_level("WARNING", logger="dockrl.trainer"):
        result = sync.push_all(weights, version=3)
    assert result.replicas_updated == 0 and result.version == 3
    assert weights.read == len(weights.plan) == 4  # every bucket read, one each
    assert any(r.getMessage() == "weight push reached no replica" for r in caplog.records)
