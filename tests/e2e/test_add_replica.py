"""The README's way of adding a rollout replica, against a running `dockrl up` of the tiny config on one host:
the command `dockrl up` wrote joins the run mid-way, receives the current weights at the first push after it
registered, generates in the same iterations as rollout-0 (the iteration is split over the live replicas), and
leaves on SIGTERM with nothing lost while the run goes on to its last step."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from services.common.pb import trainer_pb2, trainer_pb2_grpc

from tests.e2e.conftest import ROOT, up_argv

pytestmark = [pytest.mark.service, pytest.mark.slow]

ITERS = 30


def _wait_for(predicate, timeout_s: float, what: str, *alive: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for proc in alive:
            assert proc.poll() is None, f"exited {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _readme_command(log_dir: pathlib.Path) -> list[str]:
    """The README's add-a-replica command, pointed at this run's log directory."""
    shown = re.search(r"^sh (\S+)/add_rollout_replica\.sh", (ROOT / "README.md").read_text(), re.M)
    assert shown, "README.md shows no `sh <log_dir>/add_rollout_replica.sh` command"
    return ["sh", str(log_dir / "add_rollout_replica.sh")]


def _trainer(log_dir: pathlib.Path) -> trainer_pb2_grpc.TrainerStub:
    """The run's Trainer service, at the port its log names (the run binds port 0)."""
    port = re.search(r"control server listening .*port=(\d+)", (log_dir / "services" / "trainer.log").read_text()).group(1)
    return trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def _bound_cores(log: str) -> list[int]:
    """The cores a replica's log says its engine's threads are bound to."""
    from services.rollout.core_claims import parse_cores

    found = re.search(r"engine cores bind=(\S+)", log)
    return parse_cores(found.group(1)) if found else []


def _both_generate_in_one_iteration(spans, first: str, added: str) -> bool:
    """Some trainer wait (one iteration's rollout) overlaps a generate span of each replica."""
    waits = [s for s in spans if s.worker == "trainer" and s.stage == "wait"]
    generated = {w: [s for s in spans if s.worker == w and s.stage == "generate"] for w in (first, added)}
    return any(all(any(g.start < w.end and g.end > w.start for g in gens) for gens in generated.values()) for w in waits)


def test_the_readmes_command_adds_a_replica_that_joins_shares_the_iterations_and_leaves_on_sigterm(warm_model, tmp_path):
    """The trainer is paused (its Pause call) while the added replica starts and while it stops, so the run's length
    need not outlast a vLLM start (about a minute here), and its last steps come after the replica left."""
    from services.common.config import load_config
    from services.dock.client import Dock
    from services.dock.registry import ReplicaRegistry
    from services.dock.timeline import Timeline

    base = tmp_path / "run"
    log_dir = base / "logs"
    metrics = log_dir / "metrics.jsonl"
    base.mkdir()
    with open(base / "up.log", "wb") as up_log:
        up = subprocess.Popen(up_argv(warm_model, base, ("rollout.replicas=1", f"megatron_training.train_iters={ITERS}",
                                                         "trainer.eval_data_path=", "trainer.test_data_path=")),
                              cwd=ROOT, stdout=up_log, stderr=subprocess.STDOUT, start_new_session=True)
    added = None
    try:
        _wait_for(lambda: len(_records(metrics)) >= 2 and (log_dir / "add_rollout_replica.sh").exists(), 900,
                  "step 2 and add_rollout_replica.sh", up)
        trainer = _trainer(log_dir)
        assert trainer.Pause(trainer_pb2.PauseRequest(), timeout=30).paused  # holds between iterations
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
        paused_at = len(_records(metrics))
        assert not trainer.Resume(trainer_pb2.ResumeRequest(), timeout=30).paused

        _wait_for(lambda: any(r.get("weight_sync/replicas") == 2 for r in _records(metrics)), 300,
                  "the added replica in a push", up, added)
        joined_at = next(r["step"] for r in _records(metrics) if r.get("weight_sync/replicas") == 2)
        assert joined_at > paused_at >= 2  # it joined mid-run, at the first push after it registered
        timeline = Timeline(dock.client, dock.keys)
        _wait_for(lambda: _both_generate_in_one_iteration(timeline.spans(), first, joined), 300,
                  "an iteration in which both replicas generate", up, added)

        assert trainer.Pause(trainer_pb2.PauseRequest(), timeout=30).paused
        os.kill(added.pid, signal.SIGTERM)  # `sh` exec'd the replica: this is its process
        assert added.wait(timeout=120) == 0, (base / "added.log").read_text()[-3000:]
        log = (base / "added.log").read_text()
        assert "weights applied" in log and "claim done" in log and "deregistered" in log
        # its engine took cores rollout-0's does not hold (on 2 cores: rollout-0 core 0, the added one core 1)
        first_cores = _bound_cores((log_dir / "services" / "rollout-0.log").read_text())
        added_cores = _bound_cores(log)
        assert first_cores and added_cores and not set(first_cores) & set(added_cores), (first_cores, added_cores)
        assert [r.replica_id for r in registry.live("rollout")] == [first]
        assert dock.stats().unaccounted_rows() == 0  # every row the dock admitted is live, or trained and retired
        assert len(_records(metrics)) < ITERS  # steps are left for the run without it
        assert not trainer.Resume(trainer_pb2.ResumeRequest(), timeout=30).paused
        assert up.wait(timeout=900) == 0, (base / "up.log").read_text()[-3000:]
    finally:
        if added is not None and added.poll() is None:
            added.kill()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # `dockrl up` stops every service it started
            up.wait(timeout=180)
    records = [r for r in _records(metrics) if "reward/mean" in r]
    assert [r["step"] for r in records] == list(range(1, ITERS + 1))
    assert records[-1]["weight_sync/replicas"] == 1  # the stopped replica left the registry
    assert all(r["policy_lag/max"] == 0 for r in records[joined_at:])  # the added replica generated on current weights only
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["accounting"]["rows_trained"] == summary["accounting"]["rows_put"]
