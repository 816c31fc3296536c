"""Redis memory under dock traffic: trained rows leave Redis, and dock.max_memory_mb refuses a put that would pass it.

The tests that read used_memory have a redis-server of their own: it counts every client's keys,
so the shared Redis (other tests, other developers) would blur the figures.
"""
import numpy as np
import pytest
import redis

from services.common.errors import ResourceExhausted
from services.dock.client import Dock
from services.dock.schema import DockLayout
from tests.conftest import start_redis_server, stop_redis_server

pytestmark = pytest.mark.service

N, GROUPS, TOKENS = 4, 32, 64


@pytest.fixture
def private_client(tmp_path):
    proc, url = start_redis_server(tmp_path)
    client = redis.Redis.from_url(url)
    yield client
    client.close()
    stop_redis_server(proc)


def _iteration(dock: Dock, rng: np.random.Generator) -> int:
    """One iteration's traffic (prompts; rollout, reward and trainer claims and puts); returns the rows trained."""
    rows = dock.rows_of(dock.begin_iteration(GROUPS))
    dock.put(rows, {"prompts": [rng.integers(0, 300, TOKENS, dtype=np.int32) for _ in rows], "labels": ["7"] * len(rows)})
    while (c := dock.claim("actor_rollout", ["prompts"], 4 * N)) is not None:
        dock.put(c.indexes, {"responses": [rng.integers(0, 300, TOKENS, dtype=np.int32) for _ in c.indexes],
                             "rollout_log_probs": [rng.standard_normal(TOKENS, dtype=np.float32) for _ in c.indexes]},
                 lease=c.lease, version=0)
    while (c := dock.claim("rule_reward", ["responses", "labels"], 4 * N)) is not None:
        dock.put(c.indexes, {"rm_scores": [1.0] * len(c)}, lease=c.lease)
    trained = 0
    while (c := dock.claim("actor_train", ["prompts", "responses", "rm_scores"], 8 * N)) is not None:
        dock.ack(c.lease, c.indexes)
        trained += len(c)
    return trained


def test_used_memory_and_keys_stay_flat_over_many_iterations(private_client):
    dock = Dock(private_client, "mem", "run")
    dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=GROUPS))
    rng = np.random.default_rng(0)
    memory, keys = [], []
    for _ in range(60):
        assert _iteration(dock, rng) == GROUPS * N
        dock.begin_iteration(GROUPS)  # retires what was trained: the pool is empty again
        memory.append(private_client.info("memory")["used_memory"])
        keys.append(private_client.dbsize())
    one_pool = GROUPS * N * 3 * TOKENS * 4  # bytes of one iteration's token columns, far less than the whole traffic
    assert len(set(keys)) == 1, keys  # no key outlives its iteration
    assert max(memory[10:]) - min(memory[10:]) < one_pool, memory  # no growth past allocator noise
    books = dock.stats()
    assert (books.live_rows, books.retired_groups, books.unaccounted_rows()) == (0, 60 * GROUPS, 0)


def test_a_put_that_would_pass_max_memory_is_refused_whole(private_client):
    used_mb = private_client.info("memory")["used_memory"] / 2**20
    dock = Dock(private_client, "mem", "run", max_memory_mb=used_mb + 4)
    dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=GROUPS))
    dock.put(dock.rows_of([0]), {"prompts": [np.zeros(16, np.int32)] * N})  # well within the limit
    big = [np.zeros(2**18, np.int32)] * N  # 4 MiB
    with pytest.raises(ResourceExhausted, match=r"a put of 4\.0 MiB would take Redis .* past dock\.max_memory_mb"):
        dock.put(dock.rows_of([1]), {"prompts": big})
    assert dock.read(dock.rows_of([1]), ["prompts"])["prompts"] == [None] * N  # nothing of it was written
    assert dock.stats().live_rows == N
    roomy = Dock(private_client, "mem", "run", max_memory_mb=used_mb + 64)
    assert roomy.put(dock.rows_of([1]), {"prompts": big}) == N


def _values_and_ready_bits(client: redis.Redis, dock: Dock) -> tuple[list[bytes], int]:
    """The run's value keys and how many ready flags are set in all its `ready:{column}` bitmaps."""
    values = sorted(client.scan_iter(dock.keys.base + "val:*", count=1000))
    ready = sum(client.bitcount(key) for key in client.scan_iter(dock.keys.base + "ready:*", count=1000))
    return values, ready


def test_a_pool_made_before_the_stored_set_still_removes_every_retired_value(dock_factory):
    """A dock created by the code before the `stored` set (meta `format`, lua/lib.lua) retires rows as that code did.

    Its state is built as that code left it: a meta hash without `format`, values and ready flags
    of several columns, and no `stored` set. A put of this code then starts the set with one column
    only, as a run resumed on its old dock would; retiring must still remove every column's values.
    """
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=2))
    client, meta = dock.client, dock.keys.meta
    rows = dock.rows_of([0, 1])
    dock.put(rows, {"prompts": [np.array([1, 2, 3], np.int32)] * len(rows), "labels": ["7"] * len(rows),
                    "responses": [np.array([4, 5], np.int32)] * len(rows)})
    client.hdel(meta, "format")
    client.delete(dock.keys.base + "stored")
    dock.put(rows, {"rm_scores": [1.0] * len(rows)})  # after the upgrade: `stored` = {rm_scores}
    claim = dock.claim("actor_train", ["prompts", "responses", "rm_scores"], len(rows))
    assert claim is not None and claim.indexes == rows
    dock.ack(claim.lease, claim.indexes)
    assert dock.begin_iteration(2) == [0, 1]
    assert _values_and_ready_bits(client, dock) == ([], 0)
    # Emptied by clear, the old pool takes this format: its `stored` set is complete from then on.
    dock.clear()
    assert client.hget(meta, "format") == b"2"
    dock.put(rows, {"prompts": [np.array([1], np.int32)] * len(rows), "responses": [np.array([2], np.int32)] * len(rows)})
    claim = dock.claim("actor_train", ["prompts", "responses"], len(rows))
    dock.ack(claim.lease, claim.indexes)
    assert dock.begin_iteration(2) == [0, 1]
    assert _values_and_ready_bits(client, dock) == ([], 0)
