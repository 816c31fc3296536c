"""`dockrl up` as a supervisor: a service that dies ends the run non-zero, and nothing outlives it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import ROOT, _paths

pytestmark = [pytest.mark.service, pytest.mark.slow]


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                parents.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_a_dead_service_stops_the_run_with_an_error_and_leaves_no_orphans(warm_model, tmp_path):
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-m", "services", "up", str(ROOT / "configs/tiny_cpu.yaml"),
            *[f"--set={o}" for o in _paths(warm_model)], f"--set=trainer.log_dir={log_dir}",
            f"--set=megatron_training.save={tmp_path}/ckpt", "--set=megatron_training.train_iters=1000",
            "--set=trainer.eval_data_path=", "--set=trainer.test_data_path=", "--set=rollout.grpc_port=0", "--set=rollout.http_port=0",
            "--set=reward.grpc_port=0", "--set=trainer.grpc_port=0"]
    up = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        metrics = log_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert up.poll() is None, up.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(1)
        family = _children(up.pid)
        # The reward service itself (a direct child of dockrl up), not one of its verifier workers.
        reward = [p for p in family if _parent(p) == up.pid
                  and "services.reward serve" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
        assert reward, "no reward process under dockrl up"
        os.kill(reward[0], signal.SIGKILL)
        code = up.wait(timeout=120)
        out = up.stdout.read()
        assert code != 0
        assert "service died" in out and "reward-0" in out
        time.sleep(1)
        assert not [p for p in family if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps[:2] == [1, 2]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=60)
