"""`python -m services.reward serve --dock` as a process: gRPC and the dock worker together, clean stop."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np
import pytest
import redis
import yaml
from transformers import AutoTokenizer

from services.common.ready_file import read_ready_file
from services.common.templates import load_templates
from tests.conftest import free_port
from services.common.tiny_model import build_tokenizer
from services.dock.client import Dock
from services.dock.registry import ReplicaRegistry
from services.dock.schema import DockLayout, Keys
from services.reward.client import RewardClient
from services.reward.scoring import ScoreInput
from services.reward.worker import CONSUMER

pytestmark = pytest.mark.service

N = 2


@contextlib.contextmanager
def _reward_serve(tmp_path, redis_url, run_id: str, *flags: str, reward: dict | None = None):
    """`services.reward serve --dock` on a fresh run of the dock; yields the process and a Redis
    client, and removes the run's keys after."""
    build_tokenizer(tmp_path / "tok", load_templates()["qwen"])
    prefix = f"test-reward-{uuid.uuid4().hex[:10]}"
    config = {
        "megatron_training": {"tokenizer_name_or_path": str(tmp_path / "tok"), "global_batch_size": 2},
        "rl_config": {"n_samples_per_prompt": N, "verifier_function": ["acc"], "verifier_weight": [1.0],
                      "verifier_parallel": 1, "verifier_timeout": 5},
        "dock": {"redis_url": redis_url, "prefix": prefix, "run_id": run_id},
        "reward": reward or {},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.reward", "serve", "--config", str(tmp_path / "run.yaml"), "--port", "0", "--dock",
         "--ready-file", str(tmp_path / "ready.json"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "DOCKRL_LOG_LEVEL": "WARNING"},
    )
    client = redis.Redis.from_url(redis_url)
    try:
        yield proc, client, prefix
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


def test_serve_with_dock_scores_the_dock_and_answers_grpc(tmp_path, redis_url):
    metrics_port = free_port()
    with _reward_serve(tmp_path, redis_url, "serve", reward={"metrics_port": metrics_port}) as (proc, client, prefix):
        tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
        line = proc.stdout.readline()
        assert line.startswith("reward server listening on 127.0.0.1:"), line
        target = line.split()[-1]
        assert f"127.0.0.1:{read_ready_file(tmp_path / 'ready.json')['grpc_port']}" == target
        time.sleep(1.5)  # the worker starts before the dock exists and must wait for it
        dock = Dock(client, prefix, "serve")
        dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=2, dispatch_sizes={CONSUMER: N}))
        rows = dock.rows_of([0, 1])
        dock.put(rows, {"labels": ["4", "4", "5", "5"],
                        "responses": [np.array(tok.encode(t, add_special_tokens=False), np.int32)
                                      for t in (r"\boxed{4}", r"\boxed{3}", "5", r"\boxed{5}")],
                        "response_length": [9, 9, 1, 9]})
        deadline = time.monotonic() + 30
        while not dock.all_consumed(CONSUMER) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [float(s) for s in dock.read(rows, ["rm_scores"])["rm_scores"]] == [1.0, -0.5, -1.0, 1.0]
        with RewardClient(target) as reward:
            assert reward.score([ScoreInput(r"\boxed{\frac12}", "0.5")])[0].total == 1.0
        cli = subprocess.run([sys.executable, "-m", "services.reward", "score", "--server", target, "--label", "7",
                              "--response", r"so \boxed{7}", "--verifier", "acc"], capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0 and "total: +1.0000" in cli.stdout, cli.stdout + cli.stderr
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "dockrl_reward_dock_rows_scored_total 4.0" in metrics and "dockrl_reward_samples_scored_total 2.0" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a liveness bound, not a speed figure: a loaded machine took over 20 s


def test_a_wildcard_bind_registers_an_address_peers_can_dial(tmp_path, redis_url):
    """Under compose and Kubernetes reward binds 0.0.0.0; the dock must list the host name, which
    the trainer can dial, not 0.0.0.0 (which would make the trainer dial itself)."""
    with _reward_serve(tmp_path, redis_url, "wild", "--host", "0.0.0.0") as (proc, client, prefix):
        registry = ReplicaRegistry(client, Keys(prefix, "wild"))
        deadline = time.monotonic() + 30
        while not registry.live("reward") and time.monotonic() < deadline:
            time.sleep(0.2)
        [replica] = registry.live("reward")
        port = read_ready_file(tmp_path / "ready.json")["grpc_port"]
        assert replica.address == f"{socket.gethostname()}:{port}"
        with RewardClient(replica.address) as reward:
            assert reward.score([ScoreInput(r"\boxed{2}", "2")])[0].total == 1.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a liveness bound, not a speed figure: a loaded machine took over 20 s
