"""Leases against a real Redis: expiry requeues, stale puts are refused, ack / release / renew."""
import time

import pytest

from services.dock.schema import DockLayout
from services.dock.scripts import StaleLease

pytestmark = pytest.mark.service

LEASE_S = 0.3


@pytest.fixture
def dock(dock_factory):
    dock = dock_factory(DockLayout(n_samples_per_prompt=2, capacity_groups=4), lease_seconds=LEASE_S)
    rows = list(range(8))
    dock.put(rows, {"prompts": [[1, 2]] * 8})
    return dock


def test_expired_lease_requeues_and_the_slow_workers_put_is_refused(dock):
    slow = dock.claim("actor_rollout", ["prompts"], 4)
    assert slow.indexes == [0, 1, 2, 3]
    time.sleep(LEASE_S + 0.1)
    fast = dock.claim("actor_rollout", ["prompts"], 4)
    assert fast.indexes == [0, 1, 2, 3]  # the expired rows went back and are taken over
    assert dock.stats().requeued == 4
    with pytest.raises(StaleLease, match=r"lease of actor_rollout no longer holds rows 0,1,2,3 \(expired and requeued, or taken over\)"):
        dock.put(slow.indexes, {"responses": [[66]] * 4}, lease=slow.lease)
    dock.put(fast.indexes, {"responses": [[7]] * 4}, lease=fast.lease)
    assert [v.tolist() for v in dock.read(fast.indexes, ["responses"])["responses"]] == [[7]] * 4


def test_a_put_after_the_deadline_is_refused_even_before_anyone_takes_over(dock):
    claim = dock.claim("actor_rollout", ["prompts"], 2)
    time.sleep(LEASE_S + 0.1)
    with pytest.raises(StaleLease):
        dock.put(claim.indexes, {"responses": [[1]] * 2}, lease=claim.lease)
    assert dock.read(claim.indexes, ["responses"])["responses"] == [None, None]
    assert dock.stats().requeued == 2 and dock.stats().leased == {"actor_rollout": 0}


def test_renew_keeps_the_rows(dock):
    claim = dock.claim("actor_rollout", ["prompts"], 2)
    for _ in range(3):
        time.sleep(LEASE_S / 2)
        dock.renew(claim.lease, claim.indexes)
    assert dock.claim("actor_rollout", ["prompts"], 8).indexes == [2, 3, 4, 5, 6, 7]  # rows 0-1 still held
    dock.put(claim.indexes, {"responses": [[1]] * 2}, lease=claim.lease)
    assert dock.stats().requeued == 0


def test_release_returns_rows_now_and_ack_ends_the_lease(dock):
    claim = dock.claim("actor_rollout", ["prompts"], 8)
    dock.release(claim.lease, [0, 1])
    assert not dock.all_consumed("actor_rollout")
    again = dock.claim("actor_rollout", ["prompts"], 8)
    assert again.indexes == [0, 1]
    assert not dock.all_consumed("actor_rollout")  # leases outstanding
    with pytest.raises(StaleLease):
        dock.ack(claim.lease, [0])  # released and taken by `again`: no longer this lease's row
    dock.ack(claim.lease, claim.indexes[2:])
    dock.ack(again.lease, again.indexes)
    assert dock.all_consumed("actor_rollout")


def test_an_ack_sent_again_is_accepted_but_one_for_expired_rows_is_refused(dock):
    # redis-py sends a call again when the connection drops before the reply; the first may have been applied.
    claim = dock.claim("actor_rollout", ["prompts"], 4)
    dock.ack(claim.lease, claim.indexes)
    dock.ack(claim.lease, claim.indexes)
    assert dock.stats().leased == {"actor_rollout": 0} and dock.stats().requeued == 0
    late = dock.claim("actor_rollout", ["prompts"], 4)
    time.sleep(LEASE_S + 0.1)
    with pytest.raises(StaleLease):
        dock.ack(late.lease, late.indexes)  # expired and requeued: the rows are not done
    assert dock.claim("actor_rollout", ["prompts"], 8).indexes == [4, 5, 6, 7]


def test_all_consumed_turns_false_when_a_lease_expires(dock):
    claim = dock.claim("actor_rollout", ["prompts"], 8)
    dock.ack(claim.lease, claim.indexes[:6])
    assert not dock.all_consumed("actor_rollout")
    time.sleep(LEASE_S + 0.1)
    assert not dock.all_consumed("actor_rollout")
    assert dock.claim("actor_rollout", ["prompts"], 8).indexes == [6, 7]
