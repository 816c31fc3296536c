"""The dock client: put / claim / lease / all_consumed / clear / stats over one run's keys.

Semantics follow MindSpeed-RL's TransferDock (docs/dock.md): rows are samples, a prompt's n
samples are contiguous rows, a claim atomically picks rows whose columns are final and that the
consumer has not claimed. Here every claim is also a lease with a deadline, so a worker that
dies loses nothing: its rows return to the pool when the lease expires, and its late put is refused.
"""
from __future__ import annotations

import hashlib
import math
import ssl
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import redis
import redis.sentinel
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from services.common.config import Config, DockConfig
from services.common.errors import FailedPrecondition, InvalidArgument
from services.dock import codec
from services.dock.journal import WriteJournal
from services.dock.registry import ReplicaRegistry
from services.dock.schema import PROMPTS, DockLayout, Keys
from services.dock.scripts import DockScripts, execute, redis_errors
from services.dock.timeline import Timeline

_MGET_KEYS = 1000  # keys per MGET when reading claimed rows
_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.05, 1.0  # reconnect waits: 0.1 s, doubling up to 1 s


@dataclass(frozen=True)
class Lease:
    """A claim's hold on its rows until `deadline_ms` (Redis clock, ms since the epoch)."""

    consumer: str
    lease_id: str
    deadline_ms: int


@dataclass
class Claim:
    """Rows one claim took: `indexes` [R], group `ages` [R], and per column R values (None: not stored yet)."""

    lease: Lease
    indexes: list[int]
    ages: list[int]
    columns: dict[str, list[np.ndarray | str | None]]

    def __len__(self) -> int:
        return len(self.indexes)


@dataclass(frozen=True)
class DockStats:
    """One look at a run's pool (after requeueing expired leases)."""

    run: str
    n_samples_per_prompt: int
    capacity_rows: int
    live_rows: int
    ready: dict[str, int]  # column -> rows whose value is final
    consumed: dict[str, int]  # consumer -> rows it has claimed (leased or done)
    leased: dict[str, int]  # consumer -> rows under an outstanding lease
    requeued: int  # rows returned to the pool by expired leases, since create
    complete_groups: int
    target_groups: int
    retired_groups: int  # groups begin_iteration dropped after training, since create
    groups_by_age: dict[int, int]  # age -> live groups
    admitted_rows: int = 0  # rows put into empty slots, since create
    cleared_rows: int = 0  # rows `clear` emptied, since create

    def unaccounted_rows(self) -> int:
        """Rows that entered the pool but are neither live, retired after training nor cleared (0 when nothing was lost)."""
        return self.admitted_rows - self.live_rows - self.retired_groups * self.n_samples_per_prompt - self.cleared_rows


def token_digest(token: str) -> str:
    """What the dock stores and compares instead of the token itself ('' when no token)."""
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


