"""Bad input against a real Redis: a clear error naming the field, and nothing in Redis changes."""
import time

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.common.errors import FailedPrecondition, InvalidArgument, Unauthenticated, Unavailable
from services.dock.client import Dock
from services.dock.schema import DockLayout
from services.dock.scripts import StaleLease

pytestmark = pytest.mark.service

N = 4


def _snapshot(dock: Dock) -> dict[bytes, object]:
    """Every key of the run with its content (not DUMP bytes: a hash's order changes as Redis rehashes).

    Leaves out the writer ledger, which counts every call that reached the store, refused ones too
    (lua/lib.lua): it says what the store acknowledged, not what the pool holds.
    """
    readers = {b"string": dock.client.get, b"hash": dock.client.hgetall, b"set": dock.client.smembers,
               b"zset": lambda key: dock.client.zrange(key, 0, -1, withscores=True)}
    ledger = (dock.keys.base + "writers").encode()
    return {key: readers[dock.client.type(key)](key) for key in dock.client.scan_iter(dock.keys.pattern, count=1000) if key != ledger}


@pytest.fixture
def dock(dock_factory):
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=2))
    dock.put(list(range(8)), {"prompts": [[1, 2]] * 8, "prompt_length": [2] * 8})
    return dock


@pytest.mark.parametrize("call, error, match", [
    (lambda d: d.put([0], {"bogus": [[1]]}), InvalidArgument, r"columns: unknown column 'bogus' \(known: prompts, "),
    (lambda d: d.claim("rule_reward", ["bogus"], N), InvalidArgument, "unknown column 'bogus'"),
    (lambda d: d.claim("rule_reward", ["prompts"], 4, partial_columns=["nope"]), InvalidArgument, "unknown column 'nope'"),
    (lambda d: d.put([0], {"rollout_log_probs": [np.zeros(3)]}), InvalidArgument,
     r"columns.rollout_log_probs\[0\]: dtype float64 does not match the column's dtype float32"),
    (lambda d: d.put([0, 1], {"responses": [[1], np.zeros((2, 2), np.int32)]}), InvalidArgument,
     r"columns.responses\[1\]: shape \(2, 2\) does not fit the column's per-row shape \[\*\]"),
    (lambda d: d.put([0], {"rm_scores": [[1.0, 2.0]]}), InvalidArgument, r"shape \(2,\) does not fit .* \[\]"),
    (lambda d: d.put([0], {"responses": [[1.5]]}), InvalidArgument, "kind float64 cannot be stored in a int32 column"),
    (lambda d: d.claim("actor_rollout", ["prompts"], 6), InvalidArgument,
     r"count: 6 is not a multiple of n_samples_per_prompt=4 \(group=True claims whole groups\)"),
    (lambda d: d.claim("actor_rollout", ["prompts"], 0, group=False), InvalidArgument, "count: must be an integer >= 1"),
    (lambda d: d.put([3, 8], {"responses": [[1], [2]]}), InvalidArgument, r"indexes\[1\]: 8 is out of range \[0, 8\) of the pool"),
    (lambda d: d.put([-1], {"responses": [[1]]}), InvalidArgument, "out of range"),
    (lambda d: d.put([1, 1], {"responses": [[1], [2]]}), InvalidArgument, "indexes: an index appears twice"),
    (lambda d: d.put([0, 1], {"responses": [[1]]}), InvalidArgument, "columns.responses: 1 values for 2 indexes"),
    (lambda d: d.claim("a:b", ["prompts"], N), InvalidArgument, "consumer: 'a:b' must be a non-empty name"),
    (lambda d: d.claim("nobody", ["prompts"]), InvalidArgument, "count: no dispatch size is configured for consumer 'nobody'"),
    (lambda d: d.begin_iteration(3), InvalidArgument, r"target_groups: must be in \[1, capacity_groups=2\]"),
], ids=["put-unknown-column", "claim-unknown-column", "claim-unknown-partial-column", "wrong-dtype", "wrong-shape-2d", "wrong-shape-scalar", "float-into-int", "count-not-multiple-of-n", "count-zero", "index-out-of-range", "negative-index", "duplicate-index", "value-count-mismatch", "bad-consumer-name", "no-dispatch-size", "target-over-capacity"])
def test_bad_input_raises_a_clear_error_and_changes_nothing(dock, call, error, match, request, fault_log):
    before = _snapshot(dock)
    with pytest.raises(error, match=match) as raised:
        call(dock)
    fault_log.check("dock input", request.node.callspec.id, f"{error.__name__} matching {match!r}, no key changed",
                    f"{type(raised.value).__name__}: {str(raised.value)[:100]}; keys {'unchanged' if _snapshot(dock) == before else 'CHANGED'}",
                    _snapshot(dock) == before)


