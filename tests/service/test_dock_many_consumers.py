"""1, 4 and 16 claimer processes of one consumer on one pool: no row claimed twice, none lost, each result kept.

Each process is a worker's loop: claim prompts, put a result under the claim's lease. The
result is the worker's own id, so a row overwritten by a second claimer would show another id.
"""
import multiprocessing

import numpy as np
import pytest
import redis

from services.dock.client import Dock
from services.dock.schema import DockLayout

pytestmark = pytest.mark.service

N, GROUPS = 4, 96


def _worker(redis_url: str, prefix: str, run_id: str, worker: int, start, queue) -> None:
    dock = Dock(redis.Redis.from_url(redis_url), prefix, run_id)
    dock.layout  # read before the start, so every worker begins claiming at once
    start.wait()
    taken = []
    while (claim := dock.claim("actor_rollout", ["prompts"], 2 * N)) is not None:
        assert [int(p[0]) for p in claim.columns["prompts"]] == claim.indexes  # each row's own value came back
        dock.put(claim.indexes, {"response_length": [worker] * len(claim)}, lease=claim.lease)
        taken += claim.indexes
    queue.put((worker, taken))


@pytest.mark.parametrize("claimers", [1, 4, 16])
def test_concurrent_claimers_take_every_row_exactly_once(dock_factory, redis_url, claimers):
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=GROUPS))
    rows = dock.rows_of(range(GROUPS))
    dock.put(rows, {"prompts": [np.array([row, 0], np.int32) for row in rows]})
    ctx = multiprocessing.get_context("fork")
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(redis_url, dock.keys.prefix, dock.keys.run_id, w, start, queue))
             for w in range(claimers)]
    for p in procs:
        p.start()
    start.set()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    taken = [row for worker_rows in results.values() for row in worker_rows]
    assert len(taken) == len(set(taken)) and sorted(taken) == rows  # none twice, none lost
    stored = [int(v) for v in dock.read(rows, ["response_length"])["response_length"]]
    assert stored == [next(w for w, worker_rows in results.items() if row in worker_rows) for row in rows]
    stats = dock.stats()
    assert (stats.consumed["actor_rollout"], stats.leased["actor_rollout"], stats.requeued) == (len(rows), 0, 0)
    assert stats.ready["response_length"] == len(rows) and stats.unaccounted_rows() == 0
