"""A rollout replica started during a run joins, gets the current weights and takes work; stopped, it leaves."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from services.common.pb import trainer_pb2, trainer_pb2_grpc

from tests.e2e.conftest import ROOT, _paths

pytestmark = [pytest.mark.service, pytest.mark.slow]


def _wait_for(predicate, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None:
            assert proc.poll() is None, f"dockrl up exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _trainer(log_dir) -> trainer_pb2_grpc.TrainerStub:
    """The run's Trainer service, at the port its log names (the run binds port 0)."""
    port = re.search(r"control server listening .*port=(\d+)", (log_dir / "services" / "trainer.log").read_text()).group(1)
    return trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def test_replica_joins_mid_run_and_leaves(warm_model, tmp_path):
    """The trainer is paused (its Pause call) while the joiner starts and while it stops, so the run's length need not
    outlast a vLLM start (about a minute here), and its last steps come after the joiner left."""
    log_dir = tmp_path / "logs"
    iters = 20
    up = subprocess.Popen(
        [sys.executable, "-m", "services", "up", str(ROOT / "configs/tiny_cpu.yaml"), *[f"--set={o}" for o in _paths(warm_model)],
         f"--set=trainer.log_dir={log_dir}", f"--set=megatron_training.save={tmp_path}/ckpt",
         f"--set=megatron_training.train_iters={iters}", "--set=trainer.eval_data_path=", "--set=trainer.test_data_path=",
         "--set=rollout.grpc_port=0", "--set=rollout.http_port=0", "--set=reward.grpc_port=0", "--set=trainer.grpc_port=0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = log_dir / "metrics.jsonl"
    joiner_log = tmp_path / "joiner.log"
    joiner = None
    try:
        _wait_for(lambda: len(_records(metrics)) >= 2, 600, "step 2", up)
        trainer = _trainer(log_dir)
        assert trainer.Pause(trainer_pb2.PauseRequest(), timeout=30).paused  # holds between iterations
        cfg = yaml.safe_load((log_dir / "config.yaml").read_text())
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        joiner = subprocess.Popen(
            [sys.executable, "-m", "services.rollout", "serve", "--config", str(log_dir / "config.yaml"),
             "--model", cfg["megatron_training"]["load"], "--grpc-port", "0", "--http-port", "0", "--dock", cfg["dock"]["redis_url"]],
            cwd=ROOT, env=env, stdout=open(joiner_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait_for(lambda: re.search(r"\bregistered\b", joiner_log.read_text()), 300, "the joiner to register", up)
        paused_at = len(_records(metrics))
        assert not trainer.Resume(trainer_pb2.ResumeRequest(), timeout=30).paused
        _wait_for(lambda: any(r.get("weight_sync/replicas") == 2 for r in _records(metrics)), 300, "the second replica in a push", up)
        joined_at = next(r["step"] for r in _records(metrics) if r.get("weight_sync/replicas") == 2)
        assert joined_at > paused_at >= 2  # it joined mid-run, at the first push after it registered
        _wait_for(lambda: "claim done" in joiner_log.read_text(), 300, "the joiner to take work", up)
        assert trainer.Pause(trainer_pb2.PauseRequest(), timeout=30).paused
        os.killpg(joiner.pid, signal.SIGTERM)
        assert joiner.wait(timeout=60) == 0
        log = joiner_log.read_text()
        assert "weights applied" in log and "claim done" in log and "deregistered" in log
        assert len(_records(metrics)) < iters  # steps are left for the run without it
        assert not trainer.Resume(trainer_pb2.ResumeRequest(), timeout=30).paused
        assert up.wait(timeout=900) == 0, up.stdout.read()[-3000:]
    finally:
        for proc in (joiner, up):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:  # keep the first failure's message, not this one's
                    proc.kill()
                    proc.wait()
    records = [r for r in _records(metrics) if "reward/mean" in r]
    assert [r["step"] for r in records] == list(range(1, iters + 1))
    assert records[-1]["weight_sync/replicas"] == 1  # the stopped replica left the registry
    assert all(r["policy_lag/max"] == 0 for r in records[joined_at:])  # the joiner generated on current weights only
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["accounting"]["rows_trained"] == summary["accounting"]["rows_put"]
