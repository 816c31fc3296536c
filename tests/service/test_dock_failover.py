"""The dock behind Redis Sentinel: a primary, one replica and a Sentinel on loopback, the primary SIGKILLed mid-iteration.

The replica's link to the primary is cut before the kill (REPLICAOF to a closed port), so the
writes after the cut reach the primary only: the lag asynchronous replication always has, made
certain instead of left to timing. Sentinel then promotes a replica that lacks them. The tests
check that every client finds its lost writes and puts them again (or, with
dock.min_replicas_acked, that none it was told succeeded is lost), and that the iteration still
trains every row exactly once with no row claimed twice.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
import redis
import yaml

from services.common.config import config_from_dict
from services.common.errors import FailedPrecondition, Unavailable
from services.dock import journal as journal_module
from services.dock.client import Dock
from services.dock.journal import ReplicasBehind
from services.dock.scripts import StaleLease
from services.dock.schema import DockLayout
from tests.conftest import free_port, redis_answers, start_redis_server, stop_redis_server

pytestmark = pytest.mark.service

N, GROUPS = 4, 8
ROWS = N * GROUPS
PASSWORD = "failover-secret"
MASTER = "dockmaster"


@dataclass
class SentinelSet:
    """The servers of one test: the primary and replica processes, their ports, the sentinel's address."""

    primary: subprocess.Popen
    primary_port: int
    replica: subprocess.Popen
    replica_port: int
    sentinel: subprocess.Popen
    sentinel_address: str
    primary_dir: object

    def client(self, port: int) -> redis.Redis:
        """A plain client of one server (authenticated)."""
        return redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=5)

    def cut_replica_link(self) -> None:
        """Points the replica at a closed port: it keeps its data but receives nothing more from the primary."""
        primary = self.client(self.primary_port)
        assert primary.wait(1, 5000) == 1  # everything so far is on the replica
        self.client(self.replica_port).replicaof("127.0.0.1", free_port())

    def kill_primary(self) -> None:
        """SIGKILLs the primary, then points the replica back at its address, where Sentinel expects it."""
        os.kill(self.primary.pid, signal.SIGKILL)
        self.primary.wait()
        self.client(self.replica_port).replicaof("127.0.0.1", self.primary_port)

    def restart_old_primary_as_replica(self) -> subprocess.Popen:
        """Starts a server on the old primary's port that replicates the promoted one (a replica for WAIT to count).

        Sentinel may never promote it (replica-priority 0): it starts empty and syncs after a few
        seconds, so a failover to it would drop the pool.
        """
        self.primary, _ = start_redis_server(self.primary_dir, "--appendonly", "no", "--masterauth", PASSWORD,
                                             "--replicaof", "127.0.0.1", str(self.replica_port), "--replica-priority", "0",
                                             port=self.primary_port, password=PASSWORD)
        _wait_for(lambda: self.client(self.primary_port).info("replication").get("master_link_status") == "up", "the new replica's sync")
        return self.primary


def _wait_for(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def sentinel_set(tmp_path):
    """A primary, a replica and one Sentinel (quorum 1, down after 5 s), all on 127.0.0.1, data servers behind a password."""
    started: list[subprocess.Popen] = []
    try:
        primary, primary_url = start_redis_server(tmp_path, "--appendonly", "no", "--masterauth", PASSWORD, password=PASSWORD)
        started.append(primary)
        primary_port = int(primary_url.rsplit(":", 1)[1].split("/")[0])
        replica_dir = tmp_path / "replica"
        replica_dir.mkdir()
        replica, replica_url = start_redis_server(replica_dir, "--appendonly", "no", "--masterauth", PASSWORD,
                                                  "--replicaof", "127.0.0.1", str(primary_port), password=PASSWORD)
        started.append(replica)
        replica_port = int(replica_url.rsplit(":", 1)[1].split("/")[0])
        sentinel_dir = tmp_path / "sentinel"
        sentinel_dir.mkdir()
        sentinel_port = free_port()
        conf = sentinel_dir / "sentinel.conf"  # Sentinel rewrites its config file, so it gets its own
        # Down after 5 s, not 1: a server of a loaded 2-core machine can miss Sentinel's pings for
        # a second (seen just after a promotion, on Sentinel's new link to the promoted primary),
        # and Sentinel then fails over again, to a replica the test did not mean to promote.
        conf.write_text(f"port {sentinel_port}\nbind 127.0.0.1\ndir {sentinel_dir}\n"
                        f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 1\n"
                        f"sentinel auth-pass {MASTER} {PASSWORD}\n"
                        f"sentinel down-after-milliseconds {MASTER} 5000\n"
                        f"sentinel failover-timeout {MASTER} 10000\n")
        sentinel = subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(sentinel)
        sentinels = redis.Redis(host="127.0.0.1", port=sentinel_port, socket_timeout=2)
        _wait_for(lambda: redis_answers(f"redis://127.0.0.1:{sentinel_port}"), "the sentinel")
        _wait_for(lambda: any(int(r["port"]) == replica_port for r in sentinels.sentinel_slaves(MASTER)), "the sentinel to see the replica")
        _wait_for(lambda: redis.Redis(host="127.0.0.1", port=replica_port, password=PASSWORD).info("replication")
                  ["master_link_status"] == "up", "the replica's link")
        servers = SentinelSet(primary, primary_port, replica, replica_port, sentinel, f"127.0.0.1:{sentinel_port}", tmp_path)
        yield servers
        started.append(servers.primary)  # a restarted old primary
    finally:
        for proc in started:
            if proc.poll() is None:
                stop_redis_server(proc)


def _docks(servers: SentinelSet, **dock_keys) -> dict[str, Dock]:
    """The trainer's, two rollout workers' and a reward worker's Dock, each through the sentinels, as from their configs."""
    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": N},
                            "dock": {"redis_sentinels": [servers.sentinel_address], "redis_sentinel_master": MASTER,
                                     "redis_password": PASSWORD, "prefix": "fo", "run_id": "run", "reconnect_timeout_s": 30,
                                     **dock_keys}})
    return {role: Dock.from_config(cfg, holder=role) for role in ("trainer", "rollout-0", "reward-0", "rollout-1")}


