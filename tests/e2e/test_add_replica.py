"""The README's way of adding a rollout replica, against a running `dockrl up` of the tiny config on one host:
the command `dockrl up` wrote joins the run, generates in the same iterations as rollout-0 (the iteration is
split over the live replicas), and leaves on SIGTERM with nothing lost while the run goes on."""
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import ROOT, up_argv

pytestmark = [pytest.mark.service, pytest.mark.slow]


def _wait_for(predicate, timeout_s: float, what: str, *alive: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for proc in alive:
            assert proc.poll() is None, f"exited {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)


def _readme_command(log_dir: pathlib.Path) -> list[str]:
    """The README's add-a-replica command, pointed at this run's log directory."""
    shown = re.search(r"^sh (\S+)/add_rollout_replica\.sh", (ROOT / "README.md").read_text(), re.M)
    assert shown, "README.md shows no `sh <log_dir>/add_rollout_replica.sh` command"
    return ["sh", str(log_dir / "add_rollout_replica.sh")]


def _both_generate_in_one_iteration(spans, first: str, added: str) -> bool:
    """Some trainer wait (one iteration's rollout) overlaps a generate span of each replica."""
    waits = [s for s in spans if s.worker == "trainer" and s.stage == "wait"]
    generated = {w: [s for s in spans if s.worker == w and s.stage == "generate"] for w in (first, added)}
    return any(all(any(g.start < w.end and g.end > w.start for g in gens) for gens in generated.values()) for w in waits)


def test_the_readmes_command_adds_a_replica_that_shares_the_iterations_and_leaves_on_sigterm(warm_model, tmp_path):
    from services.common.config import load_config
    from services.dock.client import Dock
    from services.dock.registry import ReplicaRegistry
    from services.dock.timeline import Timeline

    base = tmp_path / "run"
    log_dir = base / "logs"
    base.mkdir()
    # more iterations than the test needs: it stops the run itself once it has seen what it checks
    with open(base / "up.log", "wb") as up_log:
        up = subprocess.Popen(up_argv(warm_model, base, ("rollout.replicas=1", "megatron_training.train_iters=400",
                                                         "trainer.eval_data_path=", "trainer.test_data_path=")),
                              cwd=ROOT, stdout=up_log, stderr=subprocess.STDOUT, start_new_session=True)
    added = None
    try:
        _wait_for((log_dir / "add_rollout_replica.sh").exists, 900, "add_rollout_replica.sh", up)
        cfg = load_config(str(log_dir / "config.yaml"))
        dock = Dock.from_config(cfg)
        registry = ReplicaRegistry(dock.client, dock.keys, cfg.rollout.heartbeat_ttl_s)
        (first,) = [r.replica_id for r in registry.live("rollout")]
        env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        with open(base / "added.log", "wb") as added_log:
            added = subprocess.Popen(_readme_command(log_dir), cwd=ROOT, env=env, stdout=added_log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        _wait_for(lambda: len(registry.live("rollout")) == 2, 600, "the added replica in the registry", up, added)
        (joined,) = [r.replica_id for r in registry.live("rollout") if r.replica_id != first]
        timeline = Timeline(dock.client, dock.keys)
        _wait_for(lambda: _both_generate_in_one_iteration(timeline.spans(), first, joined), 600,
                  "an iteration in which both replicas generate", up, added)

        os.kill(added.pid, signal.SIGTERM)  # `sh` exec'd the replica: this is its process
        assert added.wait(timeout=120) == 0, (base / "added.log").read_text()[-3000:]
        assert [r.replica_id for r in registry.live("rollout")] == [first]
        left_at = len((log_dir / "metrics.jsonl").read_text().splitlines())
        _wait_for(lambda: len((log_dir / "metrics.jsonl").read_text().splitlines()) >= left_at + 2, 600,
                  "two more iterations without the added replica", up)
        assert dock.stats().unaccounted_rows() == 0  # every row the dock admitted is live, or trained and retired
    finally:
        if added is not None and added.poll() is None:
            added.kill()
        up.send_signal(signal.SIGINT)  # `dockrl up` stops every service it started
        up.wait(timeout=180)
