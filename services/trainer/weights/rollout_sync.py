"""Which rollout replicas are live, and keeping every one of them on the current weights.

Replicas register themselves in the dock's registry; a replica that joins mid-run reports an
old version and gets the current weights before it takes work that will be trained on.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from services.common.config import Config
from services.common.errors import Unavailable
from services.common.log import log_event
from services.common.weight_wire import BucketSource
from services.dock.registry import Replica, ReplicaRegistry
from services.trainer.weights.transport import build_transport
from services.trainer.weights.weight_push import PushResult

logger = logging.getLogger("dockrl.trainer")


class ReplicaSync:
    """Weight pushes to the registry's live rollout replicas (rank 0 only; other ranks hold None)."""

    def __init__(self, cfg: Config, registry: ReplicaRegistry | None, token: str):
        self._cfg = cfg
        self._registry = registry
        # replica id -> version last pushed to it: the registry learns a new version only at the
        # replica's next heartbeat, and one push of a version is enough.
        self._pushed: dict[str, int] = {}
        self._transport = build_transport(cfg, token)

    def live_addresses(self) -> list[str]:
        """gRPC addresses of the live rollout replicas, sorted by replica id."""
        return [r.address for r in self._registry.live("rollout")]

    def wait_for_replicas(self, timeout_s: float) -> list[str]:
        """Blocks until at least one rollout replica is registered."""
        deadline = time.monotonic() + timeout_s
        while not (addresses := self.live_addresses()):
            if time.monotonic() > deadline:
                raise Unavailable(f"no rollout replica registered in the dock within {timeout_s:.0f} s")
            time.sleep(0.5)
        return addresses

    def _push(self, weights: BucketSource, addresses: list[str], version: int) -> PushResult:
        result = self._transport.push(weights, addresses, version)
        log_event(logger, "weights pushed", version=version, replicas=result.replicas_updated, mb=f"{result.bytes_sent / 2**20:.1f}",
                  seconds=f"{result.seconds:.2f}", failed=len(result.failed), transport=self._cfg.trainer.weight_transport)
        for failure in result.failed:
            log_event(logger, "replica missed the push", level=logging.WARNING, replica=failure.address, error=failure.error)
        return result

    def push_to(self, weights: BucketSource, replicas: Sequence[Replica], version: int) -> PushResult:
        """Pushes `weights` as `version` to `replicas` (every live one, or those `lagging` named); remembers who took it."""
        result = self._push(weights, [r.address for r in replicas], version)
        failed = {f.address for f in result.failed}
        self._pushed.update({r.replica_id: version for r in replicas if r.address not in failed})
        return result

    def push_all(self, weights: BucketSource, version: int) -> PushResult:
        """Pushes `weights` (trainer.bucket_mb buckets in the replicas' dtype) as `version` to every live replica.

        When none is live or none took it (the only replica just died), the run goes on: a replica that
        registers gets `version` before it takes work (`lagging`), and the next iteration's wait for
        scored groups ends the run only when none comes within trainer.rollout_timeout_s."""
        replicas = self._registry.live("rollout")
        if replicas:
            result = self.push_to(weights, replicas, version)
        else:
            for _ in weights:  # the other ranks take part in the stream's gathers
                pass
            result = PushResult(version, 0, 0.0, 0, 0, ())
        if result.replicas_updated == 0:
            log_event(logger, "weight push reached no replica", level=logging.WARNING, version=version, failed=len(result.failed),
                      then="a replica that registers gets this version before it takes work")
        return result

    def lagging(self, version: int) -> list[Replica]:
        """The live replicas that serve another version than `version` and were not pushed it (joined late, or missed a
        push): the ones a push of the model as it is brings up to date."""
        return [r for r in self._registry.live("rollout") if r.version != version and self._pushed.get(r.replica_id) != version]

    def any_address(self) -> str:
        """One live rollout replica (the first by id), for evaluation calls."""
        return self.wait_for_replicas(timeout_s=60.0)[0]

    def reward_address(self, wait_s: float = 60.0) -> str:
        """A live reward replica from the registry, else the configured reward address. While no reward
        replica has registered at all (services start together), waits up to `wait_s` for one."""
        deadline = time.monotonic() + wait_s
        while not (replicas := self._registry.live("reward")) and time.monotonic() < deadline:
            time.sleep(0.5)
        live = [r for r in replicas if r.serves_grpc]
        if live:
            return live[0].address
        if not self._cfg.reward.grpc_port:
            raise Unavailable("no reward replica with a gRPC address is registered, and reward.grpc_port is 0")
        return f"{self._cfg.reward.host}:{self._cfg.reward.grpc_port}"
