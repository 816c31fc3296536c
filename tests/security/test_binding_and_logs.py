"""Servers listen on 127.0.0.1 by default (checked on the kernel's listening sockets), and no token or
Redis password reaches a log: a real `reward serve --dock` against a password-protected Redis with
DOCKRL_TOKEN set at DEBUG level, the shared rollout replicas (token via --set), the Trainer service."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import redis
import yaml
from listening import all_loopback, listening_addresses
from rollout_harness import TOKEN as ROLLOUT_TOKEN

from services.common.config import DEFAULT_CONFIG, load_config
from services.common.templates import load_templates
from services.common.tiny_model import build_tokenizer
from services.dock.client import Dock
from services.dock.schema import DockLayout
from services.reward.worker import CONSUMER
from tests.conftest import start_redis_server, stop_redis_server

pytestmark = pytest.mark.service

TOKEN = "reward-tok-" + uuid.uuid4().hex[:10]
PASSWORD = "reward-redis-pw-" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def reward_process(tmp_path_factory):
    """`python -m services.reward serve --dock` with no --host, scoring rows of a password-protected Redis."""
    work = tmp_path_factory.mktemp("reward-sec")
    redis_proc, url = start_redis_server(work, password=PASSWORD)
    build_tokenizer(work / "tok", load_templates()["qwen"])
    prefix = f"sec-reward-{uuid.uuid4().hex[:8]}"
    config = {
        "megatron_training": {"tokenizer_name_or_path": str(work / "tok"), "global_batch_size": 1},
        "rl_config": {"n_samples_per_prompt": 2, "verifier_function": ["acc"], "verifier_weight": [1.0], "verifier_parallel": 1},
        "dock": {"redis_url": url, "redis_password": PASSWORD, "prefix": prefix, "run_id": "sec"},
    }
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    log_path = work / "reward.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward", "serve", "--config", str(work / "run.yaml"), "--port", "0", "--dock"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "DOCKRL_TOKEN": TOKEN, "DOCKRL_LOG_LEVEL": "DEBUG"},
        )
    dock = Dock(redis.Redis.from_url(url, password=PASSWORD), prefix, "sec", TOKEN)
    try:
        deadline = time.monotonic() + 60
        while "reward server listening on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        yield proc, log_path, dock, work / "tok"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dock.client.close()
        stop_redis_server(redis_proc)


def test_reward_serve_listens_on_loopback_by_default(reward_process, fault_log):
    proc, log_path, *_ = reward_process
    addresses = listening_addresses(proc.pid)
    fault_log.check("binding", "reward serve with no --host: its listening sockets", "127.0.0.1 only",
                    ", ".join(f"{ip}:{port}" for ip, port in sorted(addresses)), all_loopback(addresses))


def test_reward_worker_scores_through_the_password_and_token(reward_process, fault_log):
    dock = reward_process[2]
    dock.create(DockLayout(n_samples_per_prompt=2, capacity_groups=1, dispatch_sizes={CONSUMER: 2}))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reward_process[3]))
    ids = [np.array(tokenizer.encode(text, add_special_tokens=False), np.int32) for text in (r"\boxed{4}", "5")]
    dock.put([0, 1], {"labels": ["4", "4"], "responses": ids, "response_length": [9, 1]})
    deadline = time.monotonic() + 30
    while not dock.all_consumed(CONSUMER) and time.monotonic() < deadline:
        time.sleep(0.1)
    scores = [float(s) for s in dock.read([0, 1], ["rm_scores"])["rm_scores"]] if dock.all_consumed(CONSUMER) else None
    fault_log.check("redis auth", "reward worker with dock.redis_password and DOCKRL_TOKEN against redis --requirepass",
                    "scores the rows (its puts pass the run's token)", f"rm_scores {scores}", scores == [1.0, -1.0])


def test_no_secret_in_the_logs(reward_process, rollout_servers, fault_log):
    proc, log_path, *_ = reward_process
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    reward_log = log_path.read_text()
    leaked = [name for name, secret in (("token", TOKEN), ("redis password", PASSWORD)) if secret in reward_log]
    fault_log.check("secrets", "reward serve --dock at DEBUG with DOCKRL_TOKEN and dock.redis_password: its whole log",
                    "neither secret appears", f"{len(reward_log.splitlines())} lines; leaked: {leaked or 'nothing'}",
                    not leaked and "reward server listening" in reward_log)
    for name, replica in (("a", rollout_servers.a), ("b (dock worker)", rollout_servers.b)):
        text = replica.log_path.read_text()
        fault_log.check("secrets", f"rollout replica {name} started with --set auth.token=...: its log",
                        "the token does not appear", f"{len(text.splitlines())} lines; token {'LEAKED' if ROLLOUT_TOKEN in text else 'absent'}",
                        ROLLOUT_TOKEN not in text and "serving" in text)


def test_rollout_replicas_listen_on_loopback_only(rollout_servers, fault_log):
    for name, replica in (("a", rollout_servers.a), ("b", rollout_servers.b)):
        addresses = listening_addresses(replica.proc.pid)
        fault_log.check("binding", f"rollout replica {name} and its vLLM processes: every listening socket",
                        "127.0.0.1 only (gRPC, HTTP and vLLM's own)", ", ".join(f"{ip}:{port}" for ip, port in sorted(addresses)),
                        all_loopback(addresses) and {replica.grpc_port, replica.http_port} <= {port for _, port in addresses})


def test_the_defaults_bind_loopback(fault_log):
    from services.trainer.loop.control import TrainerControl
    from services.trainer.loop.server import start_server

    cfg = load_config(DEFAULT_CONFIG)
    defaults = {"rollout.host": cfg.rollout.host, "reward.host": cfg.reward.host, "trainer.host": cfg.trainer.host}
    fault_log.check("binding", f"bind addresses in {DEFAULT_CONFIG.name}", "127.0.0.1 each", str(defaults), set(defaults.values()) == {"127.0.0.1"})
    server, port = start_server(TrainerControl(train_iters=1), cfg.trainer.host, 0)
    try:
        mine = {(ip, p) for ip, p in listening_addresses(os.getpid()) if p == port}
    finally:
        server.stop(grace=None).wait()
    fault_log.check("binding", "Trainer service on trainer.host: its listening socket", "127.0.0.1 only",
                    ", ".join(f"{ip}:{p}" for ip, p in sorted(mine)), all_loopback(mine))
