"""The weighted sum over verifier_function / verifier_weight and DAPO's overlong penalty."""
import pytest

from services.common.config import ConfigError, config_from_dict
from services.common.errors import InvalidArgument
from services.reward.overlong import OverlongPenalty
from services.reward.pool import InProcessRunner
from services.reward.scoring import ScoreInput, ScoringPlan, score_samples

WELL_FORMED = r"<think>6*7=42, minus 8</think><answer>\boxed{34}</answer>"


def test_overlong_penalty_is_linear_over_the_buffer_and_capped():
    penalty = OverlongPenalty(enabled=True, buffer=4, factor=1.0, rollout_max_tokens=20)  # expected 16
    assert penalty.expected_length == 16
    assert [penalty(n) for n in (10, 16, 17, 18, 20, 24)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert OverlongPenalty(enabled=True, buffer=4, factor=0.5, rollout_max_tokens=20)(18) == -0.25
    assert OverlongPenalty(enabled=False, buffer=4, rollout_max_tokens=20)(20) == 0.0


def test_plan_from_rl_config_reads_the_dapo_keys():
    cfg = config_from_dict({
        "rl_config": {"n_samples_per_prompt": 2, "rollout_max_tokens": 20, "overlong_buffer_enable": True,
                      "overlong_buffer": 4, "overlong_buffer_penalty_factor": 2.0,
                      "verifier_function": ["acc", "format"], "verifier_weight": [1.0, 0.5]},
        "generate_config": {"sampling_config": {"max_tokens": 20}},
    })
    plan = ScoringPlan.from_rl_config(cfg.rl_config)
    assert plan.verifiers == ("acc", "format") and plan.weights == (1.0, 0.5)
    assert plan.overlong == OverlongPenalty(True, 4, 2.0, 20)


def test_weighted_sum_of_parts_plus_penalty():
    plan = ScoringPlan.create(["strict_format", "base_acc", "step"], [0.5, 1.0, 2.0], OverlongPenalty(True, 4, 1.0, 20))
    right, wrong = score_samples(
        [ScoreInput(WELL_FORMED, "34", response_length=12), ScoreInput("34", "34", response_length=18)],
        plan, InProcessRunner(),
    )
    assert [(p.name, p.score) for p in right.parts] == [("strict_format", 1.0), ("base_acc", 1.0), ("step", 0.0)]
    assert right.overlong_penalty == 0.0 and right.total == pytest.approx(1.5)
    assert [p.score for p in wrong.parts] == [-0.5, 0.0, 0.0]
    assert wrong.overlong_penalty == -0.5 and wrong.total == pytest.approx(-0.25 - 0.5)


def test_plan_rejects_unknown_verifiers_and_weight_mismatch():
    with pytest.raises(InvalidArgument, match="verifier_function: unknown verifier 'nope'"):
        ScoringPlan.create(["acc", "nope"], [1.0, 1.0], OverlongPenalty())
    with pytest.raises(InvalidArgument, match="verifier_weight: 1 weights for 2 verifier_function entries"):
        ScoringPlan.create(["acc", "format"], [1.0], OverlongPenalty())
    with pytest.raises(InvalidArgument, match="verifier_function: give at least one verifier"):
        ScoringPlan.create([], [], OverlongPenalty())


def test_reward_config_limits_are_validated():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"rl_config": {"n_samples_per_prompt": 2},
                          "reward": {"max_items": 0, "server_threads": -1, "metrics_port": 70000}})
    assert info.value.errors == [
        "reward.max_items: must be > 0, got 0",
        "reward.server_threads: must be > 0, got -1",
        "reward.metrics_port: 70000 is not a TCP port (1-65535, or 0)",
    ]
