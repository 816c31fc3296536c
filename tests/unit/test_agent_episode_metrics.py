"""A multi-turn episode's stats on their way to the trainer's agent/ metrics, and the reward of an episode: the
episode_stats column's round trip, the metrics of a hand-made batch, the last model turn as the only text a rule
verifier reads, and rollout.multi_turn.environment_reward_weight."""
from types import SimpleNamespace

import numpy as np
import pytest

from services.common.config import ConfigError, config_from_dict
from services.common.errors import InvalidArgument
from services.dock.client import Claim
from services.dock.rows import (PromptRow, RewardPart, RolloutPart, ScoredSample, ScoringRow, episode_stat,
                                episode_stats)
from services.dock.schema import (EPISODE_STATS, EPISODE_STATS_FIELDS, LABELS, LOSS_MASK, RESPONSES,
                                  DockLayout)
from services.reward.overlong import OverlongPenalty
from services.reward.pool import InProcessRunner
from services.reward.scoring import ScoringPlan, score_samples
from services.reward.worker import RewardWorker
from services.trainer.loop.iteration_data import ScoredBatch
from services.trainer.loop.step_metrics import agent_metrics, batch_metrics
from dock_helpers import stored_claim

BASE = {"rl_config": {"n_samples_per_prompt": 2}}
AGENT = {**BASE, "rollout": {"multi_turn": {"environment": "tools"}}}


def _part(mask: list[int], stats: np.ndarray | None) -> RolloutPart:
    n = len(mask)
    return RolloutPart(np.arange(n, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), "stop",
                       loss_mask=np.array(mask, np.uint8), episode_stats=stats)


def test_the_layout_holds_episode_stats_only_with_an_environment():
    assert not DockLayout.from_config(config_from_dict(BASE)).has(EPISODE_STATS)
    layout = DockLayout.from_config(config_from_dict(AGENT))
    assert layout.has(EPISODE_STATS) and layout.has(LOSS_MASK)
    assert DockLayout.from_json(layout.to_json()) == layout


def test_episode_stats_round_trip_through_the_dock():
    stats = episode_stats({"turns": 3, "tool_calls": 2, "tool_error": 1, "environment_s": 0.25, "observations_cut": 4}, 0.5)
    assert stats.dtype == np.float32 and stats.shape == (len(EPISODE_STATS_FIELDS),)
    assert [episode_stat(stats, f) for f in ("turns", "tool_calls", "tool_error", "unknown_tool", "environment_reward")] == \
        [3, 2, 1, 0, 0.5]
    columns = RolloutPart.to_columns([_part([1, 0, 1], stats)])
    assert EPISODE_STATS.name not in RolloutPart.to_columns([_part([1], None)])
    sample, = ScoredSample.from_claim(stored_claim(PromptRow.to_columns([PromptRow(np.array([7], np.int32), "")]), columns,
                                             RewardPart.to_columns([RewardPart(1.0, None)])))
    assert sample.episode_stats.tolist() == stats.tolist() and sample.loss_mask.tolist() == [1, 0, 1]
    row, = ScoringRow.from_claim(stored_claim(columns))
    assert row.environment_reward == 0.5 and row.final_turn_ids.tolist() == [2]


def test_episode_stats_of_another_length_are_refused():
    with pytest.raises(InvalidArgument, match="episode_stats"):
        _part([1], np.zeros(3, np.float32))


def _sample(length: int, mask: list[int] | None, stats: np.ndarray | None) -> ScoredSample:
    return ScoredSample(np.array([1], np.int32), np.arange(length, dtype=np.int32), 1.0, np.zeros(length, np.float32),
                        np.zeros(length, np.int32), None, "stop", None,
                        None if mask is None else np.array(mask, np.uint8), stats)