class Roles:
    """Drives the three consumers one call at a time and records every claim, so a test can count them."""

    def __init__(self, docks: dict[str, Dock]):
        self.trainer, self.rollout, self.reward = docks["trainer"], docks["rollout-0"], docks["reward-0"]
        self.claimed: dict[str, list[int]] = {"actor_rollout": [], "rule_reward": [], "actor_train": []}

    def put_prompts(self, groups: list[int]) -> None:
        rows = self.trainer.rows_of(groups)
        self.trainer.put(rows, {"prompts": [np.array([r], np.int32) for r in rows], "labels": [str(r % 2) for r in rows]})

    def claim_rollout(self):
        claim = self.rollout.claim("actor_rollout", ["prompts"], 2 * N)
        if claim is not None:
            self.claimed["actor_rollout"] += claim.indexes
        return claim

    def put_responses(self, claim) -> None:
        self.rollout.put(claim.indexes, {"responses": [p + 1 for p in claim.columns["prompts"]]}, lease=claim.lease, version=1)

    def claim_reward(self):
        claim = self.reward.claim("rule_reward", ["responses", "labels"], 2 * N)
        if claim is not None:
            self.claimed["rule_reward"] += claim.indexes
        return claim

    def put_scores(self, claim) -> None:
        self.reward.put(claim.indexes, {"rm_scores": [float(r[0] % 2) for r in claim.columns["responses"]]}, lease=claim.lease)

    def train(self) -> int:
        """Claims what actor_train can take, checks each row's data and acks it; returns the rows trained."""
        claim = self.trainer.claim("actor_train", ["prompts", "responses", "rm_scores"], 2 * N)
        if claim is None:
            return 0
        for row, p, r, s in zip(claim.indexes, claim.columns["prompts"], claim.columns["responses"], claim.columns["rm_scores"]):
            assert (p[0], r[0], float(s)) == (row, row + 1, float((row + 1) % 2)), row
        self.trainer.ack(claim.lease, claim.indexes)
        self.claimed["actor_train"] += claim.indexes
        return len(claim.indexes)

    def finish(self, timeout_s: float = 60.0) -> None:
        """Runs every consumer until actor_train has trained the whole pool."""
        deadline = time.monotonic() + timeout_s
        while len(self.claimed["actor_train"]) < ROWS:
            assert time.monotonic() < deadline, f"trained {sorted(self.claimed['actor_train'])} of {ROWS} rows"
            while (c := self.claim_rollout()) is not None:
                self.put_responses(c)
            while (c := self.claim_reward()) is not None:
                self.put_scores(c)
            if not self.train():
                time.sleep(0.1)


def _assert_each_row_once(roles: Roles) -> None:
    for consumer, rows in roles.claimed.items():
        assert sorted(rows) == list(range(ROWS)), f"{consumer} claimed {sorted(rows)}"
    stats = roles.trainer.stats()
    assert stats.unaccounted_rows() == 0 and stats.leased == {c: 0 for c in stats.leased}, stats
    assert (stats.live_rows, stats.complete_groups, stats.consumed["actor_train"]) == (ROWS, GROUPS, ROWS)


