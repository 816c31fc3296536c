"""What every dock worker does around its own work: keep its entry in the replica registry, and wait
out a dock that refuses claims.

Both workers follow the same cycle: register, then until stopped claim, handle the claim, put its
rows (or release them on failure), with the entry renewed every `ReplicaRegistry.heartbeat_period_s`;
on stop they end what they hold and deregister. Each still writes that cycle itself: the rollout
worker (services/rollout/dock_worker.py) on the engine's event loop, renewing from a task of its own
since a claim generates for longer than the TTL; the reward worker (services/reward/worker.py) on a
thread, renewing between claims. The entry and the refusals are these classes.
"""
from __future__ import annotations

import logging
import time

from services.common.errors import NotFound
from services.common.log import log_event
from services.dock.registry import DOCK_ONLY, ReplicaRegistry


class RegistryEntry:
    """One worker's entry in the replica registry: registered, renewed within its TTL, removed on stop.

    `address`: the gRPC server the worker's replica serves; empty registers it as `DOCK_ONLY`."""

    def __init__(self, registry: ReplicaRegistry, replica_id: str, address: str, kind: str):
        self.registry = registry
        self.replica_id = replica_id
        self.address = address or DOCK_ONLY
        self.kind = kind
        self._renewed = -float("inf")  # monotonic time of the last register or heartbeat

    @property
    def period_s(self) -> float:
        """How often the entry is renewed."""
        return self.registry.heartbeat_period_s

    def register(self, version: int = 0) -> None:
        """Lists the worker (again, when its entry expired) serving `version`."""
        self.registry.register(self.replica_id, self.address, self.kind, version)
        self._renewed = time.monotonic()

    def renew(self, version: int | None = None) -> None:
        """Heartbeats (recording `version` when given); registers again when the entry expired, e.g.
        while Redis was away longer than the TTL or before the first registration."""
        try:
            self.registry.heartbeat(self.replica_id, version)
        except NotFound:
            self.register(0 if version is None else version)
            return
        self._renewed = time.monotonic()

    def renew_if_due(self, version: int | None = None) -> None:
        """`renew` when a period has passed since the last renewal, for a worker that renews between claims."""
        if time.monotonic() - self._renewed > self.period_s:
            self.renew(version)

    def deregister(self) -> None:
        """Removes the entry now (a clean stop), rather than when its TTL ends."""
        self.registry.deregister(self.replica_id)


class RefusalLog:
    """Logs why the dock refused work once per distinct reason, not once per retry (a worker asks
    again every second while no dock exists or Redis is away)."""

    def __init__(self, logger: logging.Logger, message: str, field: str):
        self.logger = logger
        self.message = message
        self.field = field  # the log field that carries the reason
        self._last = ""

    def refused(self, exc: Exception) -> None:
        """Logs `exc` as a warning unless it is the reason logged last."""
        if str(exc) != self._last:
            log_event(self.logger, self.message, level=logging.WARNING, **{self.field: str(exc)})
        self._last = str(exc)

    def served(self) -> None:
        """The dock answered: the next refusal is logged whatever its reason."""
        self._last = ""
