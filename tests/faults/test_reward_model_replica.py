"""Reward replicas of two kinds under a fault: with reward_config.model_replicas > 0 a rule replica
and a reward-model replica (vLLM's pooling runner on the tiny reward model) run as real processes
on a real Redis. The model replica is SIGKILLed while it holds leased `model_reward` rows, mid-batch;
a replacement is started as compose's restart policy or a Kubernetes Deployment would. Every row
ends with both parts and their weighted sum, and each part was put exactly once: the rows the dead
replica had put plus those its replacement put are all the rows, and so are the rule replica's.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import urllib.request
import uuid

import numpy as np
import pytest
import redis
import yaml

from services.common.ready_file import read_ready_file
from services.common.tiny_model import build_tiny_model
from services.dock.client import Dock
from services.dock.registry import ReplicaRegistry
from services.dock.schema import DockLayout
from services.launch.redis_local import free_port
from services.reward.client import RewardClient
from services.reward.scoring import ScoreInput
from services.reward.worker import CONSUMER, MODEL_CONSUMER
from tests.faults.loop_harness import descendants, wait_for

pytestmark = [pytest.mark.service, pytest.mark.slow]

AREA = "reward-model replicas"
N, WAVE = 2, 4  # samples per group; groups per wave of responses
LEASE_S = 5  # a dead replica's rows come back within seconds
START_S = 600  # a vLLM engine starts in ~40 s on an idle box, minutes on a busy one
ATOL = 1e-4


class Replica:
    """One `dockrl reward serve --dock --kind KIND` process in its own session, with its /metrics port."""

    def __init__(self, tmp: pathlib.Path, name: str, kind: str):
        self.name, self.ready = name, tmp / f"{name}.json"
        self.metrics_port = free_port()
        self.log = tmp / f"{name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.reward", "serve", "--config", str(tmp / "run.yaml"), "--kind", kind, "--port", "0",
                 "--dock", "--ready-file", str(self.ready), "--set", f"reward.metrics_port={self.metrics_port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "DOCKRL_LOG_LEVEL": "INFO"})

    def wait_ready(self) -> str:
        wait_for(self.ready.exists, START_S, f"{self.name} to serve", self.proc)
        return f"127.0.0.1:{read_ready_file(self.ready)['grpc_port']}"

    def rows_scored(self) -> int:
        """dockrl_reward_dock_rows_scored_total: the rows this process put (puts refused as stale are not counted)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return int(sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("dockrl_reward_dock_rows_scored_total")))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def system(tmp_path, redis_url):
    """The config, the dock, the tiny reward model's tokenizer, and the replicas started so far (stopped at the end)."""
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "rm", prompt_type="qwen", reward=True)
    prefix = f"test-rm-replica-{uuid.uuid4().hex[:10]}"
    config = {
        "megatron_training": {"tokenizer_name_or_path": str(model_dir), "global_batch_size": 2},
        "rl_config": {"n_samples_per_prompt": N, "verifier_function": ["math_17k_acc", "reward_model"],
                      "verifier_weight": [0.5, 0.5], "verifier_parallel": 1, "verifier_timeout": 5, "reward_dispatch_size": N},
        "generate_config": {"dtype": "float32", "max_num_seqs": 32, "cpu_kvcache_space_gb": 1},
        "reward_config": {"load": str(model_dir), "seq_length": 64, "model_replicas": 1},
        "dock": {"redis_url": redis_url, "prefix": prefix, "run_id": "rm", "lease_seconds": LEASE_S},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    client = redis.Redis.from_url(redis_url)
    dock = Dock(client, prefix, "rm", lease_seconds=LEASE_S)
    dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=2 * WAVE,
                           dispatch_sizes={CONSUMER: N, MODEL_CONSUMER: N}))
    replicas: list[Replica] = []
    try:
        yield tmp_path, dock, AutoTokenizer.from_pretrained(model_dir), replicas
    finally:
        for replica in replicas:
            replica.stop()
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