def test_agent_metrics_of_a_batch_with_and_without_tools():
    tools = _sample(10, [1, 1, 0, 0, 1, 1, 0, 0, 1, 1],
                    episode_stats({"turns": 3, "tool_calls": 2, "unknown_tool": 1, "environment_s": 0.5}, 0.0))
    plain = _sample(4, [1, 1, 1, 1], episode_stats({"turns": 1, "environment_s": 0.1}, 1.0))
    metrics = agent_metrics(ScoredBatch([tools, plain]))
    assert metrics["agent/turns_mean"] == 2.0
    assert metrics["agent/tool_calls_mean"] == 1.0
    assert metrics["agent/tool_errors_mean"] == 0.5
    assert metrics["agent/tool_call_rate"] == 0.5
    assert metrics["agent/tool_error_rate"] == 0.5 and metrics["agent/tool_success_rate"] == 0.5
    assert metrics["agent/error_rate/unknown_tool"] == 0.5 and metrics["agent/error_rate/tool_timeout"] == 0.0
    assert metrics["agent/environment_s_mean"] == pytest.approx(0.3)
    assert metrics["agent/environment_reward_mean"] == 0.5
    assert metrics["agent/episode_length_mean"] == 7.0 and metrics["agent/episode_length_max"] == 10
    assert metrics["agent/model_tokens_mean"] == 5.0
    assert metrics.items() <= batch_metrics(ScoredBatch([tools, plain]), 0, 2).items()
    # no call at all: no rates; a single-turn batch: no agent metrics
    assert "agent/tool_error_rate" not in agent_metrics(ScoredBatch([plain, plain]))
    assert not any(k.startswith("agent/") for k in batch_metrics(ScoredBatch([_sample(3, None, None)] * 2), 0, 2))


class _CharDecoder:
    """One token per character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _worker(plan: ScoringPlan) -> RewardWorker:
    dock = SimpleNamespace(holder="reward-test", timeline=lambda: None, layout=DockLayout.from_config(config_from_dict(AGENT)))
    return RewardWorker(dock, plan, InProcessRunner(), _CharDecoder())


def _episode_claim(turns: list[tuple[str, int]], label: str, stats: np.ndarray | None = None) -> Claim:
    ids = [ord(c) for text, _ in turns for c in text]
    mask = [model for text, model in turns for _ in text]
    put = {RESPONSES.name: [np.array(ids, np.int32)], LABELS.name: [label], LOSS_MASK.name: [np.array(mask, np.uint8)]}
    if stats is not None:
        put[EPISODE_STATS.name] = [stats]
    return stored_claim(put)


def test_the_rules_read_the_last_model_turn_only():
    plan = ScoringPlan.create(["math_verify"], [1.0], OverlongPenalty())
    worker = _worker(plan)
    wrong_in_tool = _episode_claim([("<tool_call>{}</tool_call>", 1), (r"<tool_response>\boxed{7}</tool_response>", 0),
                                    (r"So it is \boxed{34}", 1)], "34")
    right_in_tool = _episode_claim([("<tool_call>{}</tool_call>", 1), (r"<tool_response>\boxed{34}</tool_response>", 0),
                                    ("I cannot tell", 1)], "34")
    inputs = worker._inputs(wrong_in_tool) + worker._inputs(right_in_tool)
    assert [i.answer for i in inputs] == [r"So it is \boxed{34}", "I cannot tell"]
    assert r"\boxed{7}" in inputs[0].response  # the whole trajectory is still the response (the reward model's, the length's)
    assert [s.total for s in score_samples(inputs, plan, InProcessRunner())] == [1.0, 0.0]
    # a row without a mask is scored as today: its whole response
    single = stored_claim({RESPONSES.name: [np.array([ord(c) for c in r"\boxed{34}"], np.int32)], LABELS.name: ["34"]})
    assert worker._inputs(single)[0].answer is None
    assert score_samples(worker._inputs(single), plan, InProcessRunner())[0].total == 1.0


def test_the_environment_reward_is_paid_by_its_weight():
    claim = _episode_claim([(r"\boxed{34}", 1)], "34", episode_stats({"turns": 1}, 0.5))
    unpaid = ScoringPlan.create(["math_verify"], [1.0], OverlongPenalty())
    paid = ScoringPlan.create(["math_verify"], [1.0], OverlongPenalty(), environment_weight=2.0)
    inputs = _worker(unpaid)._inputs(claim)
    assert inputs[0].environment_reward == 0.5
    assert score_samples(inputs, unpaid, InProcessRunner())[0].total == 1.0
    assert score_samples(inputs, paid, InProcessRunner())[0].total == 2.0
    cfg = config_from_dict({**BASE, "rollout": {"multi_turn": {"environment": "tools", "environment_reward_weight": 0.25}}})
    assert ScoringPlan.from_config(cfg).environment_weight == 0.25
    assert ScoringPlan.from_config(config_from_dict(AGENT)).environment_weight == 0.0


def test_a_negative_environment_weight_is_refused():
    with pytest.raises(ConfigError, match="environment_reward_weight"):
        config_from_dict({**BASE, "rollout": {"multi_turn": {"environment": "tools", "environment_reward_weight": -1.0}}})
    with pytest.raises(InvalidArgument, match="environment_reward_weight"):
        ScoringPlan.create(["math_verify"], [1.0], OverlongPenalty(), environment_weight=-0.5)
