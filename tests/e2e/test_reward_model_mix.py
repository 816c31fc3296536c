"""GRPO on the tiny demo with a 0.5 / 0.5 mix of math_17k_acc and a reward model, through `dockrl up`:
the model served inside the reward replica, or on a reward-model replica of its own
(reward_config.model_replicas 1) beside the rule replica."""
import re

import pytest

from services.common.tiny_model import build_tiny_model, fit_reward_model
from tests.e2e.conftest import steps

pytestmark = [pytest.mark.service, pytest.mark.slow]


@pytest.mark.parametrize("model_replicas", [0, 1], ids=["model-in-reward-replica", "model-replica-apart"])
def test_a_mixed_rule_and_model_reward_run_completes_and_logs_both_parts(run_up, tmp_path, model_replicas):
    rm = build_tiny_model(tmp_path / "rm", prompt_type="empty", reward=True)
    fit_reward_model(rm, steps=20)
    metrics, summary, log_dir = run_up(
        "megatron_training.train_iters=3", "trainer.eval_data_path=", "trainer.test_data_path=",
        "rl_config.verifier_function=[math_17k_acc, reward_model]", "rl_config.verifier_weight=[0.5, 0.5]",
        f"reward_config.load={rm}", "reward_config.seq_length=64", f"reward_config.model_replicas={model_replicas}",
    )
    assert len(steps(metrics)) == 3 and summary["accounting"]["rows_dropped"] == 0
    assert summary["accounting"]["rows_trained"] == summary["accounting"]["rows_put"]
    reward_log = (log_dir / "services" / "reward-0.log").read_text()
    if model_replicas:
        # The rule replica loads no model; the reward-model replica does, and scores the model's part.
        model_log = (log_dir / "services" / "reward-model-0.log").read_text()
        assert "reward model loaded" not in reward_log and "reward model loaded" in model_log
        assert "consumer=model_reward" in model_log and re.search(r"reward_model_rewards/mean=\S+", model_log), model_log[-3000:]
    else:
        assert "reward model loaded" in reward_log
    progress = re.findall(r"math_17k_acc_rewards/mean=(\S+) reward_model_rewards/mean=(\S+)", reward_log)
    assert progress, reward_log[-3000:]
    for acc, model in progress:
        assert 0.0 <= float(acc) <= 1.0 and float(model) != 0.0
    # The trainer's metrics carry each part too, and the reward is their 0.5 / 0.5 mix.
    for record in steps(metrics):
        acc, model = record["math_17k_acc_rewards/mean"], record["reward_model_rewards/mean"]
        assert 0.0 <= acc <= 1.0 and model != 0.0
        assert record["reward/mean"] == pytest.approx(0.5 * acc + 0.5 * model, abs=1e-5)