def test_a_failover_that_loses_writes_is_detected_and_they_are_put_again(sentinel_set):
    docks = _docks(sentinel_set)
    roles = Roles(docks)
    # The data servers still want their password: the sentinel setup does not open them.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=sentinel_set.primary_port).ping()
    roles.trainer.create(DockLayout(n_samples_per_prompt=N, capacity_groups=GROUPS))
    assert roles.trainer.begin_iteration(GROUPS) == list(range(GROUPS))
    roles.put_prompts(list(range(GROUPS // 2)))
    roles.put_responses(roles.claim_rollout())
    roles.put_scores(roles.claim_reward())
    assert roles.train() == 2 * N
    held_by_rollout = roles.claim_rollout()  # held across the failover, put after it
    slow = docks["rollout-1"]
    # A second rollout worker asks too (nothing is left to claim): the store now counts its writes.
    # A writer whose every write a failover lost is unknown to the new primary, so nothing tells
    # it; its lost claims end as below, by a refused put (docs/dock.md, Failover).
    assert slow.claim("actor_rollout", ["prompts"], 2 * N) is None

    sentinel_set.cut_replica_link()
    # Acknowledged by the primary, never replicated: every role writes something the failover will lose.
    roles.put_prompts(list(range(GROUPS // 2, GROUPS)))
    roles.put_responses(held_by_rollout)
    lost_rollout_claim = roles.claim_rollout()
    # The second worker's claim is lost too, and it stays away until another claim takes those rows.
    lost_slow_claim = slow.claim("actor_rollout", ["prompts"], 2 * N)
    roles.put_scores(roles.claim_reward())
    assert roles.train() == 2 * N
    sentinel_set.kill_primary()

    # The trainer's next call waits for the promotion, then puts its lost writes again before it runs;
    # so does each worker's. The trainer goes first, as the driver polling the pool would: a
    # worker's lost claim is leased again only on rows that are in the pool (the trainer's lost
    # prompts are put again first), else it is dropped and the rows are redone.
    started = time.monotonic()
    assert roles.train() == 0
    failover_s = time.monotonic() - started
    roles.put_responses(lost_rollout_claim)  # a lease held across the failover, on a claim the failover lost
    roles.finish()
    _assert_each_row_once(roles)
    # The slow worker's lost claim cannot be leased again (rollout-0 took rows 24-31 after the
    # failover): it is reported as dropped, and its late put is refused like one after an expired lease.
    assert lost_slow_claim.indexes == list(range(24, 32))
    with pytest.raises(StaleLease, match="no longer holds rows 24"):
        slow.put(lost_slow_claim.indexes, {"responses": [[0]] * (2 * N)}, lease=lost_slow_claim.lease, version=1)
    assert roles.rollout.read([24], ["responses"])["responses"][0].tolist() == [25]
    assert roles.trainer.client.connection_pool.get_master_address() == ("127.0.0.1", sentinel_set.replica_port)
    # What each client lost and put again, in its order, and what it had to drop.
    lost = {role: [(r.lost_writes, r.replayed, r.dropped) for r in dock.journal.recoveries] for role, dock in docks.items()}
    assert lost == {
        "trainer": [(3, ["put rows 16-31 (prompts, labels)", "claim rows 8-15 of actor_train", "ack rows 8-15 of actor_train"], [])],
        "rollout-0": [(2, ["put rows 8-15 (responses)", "claim rows 16-23 of actor_rollout"], [])],
        "reward-0": [(2, ["claim rows 8-15 of rule_reward", "put rows 8-15 (rm_scores)"], [])],
        "rollout-1": [(1, [], ["claim rows 24-31 of actor_rollout: row 24 of a claim of actor_rollout lost in a failover "
                              "was claimed again or left the pool"])],
    }, lost
    print(f"failover: the first call after the SIGKILL returned after {failover_s:.1f} s")


def test_with_min_replicas_acked_no_acknowledged_write_is_lost(sentinel_set, tmp_path):
    # 3 s: room for a replica on a loaded 2-core machine to confirm every write in time
    docks = _docks(sentinel_set, min_replicas_acked=1, replica_ack_timeout_s=3.0)
    roles = Roles(docks)
    roles.trainer.create(DockLayout(n_samples_per_prompt=N, capacity_groups=GROUPS))
    roles.trainer.begin_iteration(GROUPS)
    roles.put_prompts(list(range(GROUPS // 2)))
    roles.put_responses(roles.claim_rollout())
    held_by_reward = roles.claim_reward()

    sentinel_set.cut_replica_link()
    # No replica confirms the write: the caller hears Unavailable, not success, after replica_ack_timeout_s.
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"put rows 16-31 .* only 0 of dock\.min_replicas_acked=1 replicas confirmed it"):
        roles.put_prompts(list(range(GROUPS // 2, GROUPS)))
    assert 3.0 <= time.monotonic() - started < 10.0
    sentinel_set.kill_primary()
    _wait_for(lambda: sentinel_set.client(sentinel_set.replica_port).info("replication")["role"] == "master", "the promotion")
    sentinel_set.restart_old_primary_as_replica()  # the promoted primary needs a replica again before writes are confirmed

    roles.put_scores(held_by_reward)  # its claim was confirmed by the replica before the cut: the lease holds
    roles.finish()
    _assert_each_row_once(roles)
    # Only the write the trainer was told had failed was missing, and it was put again; the workers lost nothing.
    assert [(r.lost_writes, r.replayed) for r in roles.trainer.journal.recoveries] == [(1, ["put rows 16-31 (prompts, labels)"])]
    assert roles.rollout.journal.recoveries == [] and roles.reward.journal.recoveries == []
    # `dockrl dock stats` with the same config asks the sentinels too, and finds the promoted primary.
    config = tmp_path / "dock.yaml"
    config.write_text(yaml.safe_dump({"rl_config": {"n_samples_per_prompt": N},
                                      "dock": {"redis_sentinels": [sentinel_set.sentinel_address], "redis_sentinel_master": MASTER,
                                               "redis_password": PASSWORD, "prefix": "fo", "run_id": "run"}}))
    shown = subprocess.run([sys.executable, "-m", "services.dock", "--config", str(config), "stats", "--json"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and json.loads(shown.stdout)["live_rows"] == ROWS, shown.stderr


def test_a_loss_older_than_the_journal_is_reported_not_skipped(dock_factory, monkeypatch):
    """The ledger set back as a failover would set it, on one Redis: lost writes the journal no longer holds fail the call."""
    monkeypatch.setattr(journal_module, "_JOURNAL_WRITES", 2)
    dock = dock_factory(DockLayout(n_samples_per_prompt=2, capacity_groups=4))  # write 1: create
    for group in range(3):  # writes 2-4; the journal keeps the last two
        dock.put(dock.rows_of([group]), {"prompts": [[group]] * 2})
    dock.client.hset(dock.keys.base + "writers", dock.journal.writer, 1)  # the store now holds write 1 only
    with pytest.raises(FailedPrecondition, match=r"lost writes 2\.\.4 of dock writer dock/\w+, older than the journal this client "
                                                 r"keeps \(writes after number 2\)"):
        dock.put(dock.rows_of([3]), {"prompts": [[3]] * 2})
    dock.client.hset(dock.keys.base + "writers", dock.journal.writer, 3)  # only write 4 lost: it is in the journal and put again
    dock.client.delete(dock.keys.value("prompts", 4), dock.keys.value("prompts", 5))
    dock.put(dock.rows_of([3]), {"prompts": [[3]] * 2})
    assert [(r.lost_writes, r.replayed) for r in dock.journal.recoveries] == [(1, ["put rows 4-5 (prompts)"])]
    assert [v.tolist() for v in dock.read([4, 5], ["prompts"])["prompts"]] == [[2], [2]]


def test_unconfirmed_replays_are_applied_and_the_call_still_says_unconfirmed(redis_url):
    """With min_replicas_acked and no replica to confirm (the shared Redis has none), lost writes are still put again in order."""
    client = redis.Redis.from_url(redis_url)
    dock = Dock(client, f"test-{uuid.uuid4().hex[:12]}", "run", min_replicas_acked=1, replica_ack_timeout_s=0.2)
    try:
        with pytest.raises(ReplicasBehind, match=r"create was applied on the primary, but only 0 of dock\.min_replicas_acked=1"):
            dock.create(DockLayout(n_samples_per_prompt=2, capacity_groups=4))
        with pytest.raises(ReplicasBehind, match="put rows 0-1"):
            dock.put([0, 1], {"prompts": [[0]] * 2})
        client.hset(dock.keys.base + "writers", dock.journal.writer, 1)  # as a failover would leave it: the put is gone
        client.delete(dock.keys.value("prompts", 0), dock.keys.value("prompts", 1))
        with pytest.raises(ReplicasBehind, match="put rows 2-3"):
            dock.put([2, 3], {"prompts": [[2]] * 2})
        assert [(r.lost_writes, r.replayed) for r in dock.journal.recoveries] == [(1, ["put rows 0-1 (prompts)"])]
        assert [v.tolist() for v in dock.read([0, 1, 2, 3], ["prompts"])["prompts"]] == [[0], [0], [2], [2]]
    finally:
        for key in client.scan_iter(dock.keys.pattern):
            client.delete(key)
        client.close()