def test_a_prompt_over_max_prompt_length_is_refused_naming_the_row_and_nothing_is_written(dock_factory, fault_log):
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=2, max_prompt_length=3))
    before = _snapshot(dock)
    with pytest.raises(InvalidArgument, match=r"columns.prompts\[2\]: a prompt of 4 tokens is over rl_config.max_prompt_length = 3"):
        dock.put(list(range(4)), {"prompts": [[1], [1, 2, 3], [1, 2, 3, 4], [1]]})
    unchanged = _snapshot(dock) == before
    dock.put(list(range(4)), {"prompts": [[1], [1, 2, 3], [1, 2], [1]]})  # at the limit: taken
    fault_log.check("dock input", "a put whose third prompt is one token over max_prompt_length",
                    "InvalidArgument naming the row and the key, nothing written; prompts at the limit taken",
                    f"keys {'unchanged' if unchanged else 'CHANGED'}", unchanged)


def test_a_bad_value_late_in_a_put_writes_none_of_the_good_ones(dock, fault_log):
    before = _snapshot(dock)
    values = [np.arange(3, dtype=np.float32)] * 7 + [np.arange(3, dtype=np.float64)]
    with pytest.raises(InvalidArgument, match=r"columns.rollout_log_probs\[7\]: dtype float64"):
        dock.put(list(range(8)), {"response_length": [3] * 8, "rollout_log_probs": values})
    fault_log.check("dock input", "a put of 8 rows whose last value has the wrong dtype", "InvalidArgument, none of the 7 good rows written",
                    f"keys {'unchanged' if _snapshot(dock) == before else 'CHANGED'}", _snapshot(dock) == before)


def test_a_put_with_one_stale_row_writes_nothing(dock_factory, fault_log):
    dock = dock_factory(DockLayout(n_samples_per_prompt=1, capacity_groups=4), lease_seconds=0.2)
    dock.put([0, 1, 2, 3], {"prompts": [[1]] * 4})
    first = dock.claim("actor_rollout", ["prompts"], 2)
    time.sleep(0.3)
    second = dock.claim("actor_rollout", ["prompts"], 1)  # takes row 0 over; row 1 is free again
    assert second.indexes == [0]
    before = _snapshot(dock)
    with pytest.raises(StaleLease, match="no longer holds rows 0,1"):
        dock.put(first.indexes, {"responses": [[1], [2]]}, lease=first.lease)
    fault_log.check("dock input", "a put on an expired lease, one of its rows re-claimed by another worker", "StaleLease, nothing written",
                    f"keys {'unchanged' if _snapshot(dock) == before else 'CHANGED'}", _snapshot(dock) == before)


def test_writes_need_the_runs_token_reads_do_not(dock_factory):
    owner = dock_factory(DockLayout(n_samples_per_prompt=2, capacity_groups=2), token="s3cret")
    owner.put([0, 1], {"prompts": [[1]] * 2})
    before = _snapshot(owner)
    for token in ("", "wrong"):
        intruder = Dock(owner.client, owner.keys.prefix, owner.keys.run_id, token)
        for call in (lambda: intruder.put([2], {"prompts": [[1]]}), intruder.clear,
                     lambda: intruder.claim("actor_rollout", ["prompts"], 2),
                     lambda: intruder.create(DockLayout(n_samples_per_prompt=1, capacity_groups=1))):
            with pytest.raises(Unauthenticated, match="token"):
                call()
        assert intruder.stats().live_rows == 2 and not intruder.all_consumed("actor_rollout")
    assert _snapshot(owner) == before
    assert owner.claim("actor_rollout", ["prompts"], 2).indexes == [0, 1]


def test_calls_before_the_trainer_created_the_dock_fail_clearly(dock_factory):
    dock = dock_factory(run_id="never-created")
    with pytest.raises(FailedPrecondition, match="no dock under .*never-created.*the trainer creates it"):
        dock.claim("actor_rollout", ["prompts"], 1)


def test_an_unreachable_redis_is_unavailable():
    no_retry = Retry(NoBackoff(), 0)
    dock = Dock(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=no_retry), "p", "r")
    with pytest.raises(Unavailable, match="redis"):
        dock.stats()
