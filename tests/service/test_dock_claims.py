"""Claims against a real Redis: atomic under threads and processes, ordered mode, oldest-first partial rollout."""
import multiprocessing
import random
import threading
import time

import numpy as np
import pytest
import redis

from services.dock.client import Dock
from services.dock.schema import DockLayout

pytestmark = pytest.mark.service

N = 4


def _fill_prompts(dock: Dock, groups) -> None:
    rows = dock.rows_of(groups)
    dock.put(rows, {"prompts": [[1, 2, 3]] * len(rows), "prompt_length": [3] * len(rows)})


def _claim_until_empty(dock: Dock, count: int, started=None) -> list[int]:
    """Claims and acks until the pool is empty; with `started` (a barrier), every claimer holds
    one claim before any takes a second, so that on a loaded machine the first one started does
    not empty the pool alone and the race the test is about does happen."""
    taken = []
    while (claim := dock.claim("actor_rollout", ["prompts"], count)) is not None:
        taken += claim.indexes
        dock.ack(claim.lease, claim.indexes)
        if started is not None:
            started.wait(60)
            started = None
    return taken


def test_threads_never_share_a_row_and_take_every_row_once(dock_factory):
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=128))
    _fill_prompts(dock, range(128))
    results: list[list[int]] = [[] for _ in range(8)]
    started = threading.Barrier(8)
    threads = [threading.Thread(target=lambda i=i: results[i].extend(_claim_until_empty(dock, 2 * N, started))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken = [row for result in results for row in result]
    assert sorted(taken) == list(range(128 * N))  # every row, none twice
    assert all(results)  # the work really was shared
    for result in results:  # group claims keep a prompt's n samples together
        assert all(result[i] // N == result[i + N - 1] // N for i in range(0, len(result), N))
    assert dock.all_consumed("actor_rollout")


def _process_claimer(redis_url, prefix, run_id, queue, started):
    dock = Dock(redis.Redis.from_url(redis_url), prefix, run_id)
    queue.put(_claim_until_empty(dock, N, started))


def test_processes_never_share_a_row_and_take_every_row_once(dock_factory, redis_url):
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=128))
    _fill_prompts(dock, range(128))
    ctx = multiprocessing.get_context("fork")
    queue, started = ctx.Queue(), ctx.Barrier(4)
    procs = [ctx.Process(target=_process_claimer, args=(redis_url, dock.keys.prefix, dock.keys.run_id, queue, started))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
        assert p.exitcode == 0
    taken = [row for result in results for row in result]
    assert sorted(taken) == list(range(128 * N))
    assert all(results)
    assert dock.stats().consumed["actor_rollout"] == 128 * N


def _ordered_run(dock_factory, run_id: str, put_seed: int) -> dict[int, list[list[int]]]:
    """Puts responses in a random order from a thread while two DP ranks claim; returns each rank's claims."""
    dock = dock_factory(DockLayout(n_samples_per_prompt=2, capacity_groups=16, guarantee_order=True), run_id=run_id)
    _fill_prompts(dock, range(16))
    order = list(range(32))
    random.Random(put_seed).shuffle(order)

    def producer():
        for row in order:
            dock.put([row], {"responses": [np.array([row], dtype=np.int32)]})
            time.sleep(0.001)

    seen: dict[int, list[list[int]]] = {0: [], 1: []}

    def consumer(rank):
        while len(seen[rank]) < 4:
            claim = dock.claim("actor_train", ["responses"], 4, dp_rank=rank, dp_size=2, timeout_s=5)
            assert claim is not None, f"rank {rank} starved"
            assert [int(v[0]) for v in claim.columns["responses"]] == claim.indexes
            seen[rank].append(claim.indexes)

    threads = [threading.Thread(target=producer)] + [threading.Thread(target=consumer, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seen


def test_ordered_mode_is_deterministic_whatever_the_put_order(dock_factory):
    first = _ordered_run(dock_factory, "a", put_seed=1)
    second = _ordered_run(dock_factory, "b", put_seed=2)
    assert first == second
    # MindSpeed-RL's ranges: rank r owns rows [16 r, 16 r + 16), served in chunks of 4 in index order.
    assert first == {r: [list(range(16 * r + 4 * c, 16 * r + 4 * c + 4)) for c in range(4)] for r in (0, 1)}


def test_ordered_mode_waits_for_the_next_rows_instead_of_skipping(dock_factory):
    dock = dock_factory(DockLayout(n_samples_per_prompt=2, capacity_groups=4, guarantee_order=True))
    _fill_prompts(dock, range(4))
    dock.put([2, 3], {"responses": [[9], [9]]})  # rows 0-1 are not ready yet
    assert dock.claim("actor_train", ["responses"], 2, dp_rank=0, dp_size=1) is None
    dock.put([0, 1], {"responses": [[9], [9]]})
    assert dock.claim("actor_train", ["responses"], 2, dp_rank=0, dp_size=1).indexes == [0, 1]
    assert dock.claim("actor_train", ["responses"], 2, dp_rank=0, dp_size=1).indexes == [2, 3]


def _partial_layout(**kw) -> DockLayout:
    return DockLayout(n_samples_per_prompt=2, capacity_groups=4, partial_rollout_max_split=3, **kw)


def _rollout_round(dock: Dock, count: int, finished_groups: set[int]):
    """One rollout claim: the rows of `finished_groups` end, the others go back partial (age + 1)."""
    claim = dock.claim("actor_rollout", ["prompts"], count, partial_columns=["responses"])
    done = [i for i in claim.indexes if i // 2 in finished_groups]
    rest = [i for i in claim.indexes if i // 2 not in finished_groups]
    if done:
        dock.put(done, {"responses": [[7]] * len(done)}, lease=claim.lease, append=True)
    if rest:
        dock.put(rest, {"responses": [[5]] * len(rest)}, lease=claim.lease, append=True, partial=True)
    return claim


def test_priority_mode_serves_the_oldest_partial_groups_first(dock_factory):
    dock = dock_factory(_partial_layout())
    _fill_prompts(dock, range(4))
    _rollout_round(dock, 6, finished_groups={0})  # groups 0, 1, 2: 0 ends, 1 and 2 now age 1
    _rollout_round(dock, 2, finished_groups=set())  # the oldest, group 1, goes to age 2
    claim = dock.claim("actor_rollout", ["prompts"], 8, partial_columns=["responses"])
    assert claim.indexes == [2, 3, 4, 5, 6, 7]  # group 1 (age 2), group 2 (age 1), group 3 (age 0)
    assert claim.ages == [2, 2, 1, 1, 0, 0]
    # a partial response is appended to what earlier splits stored
    assert [v.tolist() if v is not None else None for v in claim.columns["responses"]] == [[5, 5], [5, 5], [5], [5], None, None]
    assert dock.stats().groups_by_age == {0: 2, 1: 1, 2: 1}


def test_downstream_sees_a_group_only_when_all_its_samples_are_complete(dock_factory):
    dock = dock_factory(_partial_layout())
    _fill_prompts(dock, range(1))
    claim = dock.claim("actor_rollout", ["prompts"], 2)
    dock.put([0], {"responses": [[7]]}, lease=claim.lease)
    dock.put([1], {"responses": [[5]]}, lease=claim.lease, partial=True)
    assert dock.claim("rule_reward", ["prompts", "responses"], 1, group=False) is None  # row 0 is done, its group is not
    again = dock.claim("actor_rollout", ["prompts"], 1, group=False)
    dock.put(again.indexes, {"responses": [[8]]}, lease=again.lease, append=True)
    scored = dock.claim("rule_reward", ["prompts", "responses"], 2)
    assert scored.indexes == [0, 1] and scored.columns["responses"][1].tolist() == [5, 8]


def test_rollout_stops_at_the_target_but_finishes_groups_at_max_age(dock_factory):
    dock = dock_factory(_partial_layout())  # max_split 3: age 2 is the last split
    _fill_prompts(dock, range(4))
    assert dock.begin_iteration(target_groups=2) == []  # all four slots hold prompts
    _rollout_round(dock, 8, finished_groups={0})  # 1, 2, 3 -> age 1
    _rollout_round(dock, 2, finished_groups=set())  # the oldest (lowest id on a tie), 1 -> age 2
    claim = dock.claim("actor_rollout", ["prompts"], 4)
    assert [i // 2 for i in claim.indexes] == [1, 1, 2, 2]
    dock.put(claim.indexes[2:], {"responses": [[7], [7]]}, lease=claim.lease, append=True)  # group 2 ends
    dock.release(claim.lease, claim.indexes[:2])  # group 1's worker stops before finishing it
    assert dock.stats().complete_groups == 2  # the target
    # require_max_age_all_finished: the max-age group 1 must still finish; group 3 (age 1) waits
    assert not dock.rollout_done()
    claim = dock.claim("actor_rollout", ["prompts"], 8)
    assert [i // 2 for i in claim.indexes] == [1, 1]
    dock.put(claim.indexes, {"responses": [[7], [7]]}, lease=claim.lease, append=True)
    assert dock.rollout_done()
    assert dock.claim("actor_rollout", ["prompts"], 8) is None
    assert dock.stats().groups_by_age == {0: 1, 1: 2, 2: 1}  # groups 0 | 2, 3 | 1


def test_next_iteration_starts_with_the_unfinished_groups(dock_factory):
    dock = dock_factory(_partial_layout(require_max_age_all_finished=False))
    _fill_prompts(dock, range(4))
    dock.begin_iteration(target_groups=2)
    _rollout_round(dock, 8, finished_groups={0, 2})  # 1 and 3 -> age 1
    assert dock.rollout_done() and dock.claim("actor_rollout", ["prompts"], 2) is None
    trained = dock.claim("actor_train", ["responses"], 4)
    assert trained.indexes == [0, 1, 4, 5]
    dock.ack(trained.lease, trained.indexes)
    free = dock.begin_iteration(target_groups=2)
    assert free == [0, 2]  # the trained groups' slots; 1 and 3 stay with their ages
    stats = dock.stats()
    assert (stats.live_rows, stats.complete_groups, stats.retired_groups) == (4, 0, 2)
    _fill_prompts(dock, free)
    claim = dock.claim("actor_rollout", ["prompts"], 8, partial_columns=["responses"])
    assert [i // 2 for i in claim.indexes[::2]] == [1, 3, 0, 2] and claim.ages == [1, 1, 1, 1, 0, 0, 0, 0]


def test_claims_default_to_the_consumers_dispatch_size(dock_factory):
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=8, dispatch_sizes={"actor_rollout": 3 * N}))
    _fill_prompts(dock, range(8))
    assert [len(dock.claim("actor_rollout", ["prompts"])) for _ in range(3)] == [3 * N, 3 * N, 2 * N]


def test_claims_take_the_lowest_free_groups_past_gaps_and_unready_rows(dock_factory):
    # Claims pick from a bitmap of takeable rows: released rows in the middle come first, groups
    # with an unready row are passed over, and rows far past the consumed prefix are found.
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=300))
    _fill_prompts(dock, range(300))
    first, middle, last = (dock.claim("actor_rollout", ["prompts"], 2 * N) for _ in range(3))
    assert [first.indexes[0], middle.indexes[0], last.indexes[0]] == [0, 2 * N, 4 * N]
    dock.release(middle.lease, middle.indexes)
    assert dock.claim("actor_rollout", ["prompts"], 2 * N).indexes == middle.indexes
    rows = dock.rows_of(range(300))
    dock.put([r for r in rows if r != N * 10 + 1], {"responses": [[1]] * (len(rows) - 1)})  # group 10 lacks a response
    reward = dock.claim("rule_reward", ["prompts", "responses"], 11 * N)
    assert [i // N for i in reward.indexes[::N]] == [*range(10), 11]
    dock.ack(reward.lease, reward.indexes)
    tail = dock.claim("rule_reward", ["prompts", "responses"], 300 * N)
    assert [i // N for i in tail.indexes[::N]] == list(range(12, 300))



def test_groups_admitted_in_an_earlier_iteration_are_claimed_first_whatever_their_slot(dock_factory):
    # Asynchronous RL admits each iteration into the slots trained groups left, often below groups
    # admitted earlier: the trainer must still take the earlier ones first, or they go stale waiting.
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=6))
    _fill_prompts(dock, range(6))
    trained = dock.claim("actor_train", ["prompts"], 2 * N)
    assert [i // N for i in trained.indexes[::N]] == [0, 1]
    dock.ack(trained.lease, trained.indexes)
    assert dock.begin_iteration(target_groups=2) == [0, 1]
    _fill_prompts(dock, [0, 1])  # the next round, in the lowest slots
    trained = dock.claim("actor_train", ["prompts"], 2 * N)
    dock.ack(trained.lease, trained.indexes)
    assert [i // N for i in trained.indexes[::N]] == [2, 3]
    assert dock.begin_iteration(target_groups=2) == [2, 3]
    _fill_prompts(dock, [2, 3])
    assert [i // N for i in _claim_until_empty(dock, N)[::N]] == [4, 5, 0, 1, 2, 3]  # rollout too, round by round


def test_a_waiting_claim_is_woken_by_a_put_or_a_release_not_by_its_next_poll(dock_factory, redis_url):
    owner = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=4))
    # a poll of 30 s: a claim that gets its rows within seconds was woken
    waiter = Dock(redis.Redis.from_url(redis_url), owner.keys.prefix, owner.keys.run_id, poll_s=30.0)

    def claim_while(change) -> list[int]:
        got = []
        thread = threading.Thread(target=lambda: got.append(waiter.claim("actor_rollout", ["prompts"], N, timeout_s=60)))
        started = time.monotonic()
        thread.start()
        time.sleep(0.5)  # the claim found nothing and waits
        change()
        thread.join(20)
        assert not thread.is_alive() and got[0] is not None, "the waiting claim slept through the change"
        assert time.monotonic() - started < 15
        return got[0].indexes

    # prompts put
    assert claim_while(lambda: _fill_prompts(owner, [0])) == owner.rows_of([0])
    # rows another replica of the consumer held and gave back unprocessed (it stopped)
    _fill_prompts(owner, [1])
    rival = owner.claim("actor_rollout", ["prompts"], N)
    assert claim_while(lambda: owner.release(rival.lease, rival.indexes)) == owner.rows_of([1])
