"""Replica registry in Redis: who serves (rollout replicas, reward workers), where, and at which version.

Keys under the run's base `{prefix}:{run_id}:`:

    replicas            zset   known replica ids (all score 0, so Redis keeps them sorted by id)
    replica:{id}        hash   address, kind, version, heartbeat_ms; expires ttl after the last heartbeat

A replica registers on start, heartbeats more often than its TTL, and deregisters on shutdown;
one that dies stops heartbeating and its hash expires, so `live()` stops listing it. The
trainer's weight push sends to `live(kind="rollout")`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from services.common.errors import InvalidArgument, NotFound
from services.dock.schema import Keys
from services.dock.scripts import redis_errors

# The address of a replica that serves the dock only, with no gRPC server: a reward worker started
# without one. The registry needs a non-empty address; callers skip these (`Replica.serves_grpc`).
DOCK_ONLY = "dock-only"


@dataclass(frozen=True)
class Replica:
    """One registered server."""

    replica_id: str
    address: str  # host:port its gRPC server listens on
    kind: str  # rollout | reward | sandbox | trainer
    version: int  # policy version it serves
    heartbeat_ms: int  # the replica's wall clock (ms since the epoch) at its last heartbeat

    @property
    def serves_grpc(self) -> bool:
        """Whether `address` is a gRPC server (not `DOCK_ONLY`)."""
        return self.address != DOCK_ONLY


class ReplicaRegistry:
    """Register, heartbeat, list and deregister replicas of one run."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float = 10.0):
        if ttl_s <= 0:
            raise InvalidArgument("ttl_s", f"must be > 0, got {ttl_s!r}")
        self.client = client
        self.keys = keys
        self._ttl_ms = int(ttl_s * 1000)

    @property
    def heartbeat_period_s(self) -> float:
        """How often a replica heartbeats: a third of the TTL, so one late beat does not expire it."""
        return self._ttl_ms / 3000

    def _key(self, replica_id: str) -> str:
        return f"{self.keys.base}replica:{replica_id}"

    @property
    def _index(self) -> str:
        return self.keys.base + "replicas"

    def register(self, replica_id: str, address: str, kind: str, version: int = 0) -> Replica:
        """Adds (or refreshes) a replica; it stays listed while it heartbeats within the TTL."""
        for field, value in (("replica_id", replica_id), ("address", address), ("kind", kind)):
            if not isinstance(value, str) or not value or (field == "replica_id" and ":" in value):
                raise InvalidArgument(field, f"{value!r} must be a non-empty string" + (" without ':'" if field == "replica_id" else ""))
        now = int(time.time() * 1000)
        with redis_errors():
            pipe = self.client.pipeline()
            pipe.hset(self._key(replica_id), mapping={"address": address, "kind": kind, "version": version, "heartbeat_ms": now})
            pipe.pexpire(self._key(replica_id), self._ttl_ms)
            pipe.zadd(self._index, {replica_id: 0})
            pipe.execute()
        return Replica(replica_id, address, kind, version, now)

    def heartbeat(self, replica_id: str, version: int | None = None) -> None:
        """Extends the replica's TTL (and records the version it now serves); NotFound once it expired."""
        now = int(time.time() * 1000)
        fields = {"heartbeat_ms": now} if version is None else {"heartbeat_ms": now, "version": version}
        with redis_errors():
            if not self.client.pexpire(self._key(replica_id), self._ttl_ms):
                raise NotFound(f"replica {replica_id!r} is not registered (expired or deregistered); register again")
            self.client.hset(self._key(replica_id), mapping=fields)

    def deregister(self, replica_id: str) -> None:
        """Removes the replica now (clean shutdown)."""
        with redis_errors():
            pipe = self.client.pipeline()
            pipe.delete(self._key(replica_id))
            pipe.zrem(self._index, replica_id)
            pipe.execute()

    def live(self, kind: str | None = None) -> list[Replica]:
        """Replicas whose heartbeat is within the TTL, sorted by id (optionally one kind)."""
        with redis_errors():
            ids = [i.decode() for i in self.client.zrange(self._index, 0, -1)]
            pipe = self.client.pipeline(transaction=False)
            for replica_id in ids:
                pipe.hgetall(self._key(replica_id))
            records = pipe.execute()
            dead = [replica_id for replica_id, record in zip(ids, records) if not record]
            if dead:
                self.client.zrem(self._index, *dead)
        replicas = []
        for replica_id, record in zip(ids, records):
            if not record:
                continue
            fields = {key.decode(): value.decode() for key, value in record.items()}
            replica = Replica(replica_id, fields["address"], fields["kind"], int(fields["version"]), int(fields["heartbeat_ms"]))
            if kind is None or replica.kind == kind:
                replicas.append(replica)
        return replicas