def _put_wave(dock: Dock, tok, groups: range) -> list[int]:
    """Prompts and responses of `groups`: group g asks g+1 (plus one), its first sample right, its second wrong."""
    rows = dock.rows_of(groups)
    prompts = [f"<|im_start|>user\n{r // N}+1=<|im_end|>\n<|im_start|>assistant\n" for r in rows]
    responses = [rf"\boxed{{{r // N + 1 + r % N}}}" for r in rows]
    dock.put(rows, {"prompts": [np.array(tok.encode(p), np.int32) for p in prompts],
                    "prompt_length": [len(tok.encode(p)) for p in prompts], "labels": [str(r // N + 1) for r in rows]})
    ids = [np.array(tok.encode(r) + [tok.eos_token_id], np.int32) for r in responses]
    dock.put(rows, {"responses": ids, "response_length": [len(i) for i in ids]})
    return rows


def _ready(dock: Dock, column: str) -> int:
    return dock.stats().ready[column]


def test_a_killed_model_replica_is_replaced_and_every_row_is_scored_once(system, fault_log):
    tmp, dock, tok, replicas = system
    rule, first = Replica(tmp, "reward-0", "rule"), Replica(tmp, "reward-model-0", "model")
    replicas += [rule, first]
    rule_address, first_address = rule.wait_ready(), first.wait_ready()

    # Each kind scores its own part; the rule replica adds the two once the model's is in.
    rows = _put_wave(dock, tok, range(WAVE))
    wait_for(lambda: _ready(dock, "rm_scores") == len(rows), START_S, "the first wave to be scored", first.proc)

    # A rule replica's gRPC Score that lists reward_model gets that part from the model replica.
    sample = ScoreInput(r"\boxed{2}", "2", prompt="1+1=")
    with RewardClient(rule_address) as via_rule, RewardClient(first_address) as on_model:
        (forwarded,), (direct,) = via_rule.score([sample]), on_model.score([sample])
    fault_log.check(AREA, "gRPC Score with reward_model on a rule replica, which loads no reward model",
                    "the model's part comes from a reward-model replica; the same total as on that replica",
                    f"{forwarded.total:.6f} via the rule replica, {direct.total:.6f} on the model replica",
                    [p.name for p in forwarded.parts] == ["math_17k_acc", "reward_model"]
                    and abs(forwarded.total - direct.total) < ATOL)

    # Mid-batch: the engine (a child process) is frozen, so the batch the replica claims next cannot
    # finish; the replica itself is frozen before the look that decides, so it cannot put after it.
    for child in descendants(first.proc.pid):
        os.kill(child, signal.SIGSTOP)
    rows += _put_wave(dock, tok, range(WAVE, 2 * WAVE))
    owners = dock.keys.base + f"owner:{MODEL_CONSUMER}"
    wait_for(lambda: dock.client.hlen(owners) > 0, 120, "the model replica to claim a batch", first.proc)
    os.kill(first.proc.pid, signal.SIGSTOP)
    held = sorted(int(r) for r, lease in dock.client.hgetall(owners).items() if lease.decode().startswith("reward-model-"))
    put_by_first = _ready(dock, "rm_model")
    requeued_before = dock.stats().requeued
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(60)

    replacement = Replica(tmp, "reward-model-1", "model")
    replicas.append(replacement)
    replacement.wait_ready()
    wait_for(lambda: _ready(dock, "rm_scores") == len(rows), START_S, "every row to be scored", replacement.proc)
    registry = ReplicaRegistry(dock.client, dock.keys)
    live_models = [r.address for r in registry.live("reward_model")]
    requeued = dock.stats().requeued - requeued_before
    by_replacement, by_rule = replacement.rows_scored(), rule.rows_scored()
    fault_log.check(
        AREA, f"a reward-model replica SIGKILLed while holding {len(held)} leased model_reward rows, mid-batch; a replacement started",
        f"its rows requeue when the {LEASE_S} s lease ends; the replacement registers and scores them; no row scored twice",
        f"{requeued} rows requeued; {put_by_first} rm_model rows put by the dead replica + {by_replacement} by the replacement "
        f"= {put_by_first + by_replacement} of {len(rows)}; the rule replica put {by_rule}; live reward_model replicas: {len(live_models)}",
        len(held) > 0 and requeued >= len(held) and put_by_first + by_replacement == len(rows) and by_rule == len(rows)
        and f"127.0.0.1:{read_ready_file(replacement.ready)['grpc_port']}" in live_models)

    # Each row: the rule's part, the model's part as put, and 0.5 / 0.5 of them.
    got = dock.read(rows, ["rm_scores", "rm_parts", "rm_model"])
    wrong = []
    for i, row in enumerate(rows):
        rule_part = 1.0 if row % N == 0 else 0.0
        model_part = float(got["rm_model"][i])
        parts = [float(v) for v in got["rm_parts"][i]]
        if parts != pytest.approx([rule_part, model_part], abs=ATOL) or \
                float(got["rm_scores"][i]) != pytest.approx(0.5 * rule_part + 0.5 * model_part, abs=ATOL):
            wrong.append(row)
    fault_log.check(AREA, "the rows of both waves after the kill", "rm_parts = [rule, model] and rm_scores = 0.5 rule + 0.5 model on every row",
                    f"{len(rows) - len(wrong)} of {len(rows)} rows hold it; consumed by both kinds: "
                    f"{dock.all_consumed(CONSUMER) and dock.all_consumed(MODEL_CONSUMER)}",
                    not wrong and dock.all_consumed(CONSUMER) and dock.all_consumed(MODEL_CONSUMER))
