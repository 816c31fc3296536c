"""The dock's lease and iteration writes need the run's token too (tests/service/test_dock_errors.py covers
create, put, claim and clear); reads do not."""
from __future__ import annotations

import pytest

from services.common.errors import Unauthenticated
from services.dock.client import Dock
from services.dock.schema import DockLayout

pytestmark = pytest.mark.service


def test_lease_and_iteration_writes_need_the_runs_token(dock_factory, fault_log):
    owner = dock_factory(DockLayout(n_samples_per_prompt=2, capacity_groups=2), token="dock-s3cret")
    owner.put([0, 1, 2, 3], {"prompts": [[1]] * 4})
    claim = owner.claim("actor_rollout", ["prompts"], 2)
    writes = {
        "ack": lambda d: d.ack(claim.lease, claim.indexes),
        "release": lambda d: d.release(claim.lease, claim.indexes),
        "renew": lambda d: d.renew(claim.lease, claim.indexes),
        "begin_iteration": lambda d: d.begin_iteration(1),
        "destroy": lambda d: d.destroy(),
    }
    for token, what in (("", "no token"), ("wrong", "a wrong token")):
        intruder = Dock(owner.client, owner.keys.prefix, owner.keys.run_id, token)
        for name, write in writes.items():
            try:
                write(intruder)
                observed = "accepted"
            except Unauthenticated as exc:
                observed = f"Unauthenticated: {exc}"
            stats = intruder.stats()  # a read: no token needed
            fault_log.check("dock auth", f"{name} with {what}", "Unauthenticated, the pool unchanged",
                            f"{observed[:90]}; live rows {stats.live_rows}, leased {stats.leased.get('actor_rollout', 0)}",
                            observed.startswith("Unauthenticated") and stats.live_rows == 4 and stats.leased.get("actor_rollout") == 2)
    owner.ack(claim.lease, claim.indexes)
    fault_log.check("dock auth", "ack with the run's token", "the lease ends", f"leased {owner.stats().leased.get('actor_rollout', 0)}",
                    owner.stats().leased.get("actor_rollout", 0) == 0)
