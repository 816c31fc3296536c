"""`python -m services.dock stats|inspect|clear` against a real Redis, as a person runs it."""
import json
import subprocess
import sys

import pytest

from services.dock.schema import DockLayout

pytestmark = pytest.mark.service


def _cli(redis_url, dock, *args):
    base = [sys.executable, "-m", "services.dock", "--redis-url", redis_url, "--prefix", dock.keys.prefix, "--run-id", dock.keys.run_id]
    return subprocess.run(base + list(args), capture_output=True, text=True, timeout=60)


def test_stats_inspect_and_clear(dock_factory, redis_url):
    dock = dock_factory(DockLayout(n_samples_per_prompt=2, capacity_groups=2), token="tok")
    dock.put([0, 1, 2, 3], {"prompts": [[1, 2, 3]] * 4, "labels": ["4"] * 4})
    claim = dock.claim("actor_rollout", ["prompts"], 2)
    dock.put(claim.indexes, {"rm_scores": [0.5, 1.0]}, lease=claim.lease)

    stats = json.loads(_cli(redis_url, dock, "stats", "--json").stdout)
    assert stats["live_rows"] == 4 and stats["ready"]["prompts"] == 4 and stats["ready"]["rm_scores"] == 2
    assert stats["consumed"] == {"actor_rollout": 2} and stats["leased"] == {"actor_rollout": 0}
    table = _cli(redis_url, dock, "stats").stdout
    assert "4/4 rows live" in table and "consumer actor_rollout: consumed 2, leased 0" in table

    shown = _cli(redis_url, dock, "inspect", "--rows", "0:2", "--columns", "prompts,labels,rm_scores").stdout.splitlines()
    assert shown == ["row 0: prompts=int32[3][1, 2, 3]  labels='4'  rm_scores=float32[][0.5]",
                     "row 1: prompts=int32[3][1, 2, 3]  labels='4'  rm_scores=float32[][1]"]

    assert _cli(redis_url, dock, "clear").returncode == 2  # needs --yes
    refused = _cli(redis_url, dock, "--token", "wrong", "clear", "--yes")
    assert refused.returncode == 1 and "needs the run's token" in refused.stderr
    assert dock.stats().live_rows == 4
    done = _cli(redis_url, dock, "--token", "tok", "clear", "--yes")
    assert done.returncode == 0 and dock.stats().live_rows == 0


def test_unknown_run_is_a_one_line_error(dock_factory, redis_url):
    result = _cli(redis_url, dock_factory(run_id="missing"), "stats")
    assert result.returncode == 1 and "the trainer creates it" in result.stderr and "Traceback" not in result.stderr