class ReconnectPolicy(Retry):
    """Retries a call that lost its connection to Redis with exponential backoff for about `timeout_s`.

    A Redis that restarts (or loads its AOF) is waited for instead of failing the caller; refused
    credentials and TLS failures are not retried, since waiting cannot fix them.
    """

    def __init__(self, timeout_s: float):
        backoff = ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
        retries, waited = 0, 0.0  # as many retries as the backoff's waits take to add up to timeout_s
        while waited < timeout_s:
            retries += 1
            waited += backoff.compute(retries)
        # Only lost connections: a Redis that answers slowly already had socket_timeout_s.
        super().__init__(backoff, retries, (redis.ConnectionError,))

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        """redis-py's retry loop, with credential and TLS errors raised at once."""
        def retryable(error: Exception) -> bool:
            if isinstance(error, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
                return False
            if isinstance(error.__cause__ or error.__context__, ssl.SSLError):
                return False
            return is_retryable is None or is_retryable(error)

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def redis_client(cfg: DockConfig, redis_url: str | None = None) -> redis.Redis | redis.RedisCluster:
    """A redis-py client for `cfg`: URL, ACL user and password, TLS (and its CA), socket timeout, reconnect policy.

    With `dock.redis_cluster` it is a RedisCluster that learns the nodes from the URL's one; a
    run's keys share a hash tag (schema.Keys), so its scripts and pipelines stay on one node.
    With `dock.redis_sentinels` (and no `redis_url` given) it asks the sentinels for the primary of
    `dock.redis_sentinel_master` on every (re)connect, so a call that lost its primary retries on
    the promoted replica; a demoted primary's READONLY reply counts as a lost connection.
    """
    url = redis_url or cfg.redis_url
    if cfg.redis_sentinels and not url:
        options = {"socket_timeout": cfg.socket_timeout_s, "socket_connect_timeout": cfg.socket_timeout_s,
                   "retry": ReconnectPolicy(cfg.reconnect_timeout_s)}
        if cfg.redis_password:
            options["password"] = cfg.redis_password
        if cfg.redis_username:
            options["username"] = cfg.redis_username
        sentinels = [(host, int(port)) for host, _, port in (address.rpartition(":") for address in cfg.redis_sentinels)]
        # The sentinels themselves are asked without the data's password (they have their own, if any).
        sentinel = redis.sentinel.Sentinel(sentinels, sentinel_kwargs={"socket_timeout": cfg.socket_timeout_s,
                                                                       "socket_connect_timeout": cfg.socket_timeout_s}, **options)
        return sentinel.master_for(cfg.redis_sentinel_master)
    if not url:
        raise FailedPrecondition("dock.redis_url is empty: give a redis:// URL (or let `dockrl up` start Redis)")
    if cfg.redis_tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://"):]
    options: dict = {"socket_timeout": cfg.socket_timeout_s, "socket_connect_timeout": cfg.socket_timeout_s,
                     "retry": ReconnectPolicy(cfg.reconnect_timeout_s)}
    if cfg.redis_password:
        options["password"] = cfg.redis_password
    if cfg.redis_username:
        options["username"] = cfg.redis_username
    if url.startswith("rediss://") and cfg.redis_tls_ca_file:
        options["ssl_ca_certs"] = cfg.redis_tls_ca_file
    if cfg.redis_cluster:
        return redis.RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


def _span(rows: Sequence[int]) -> str:
    """`rows` for a log line: "8-15" when contiguous, else the first few."""
    if list(rows) == list(range(rows[0], rows[0] + len(rows))):
        return f"{rows[0]}-{rows[-1]}"
    return ",".join(map(str, rows[:6])) + (",..." if len(rows) > 6 else "")


class Dock:
    """One run's pool in Redis; use one per process.

    Thread-safe: redis-py pools connections, and writes run one at a time through `journal`, so the
    write ledger counts them in the order the store runs them.
    """

    def __init__(self, client: redis.Redis, prefix: str = "dockrl", run_id: str = "default", token: str = "",
                 lease_seconds: float = 120.0, poll_s: float = 0.05, holder: str = "", max_memory_mb: float = 0.0,
                 min_replicas_acked: int = 0, replica_ack_timeout_s: float = 5.0):
        self.client = client
        self.holder = holder  # who claims through this client (a replica id): leading part of its lease ids
        self.keys = Keys(prefix, run_id)
        self._lease_ms = int(lease_seconds * 1000)
        self._poll_s = poll_s
        self._max_memory_bytes = int(max_memory_mb * 2**20)  # 0: no limit of the dock's own (Redis's maxmemory still applies)
        self._scripts = DockScripts(client)
        self._layout: DockLayout | None = None
        # Every write goes through the ledger, which puts again what a Redis failover lost (journal.py).
        self.journal = WriteJournal(self._scripts, self.keys.base, token_digest(token), holder, min_replicas_acked,
                                    replica_ack_timeout_s)

    @classmethod
    def from_config(cls, cfg: Config, token: str = "", redis_url: str | None = None, holder: str = "") -> Dock:
        """A client for the run `cfg.dock` names; asks Redis for AOF when `dock.durability` is set."""
        dock = cls(redis_client(cfg.dock, redis_url), cfg.dock.prefix, cfg.dock.run_id, token,
                   cfg.dock.lease_seconds, cfg.dock.claim_poll_s, holder, cfg.dock.max_memory_mb,
                   cfg.dock.min_replicas_acked, cfg.dock.replica_ack_timeout_s)
        if cfg.dock.durability:
            dock.enable_durability()
        return dock

    # ------------------------------------------------------------ layout

    def create(self, layout: DockLayout) -> None:
        """Makes an empty pool with `layout` (the trainer, once per run); replaces an existing one."""
        self.journal.write("create", (layout.to_json(), layout.n_samples_per_prompt, layout.capacity_rows,
                                      layout.completion_column), "create")
        self._layout = layout

    @property
    def layout(self) -> DockLayout:
        """The run's layout as the trainer created it (read from Redis once)."""
        if self._layout is None:
            text = self._call(self.client.hget, self.keys.meta, "layout")
            if text is None:
                raise FailedPrecondition(f"no dock under {self.keys.base}; the trainer creates it (Dock.create)")
            self._layout = DockLayout.from_json(text.decode())
        return self._layout

    def rows_of(self, groups: Sequence[int]) -> list[int]:
        """The row indexes of `groups` (n contiguous rows each)."""
        n = self.layout.n_samples_per_prompt
        return [g * n + j for g in groups for j in range(n)]

    @property
    def name(self) -> str:
        """The run's place in Redis as logs name it: `prefix:{run_id}`."""
        return self.keys.base.rstrip(":")

    def exists(self) -> bool:
        """True when the run's pool is in Redis (the trainer created it and nobody destroyed it since)."""
        return bool(self._call(self.client.exists, self.keys.meta))

    # ------------------------------------------------------------ the run's other records

    def registry(self, ttl_s: float) -> ReplicaRegistry:
        """The run's replica registry; a replica that registers through it leaves it `ttl_s` after its last heartbeat."""
        return ReplicaRegistry(self.client, self.keys, ttl_s)

    def timeline(self) -> Timeline:
        """The run's timeline (who worked on what, when)."""
        return Timeline(self.client, self.keys)

    # ------------------------------------------------------------ writes

    def put(self, indexes: Sequence[int], columns: Mapping[str, Sequence[codec.Value] | np.ndarray], *,
            lease: Lease | None = None, version: int | None = None, partial: bool = False, append: bool = False) -> int:
        """Writes `columns[name][i]` to row `indexes[i]`; all or nothing.

        Final puts mark the columns ready and end `lease` on these rows. `partial=True` (partial
        rollout) stores without ready flags, returns the rows to the lease's consumer with age + 1;
        `append=True` appends 1-D variable-length columns to what is stored. With a lease the put
        is refused (StaleLease) when the lease no longer holds a row. `version` is the policy version.
        With `dock.max_memory_mb` set, a put that would take Redis's used_memory past it is refused
        whole (ResourceExhausted). A prompt longer than the layout's max_prompt_length is refused
        (InvalidArgument naming the row), and nothing of the put is written.
        """
        rows = self._check_indexes(indexes)
        if not columns:
            raise InvalidArgument("columns", "give at least one column to put")
        if partial and lease is None:
            raise InvalidArgument("partial", "a partial put returns claimed rows to the pool and needs the claim's lease")
        if version is not None and (not isinstance(version, int) or version < 0):
            raise InvalidArgument("version", f"must be an integer >= 0, got {version!r}")
        described: list = []
        blobs: list[bytes] = []
        for name, values in columns.items():
            spec = self.layout.column(name)
            if len(values) != len(rows):
                raise InvalidArgument(f"columns.{name}", f"{len(values)} values for {len(rows)} indexes")
            described += [name, "1" if spec.shape == (None,) else "0"]
            blobs += codec.encode_column(values, spec.dtype, spec.shape, lambda i, value: self._encode(spec, i, value))
            if name == PROMPTS.name and self.layout.max_prompt_length > 0:
                self._check_prompt_lengths(blobs[-len(rows):])
        # One script call carries the values: it checks the token and the lease and writes them, all or nothing.
        self.journal.write("put", (lease.consumer if lease else "", lease.lease_id if lease else "",
                                   "" if version is None else version, int(partial), int(append), self._max_memory_bytes, len(rows),
                                   len(columns), *rows, *described, *blobs),
                           f"put rows {_span(rows)} ({', '.join(columns)})")
        return len(rows)

    @staticmethod
    def _encode(spec, i: int, value: codec.Value) -> bytes:
        """One value of column `spec` converted, checked (InvalidArgument naming columns.{name}[i]) and encoded."""
        field = f"columns.{spec.name}[{i}]"
        array = codec.to_array(value, spec.dtype, field)
        if not isinstance(array, str):
            spec.check_shape(array.shape, field)
        return codec.encode(array)

    def _check_prompt_lengths(self, blobs: list[bytes]) -> None:
        """Refuses a put whose encoded prompt is longer than rl_config.max_prompt_length, naming the row."""
        limit = self.layout.max_prompt_length
        for i, blob in enumerate(blobs):
            tokens = len(codec.decode(blob))
            if tokens > limit:
                raise InvalidArgument(f"columns.{PROMPTS.name}[{i}]", f"a prompt of {tokens} tokens is over rl_config.max_prompt_length = "
                                                               f"{limit}")

    def claim(self, consumer: str, columns: Sequence[str], count: int | None = None, *, group: bool = True,
              dp_rank: int | None = None, dp_size: int = 1, partial_columns: Sequence[str] = (),
              min_count: int = 1, timeout_s: float = 0.0) -> Claim | None:
        """Atomically leases up to `count` rows whose `columns` are final and that `consumer` has not claimed.

        `count` defaults to the consumer's dispatch size from the config (rl_config.*_dispatch_size).
        group=True takes whole groups (count must be a multiple of n). Under guarantee_order the
        rows come in index order from dp_rank's fixed range of the pool (MindSpeed-RL's
        get_current_dp_range_indexes; dp_rank and dp_size apply only then); otherwise the oldest
        groups come first. Under partial rollout, resume samples of groups where some rows
        already finished with group=False (a group claim needs all n rows free). `partial_columns`
        are returned as stored so far (partial responses) without being required. Returns None
        when fewer than `min_count` rows are ready, after waiting up to `timeout_s`.
        """
        layout = self.layout
        self._check_name(consumer, "consumer")
        for name in (*columns, *partial_columns):
            layout.column(name)
        n = layout.n_samples_per_prompt
        if count is None:
            if consumer not in layout.dispatch_sizes:
                raise InvalidArgument("count", f"no dispatch size is configured for consumer {consumer!r}; pass count")
            count = layout.dispatch_sizes[consumer]
        if not isinstance(count, int) or count < 1:
            raise InvalidArgument("count", f"must be an integer >= 1, got {count!r}")
        if group and count % n:
            raise InvalidArgument("count", f"{count} is not a multiple of n_samples_per_prompt={n} (group=True claims whole groups)")
        if not 1 <= min_count <= count:
            raise InvalidArgument("min_count", f"must be in [1, count={count}], got {min_count!r}")
        lo, hi = 0, layout.capacity_rows
        if layout.guarantee_order:
            lo, hi = self._dp_range(dp_rank or 0, dp_size)
        partial = layout.partial_rollout
        rollout = partial and consumer == layout.rollout_consumer
        max_age = layout.partial_rollout_max_split - 1 if layout.require_max_age_all_finished else -1
        wanted = (*columns, *partial_columns)
        deadline = time.monotonic() + timeout_s
        while True:
            # The holder's name in the id tells an operator (or a test) whose claim holds a row.
            lease_id = f"{self.holder}/{uuid.uuid4().hex}" if self.holder else uuid.uuid4().hex
            # how long (ms) this claim waits for a wake-up if it finds too few rows; 0: it will not wait
            wait_ms = math.ceil(max(0.0, min(self._poll_s, deadline - time.monotonic())) * 1000)
            reply = self.journal.write("claim", (consumer, lease_id, self._lease_ms, count, min_count, int(group),
                                                 int(layout.guarantee_order), lo, hi, int(rollout), max_age,
                                                 int(partial and not rollout), len(columns), *columns, len(wanted), *wanted,
                                                 wait_ms),
                                       "claim", replay=lambda reply: self._claim_replay(consumer, lease_id, reply))
            left = deadline - time.monotonic()
            if reply[1] or left <= 0:
                break
            self._await_wake(consumer, min(self._poll_s, left))
        rows = reply[1]
        if not rows:
            return None
        indexes, ages = reply[2:2 + rows], reply[2 + rows:2 + 2 * rows]
        values = {name: [None if blob is None else codec.decode(blob) for blob in reply[2 + (2 + c) * rows:2 + (3 + c) * rows]]
                  for c, name in enumerate(wanted)}
        return Claim(Lease(consumer, lease_id, reply[0]), indexes, ages, values)

    def _claim_replay(self, consumer: str, lease_id: str, reply: list) -> tuple[str, tuple, str] | None:
        """How the journal applies a claim again: the same lease on the rows it took (None: it took none, nothing to redo)."""
        rows = reply[2:2 + reply[1]]
        if not rows:
            return None
        return "lease", (consumer, lease_id, "adopt", self._lease_ms, *rows), f"claim rows {_span(rows)} of {consumer}"

    def _await_wake(self, consumer: str, timeout_s: float) -> None:
        """Waits up to `timeout_s` for a put or release to wake `consumer` (the claim that found
        nothing listed it as waiting; the put pushes a token on its wake key), so the claim asks
        again about a round trip after rows become ready instead of at its next poll. Each wait
        stays at most one poll: a lease that expires wakes nobody, and replicas of one consumer
        share its token."""
        try:
            self.client.blpop([self.keys.base + f"wake:{consumer}"], timeout=timeout_s)
        except redis.RedisError:  # Redis away: the claim that follows says so, with its retries
            time.sleep(timeout_s)

    def ack(self, lease: Lease, indexes: Sequence[int]) -> None:
        """Ends the lease on rows the consumer is done with and put nothing for (e.g. actor_train)."""
        rows = self._check_indexes(indexes)
        self.journal.write("lease", (lease.consumer, lease.lease_id, "ack", self._lease_ms, *rows),
                           f"ack rows {_span(rows)} of {lease.consumer}")

    def release(self, lease: Lease, indexes: Sequence[int]) -> None:
        """Gives claimed rows back to the pool unprocessed (a worker shutting down)."""
        rows = self._check_indexes(indexes)
        self.journal.write("lease", (lease.consumer, lease.lease_id, "release", self._lease_ms, *rows),
                           f"release rows {_span(rows)} of {lease.consumer}")

    def renew(self, lease: Lease, indexes: Sequence[int]) -> int:
        """Moves the lease's deadline on these rows to now + lease_seconds; returns the new deadline (ms)."""
        rows = self._check_indexes(indexes)
        return self.journal.write("lease", (lease.consumer, lease.lease_id, "renew", self._lease_ms, *rows),
                                  f"renew rows {_span(rows)} of {lease.consumer}")

    def begin_iteration(self, target_groups: int, trained_by: str = "actor_train") -> list[int]:
        """Drops the groups `trained_by` finished, keeps unfinished ones (with their ages) and returns the free group slots.

        Sets the iteration's target of complete groups (GBS): under partial rollout the rollout
        consumer stops getting work once that many groups are complete.
        """
        self._check_name(trained_by, "trained_by")
        capacity = self.layout.capacity_groups
        if not 1 <= target_groups <= capacity:
            raise InvalidArgument("target_groups", f"must be in [1, capacity_groups={capacity}], got {target_groups!r}")
        return self.journal.write("begin_iteration", (trained_by, target_groups), f"begin_iteration({target_groups})",
                                  keep_reply=True)[1:]

    def clear(self) -> None:
        """Empties the pool (rows, flags, leases, ages); the layout and the token stay."""
        self.journal.write("clear", ("pool",), "clear")

    def destroy(self) -> None:
        """Deletes every key of the run, layout included (the run is over)."""
        self.journal.write("clear", ("all",), "destroy")
        self._layout = None

    def enable_durability(self) -> None:
        """Asks Redis for AOF with appendfsync always, and persists it to Redis's config file when it has one.

        always, not everysec: Redis then replies only after the write is on disk, so a crash never
        takes back a claim, put or ack a service was told succeeded (a sample trained twice, or lost).
        """
        self._call(self.client.config_set, "appendonly", "yes")
        self._call(self.client.config_set, "appendfsync", "always")
        if self._call(self.client.config_get, "appendonly").get("appendonly") != "yes":
            raise FailedPrecondition("redis refused appendonly yes; durability needs CONFIG SET rights")
        try:
            self.client.config_rewrite()
        except redis.ResponseError:
            pass  # started without a config file: the server's own flags must say --appendonly yes (docs/dock.md)

    # ------------------------------------------------------------ reads

    def all_consumed(self, consumer: str) -> bool:
        """True when `consumer` has claimed every row in the pool and holds no lease."""
        self._check_name(consumer, "consumer")
        return bool(self._run("all_consumed", consumer))

    def set_policy_version(self, version: int) -> None:
        """Records the policy version the trainer is collecting samples for (the trainer, each iteration)."""
        self.journal.write("set_version", (int(version),), f"set_policy_version({version})")

    def policy_version(self) -> int:
        """The version set by set_policy_version (0 before the first); rollout replicas behind it wait for weights."""
        value = self._call(self.client.hget, self.keys.meta, "policy_version")
        return int(value) if value is not None else 0

    def rollout_done(self) -> bool:
        """True once the iteration's target of complete groups exists and (require_max_age_all_finished) no group at max age is unfinished."""
        layout = self.layout
        complete, target = (int(v or 0) for v in self._call(self.client.hmget, self.keys.meta, "complete", "target"))
        if complete < target:
            return False
        if not (layout.partial_rollout and layout.require_max_age_all_finished):
            return True
        old = self._call(self.client.zrangebyscore, self.keys.base + "age", layout.partial_rollout_max_split - 1, "+inf")
        if not old:
            return True
        done = self._call(self.client.hmget, self.keys.base + "done", old)
        return all(int(d or 0) >= layout.n_samples_per_prompt for d in done)

    def read(self, indexes: Sequence[int], columns: Sequence[str]) -> dict[str, list[np.ndarray | str | None]]:
        """Values of `columns` at `indexes` as stored (None: never put), without claiming anything."""
        rows = self._check_indexes(indexes)
        for name in columns:
            self.layout.column(name)
        return self._values(rows, columns)

    def stats(self) -> DockStats:
        """Counts of the pool: rows, ready columns, consumed and leased rows per consumer, requeued, ages."""
        layout = self.layout
        self._run("sweep")
        consumers = sorted(c.decode() for c in self._call(self.client.smembers, self.keys.base + "consumers"))
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.keys.meta, "requeued", "complete", "target", "retired", "admitted", "cleared")
        pipe.bitcount(self.keys.base + "live")
        for column in layout.columns:
            pipe.bitcount(self.keys.base + f"ready:{column.name}")
        for consumer in consumers:
            pipe.bitcount(self.keys.base + f"consumed:{consumer}")
            pipe.zcard(self.keys.base + f"lease:{consumer}")
        pipe.zrange(self.keys.base + "age", 0, -1, withscores=True)
        replies = self._call(pipe.execute)
        (requeued, complete, target, retired, admitted, cleared), live = replies[0], replies[1]
        ready = dict(zip((c.name for c in layout.columns), replies[2:2 + len(layout.columns)]))
        per_consumer = replies[2 + len(layout.columns):-1]
        by_age: dict[int, int] = {}
        for _, age in replies[-1]:
            by_age[int(age)] = by_age.get(int(age), 0) + 1
        return DockStats(self.keys.base.rstrip(":"), layout.n_samples_per_prompt, layout.capacity_rows, live, ready,
                         dict(zip(consumers, per_consumer[0::2])), dict(zip(consumers, per_consumer[1::2])),
                         int(requeued or 0), int(complete or 0), int(target or 0), int(retired or 0),
                         dict(sorted(by_age.items())), int(admitted or 0), int(cleared or 0))

    # ------------------------------------------------------------ helpers

    def _values(self, rows: list[int], columns: Sequence[str]) -> dict[str, list[np.ndarray | str | None]]:
        pipe = self.client.pipeline(transaction=False)
        for name in columns:
            for first in range(0, len(rows), _MGET_KEYS):
                pipe.mget([self.keys.value(name, row) for row in rows[first:first + _MGET_KEYS]])
        replies = iter(execute(pipe))
        values = {}
        for name in columns:
            blobs = [blob for _ in range(0, len(rows), _MGET_KEYS) for blob in next(replies)]
            values[name] = [None if blob is None else codec.decode(blob) for blob in blobs]
        return values

    def _dp_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        rows = self.layout.capacity_rows
        if not isinstance(dp_size, int) or dp_size < 1 or rows % dp_size:
            raise InvalidArgument("dp_size", f"must be >= 1 and divide the pool's {rows} rows, got {dp_size!r}")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise InvalidArgument("dp_rank", f"must be in [0, dp_size={dp_size}), got {dp_rank!r}")
        assign = rows // dp_size
        return dp_rank * assign, (dp_rank + 1) * assign

    def _check_indexes(self, indexes: Sequence[int]) -> list[int]:
        rows = self.layout.capacity_rows
        if len(indexes) == 0:
            raise InvalidArgument("indexes", "give at least one row index")
        checked = []
        for i, index in enumerate(indexes):
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
                raise InvalidArgument(f"indexes[{i}]", f"expected an integer, got {type(index).__name__}")
            if not 0 <= index < rows:
                raise InvalidArgument(f"indexes[{i}]", f"{index} is out of range [0, {rows}) of the pool")
            checked.append(int(index))
        if len(set(checked)) != len(checked):
            raise InvalidArgument("indexes", "an index appears twice")
        return checked

    @staticmethod
    def _check_name(name: str, field: str) -> None:
        if not isinstance(name, str) or not name or ":" in name or "*" in name:
            raise InvalidArgument(field, f"{name!r} must be a non-empty name without ':' or '*'")

    def _run(self, script: str, *args):
        return self._scripts.run(script, self.keys.base, *args)

    @staticmethod
    def _call(fn, *args):
        with redis_errors():
            return fn(*args)
