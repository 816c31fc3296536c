"""The data dock's Redis (dock) and the bearer token of calls that change weights or data (auth)."""
from __future__ import annotations

from services.common.config.types import NonNegativeFloat, NonNegativeInt, PositiveFloat, config_section


@config_section
class DockConfig:
    """The Redis-backed data dock."""

    redis_url: str = ""  # empty: `dockrl up` starts a local redis-server
    prefix: str = "dockrl"  # Redis key prefix
    run_id: str = "default"  # run name; keys live under prefix:run_id
    lease_seconds: PositiveFloat = 120.0  # a claim returns to the pool if not put back within this time
    durability: bool = False  # ask Redis for AOF with appendfsync always (a crash loses no acknowledged dock write)
    redis_password: str = ""  # Redis AUTH password
    redis_tls: bool = False  # connect to Redis over TLS
    redis_username: str = ""  # Redis ACL user; empty: the default user
    redis_tls_ca_file: str = ""  # CA bundle that signs the server's certificate (with redis_tls)
    redis_cluster: bool = False  # redis_url names one node of a Redis Cluster; a run's keys share one hash slot
    socket_timeout_s: PositiveFloat = 30.0  # a Redis call that takes longer fails as Unavailable
    reconnect_timeout_s: PositiveFloat = 60.0  # Redis unreachable: calls retry with backoff this long, then fail as Unavailable
    capacity_groups: NonNegativeInt = 0  # group slots in the pool; 0: (max_staleness + 1) * GBS, one GBS more under partial rollout
    rollout_consumer: str = "actor_rollout"  # the consumer partial rollout (oldest first, ages) applies to
    claim_poll_s: PositiveFloat = 0.05  # longest a waiting claim waits before asking again (a put or release of rows wakes it sooner)
    max_memory_mb: NonNegativeFloat = 0.0  # a put that would take Redis's used_memory past this is refused (ResourceExhausted); 0: no limit
    redis_sentinels: tuple[str, ...] = ()  # host:port of each Redis Sentinel; set: the dock asks them for the primary and follows failovers (redis_url stays empty)
    redis_sentinel_master: str = ""  # the master name the sentinels monitor (`sentinel monitor NAME ...`); needed with redis_sentinels
    min_replicas_acked: NonNegativeInt = 0  # every dock write waits (Redis WAIT) until this many replicas hold it, so a failover loses no acknowledged write; 0: asynchronous
    replica_ack_timeout_s: PositiveFloat = 5.0  # how long a write waits for min_replicas_acked replicas before it fails as Unavailable


@config_section
class AuthConfig:
    """Shared bearer token for calls that change weights or data; empty disables the check."""

    token: str = ""  # the token itself (prefer token_env)
    token_env: str = "DOCKRL_TOKEN"  # read when `token` is empty
