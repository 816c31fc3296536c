"""The typed records of a dock row (services/dock/rows.py): to columns and back through the dock's codec, shapes
refused with the column named, optional columns absent (no servers)."""
import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.common.sample import FinishReason
from services.dock.rows import ModelScore, PromptRow, RewardPart, RolloutPart, ScoredSample, ScoringRow, claimed
from services.dock.schema import (DEFAULT_COLUMNS, FINISH_REASON, PROMPTS, RESPONSE_LENGTH, RM_PARTS, ROLLOUT_LOG_PROBS, ROUTED_EXPERTS,
                                  VERSIONS, DockLayout)
from dock_helpers import claim_of, stored_claim, stored_columns

def _rollout(tokens: list[int], version: int = 3, **fields) -> RolloutPart:
    return RolloutPart(np.array(tokens, np.int32), np.full(len(tokens), -0.5, np.float32),
                       np.full(len(tokens), version, np.int32), **fields)


def test_the_default_layout_is_built_from_the_schemas_column_constants():
    assert DockLayout(2, 4).columns == DEFAULT_COLUMNS and DockLayout(2, 4).completion_column == "responses"
    assert PROMPTS in DEFAULT_COLUMNS and DockLayout(2, 4).has(RM_PARTS)
    assert not DockLayout(2, 4, columns=tuple(c for c in DEFAULT_COLUMNS if c != RM_PARTS)).has(RM_PARTS)


def test_one_sample_round_trips_from_prompt_to_scored_sample():
    prompts = [PromptRow(np.array([5, 6, 7], np.int32), "42"), PromptRow(np.array([8], np.int32), "x = 4 ✓")]
    routed = np.arange(2 * 4 * 2, dtype=np.uint8).reshape(4, 2, 2)  # [P+L-1, layers, top_k] for the 3 + 2 token row
    parts = [_rollout([1, 2], finish_reason=FinishReason.STOP.value, routed_experts=routed),
             _rollout([9], version=4, finish_reason=FinishReason.LENGTH.value, routed_experts=np.zeros((0, 2, 2), np.uint8))]
    rewards = [RewardPart(1.0, np.array([1.0, 0.5], np.float32)), RewardPart(0.0, np.array([0.0, 0.5], np.float32))]
    claim = stored_claim(PromptRow.to_columns(prompts), RolloutPart.to_columns(parts), RewardPart.to_columns(rewards))
    assert claimed(claim, RESPONSE_LENGTH) == [2, 1]

    samples = ScoredSample.from_claim(claim)
    assert [s.prompt_ids.tolist() for s in samples] == [[5, 6, 7], [8]]
    assert [s.response_ids.tolist() for s in samples] == [[1, 2], [9]]
    assert [s.score for s in samples] == [1.0, 0.0] and [s.parts.tolist() for s in samples] == [[1.0, 0.5], [0.0, 0.5]]
    assert [s.log_probs.tolist() for s in samples] == [[-0.5, -0.5], [-0.5]]
    assert [s.versions.tolist() for s in samples] == [[3, 3], [4]]
    assert [s.finish_reason for s in samples] == ["stop", "length"]
    np.testing.assert_array_equal(samples[0].routed_experts, routed)
    assert samples[1].routed_experts.shape == (0, 2, 2)

    scoring = ScoringRow.from_claim(claim)
    assert [(r.response_ids.tolist(), r.response_length, r.label) for r in scoring] == [([1, 2], 2, "42"), ([9], 1, "x = 4 ✓")]
    assert scoring[0].prompt_ids.tolist() == [5, 6, 7] and scoring[0].model_score is None


def test_a_partial_put_carries_the_tokens_alone_and_a_resuming_claim_reads_them():
    columns = RolloutPart.to_partial_columns([_rollout([4, 5, 6])])
    assert set(columns) == {c.name for c in RolloutPart.TOKEN_COLUMNS}
    # row 1 was never put partial: a claim reads None for each of its token columns
    resumed, fresh = RolloutPart.from_claim(claim_of({name: values + [None] for name, values in stored_columns(columns).items()}))
    assert resumed.response_ids.tolist() == [4, 5, 6] and resumed.versions.tolist() == [3, 3, 3]
    assert resumed.finish_reason is None and fresh is None


def test_optional_columns_absent_read_as_none():
    """A put without routed experts or per-verifier parts leaves their columns out; a claim without them reads None."""
    columns = RolloutPart.to_columns([_rollout([1], finish_reason=FinishReason.STOP.value)])
    assert ROUTED_EXPERTS.name not in columns
    del columns[FINISH_REASON.name]  # as in a layout without the column (the trainer claims it only when there)
    rewards = RewardPart.to_columns([RewardPart(0.5, None)])
    assert RM_PARTS.name not in rewards
    claim = stored_claim(PromptRow.to_columns([PromptRow(np.array([1], np.int32), "")]), columns, rewards)
    sample, = ScoredSample.from_claim(claim)
    assert sample.parts is None and sample.routed_experts is None and sample.finish_reason is None
    row, = ScoringRow.from_claim(stored_claim(RolloutPart.to_partial_columns([_rollout([1, 2])])))
    assert row.response_length is None and row.label == "" and row.prompt_ids is None and row.model_score is None
    row, = ScoringRow.from_claim(stored_claim(RolloutPart.to_partial_columns([_rollout([1])]), ModelScore.to_columns([ModelScore(0.25)])))
    assert row.model_score == 0.25


@pytest.mark.parametrize("make, column", [
    (lambda: PromptRow(np.zeros((2, 2), np.int32), ""), PROMPTS.name),
    (lambda: RolloutPart(np.zeros(2, np.int32), np.zeros((2, 1), np.float32), np.zeros(2, np.int32)), ROLLOUT_LOG_PROBS.name),
    (lambda: RolloutPart(np.zeros(2, np.int32), np.zeros(2, np.float32), np.zeros(3, np.int32)), VERSIONS.name),
    (lambda: _rollout([1], routed_experts=np.zeros((1, 2), np.uint8)), ROUTED_EXPERTS.name),
    (lambda: RewardPart(1.0, np.zeros((1, 1), np.float32)), RM_PARTS.name),
    (lambda: RolloutPart.to_columns([_rollout([1], routed_experts=np.zeros((1, 1, 1), np.uint8)), _rollout([1])]),
     ROUTED_EXPERTS.name),
    (lambda: RewardPart.to_columns([RewardPart(1.0, np.zeros(1, np.float32)), RewardPart(0.0, None)]), RM_PARTS.name),
])
def test_shapes_that_do_not_fit_are_refused_with_the_column_named(make, column):
    with pytest.raises(InvalidArgument) as refused:
        make()
    assert refused.value.field == column
