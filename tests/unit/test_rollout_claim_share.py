"""How many rows a rollout replica's claim asks for: the dispatch size, split over the live replicas."""
from services.rollout.dock_worker import claim_share


def test_a_replica_added_to_a_one_replica_run_gets_half_of_each_iteration():
    # the tiny config: GBS 16 x n 8 = 128 rows, dispatch size derived for rollout.replicas 1 = 128
    assert claim_share(128, 128, live_replicas=1, n=8) == 128
    assert claim_share(128, 128, live_replicas=2, n=8) == 64
    assert claim_share(128, 128, live_replicas=3, n=8) == 48  # 42.7 rounded up to whole groups


def test_a_smaller_dispatch_size_is_kept_and_a_claim_is_at_least_one_group():
    assert claim_share(64, 128, live_replicas=2, n=8) == 64  # `dockrl up` with two replicas: unchanged
    assert claim_share(16, 128, live_replicas=1, n=8) == 16
    assert claim_share(128, 128, live_replicas=40, n=8) == 8
    assert claim_share(128, 128, live_replicas=0, n=8) == 128  # not yet listed itself: as one replica
