"""The per-step metrics a user reads in metrics.jsonl and TensorBoard, under MindSpeed-RL's names."""
import pytest
from trainer_helpers import scored_batch

from services.trainer.loop.iteration_data import ScoredBatch
from services.trainer.loop.step_metrics import batch_metrics, throughput_metrics


def _batch() -> ScoredBatch:
    # two groups of 2: prompts of 3 and 1 tokens, responses of 2, 4, 1, 1 tokens; versions 5 and 4 (lag 0 and 1)
    return scored_batch([[1, 2, 3], [1, 2, 3], [7], [7]], [[5, 6], [5, 6, 7, 8], [9], [9]], [1.0, 0.0, 0.5, 0.5],
                        [[-1.0] * 2, [-1.0] * 4, [-1.0], [-1.0]], [[5, 5], [5, 4, 4, 4], [5], [5]],
                        [[1.0, 0.0], [0.0, 0.0], [0.5, 1.0], None])  # the last row stored no parts


def test_lengths_lag_flat_groups_and_each_verifiers_mean():
    m = batch_metrics(_batch(), trained_version=5, n_samples_per_prompt=2, verifiers=("acc", "format"))
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (2.0, 4, 1)
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/min"]) == (2.0, 3, 1)
    assert m["policy_lag/max"] == 1 and m["policy_lag/mean"] == pytest.approx(3 / 8)
    assert m["groups/flat_fraction"] == 0.5  # the second group scored 0.5 and 0.5
    assert m["acc_rewards/mean"] == pytest.approx(0.5) and m["format_rewards/mean"] == pytest.approx(1 / 3)


def test_throughputs_count_prompt_and_response_tokens():
    m = throughput_metrics(_batch(), rollout_s=2.0, train_s=0.5, iteration_s=4.0)
    # 8 response tokens, 8 prompt tokens
    assert m == {"e2e_tps": pytest.approx(16 / 4.0), "update_tps": pytest.approx(16 / 0.5), "vllm_tps": pytest.approx(8 / 2.0)}
