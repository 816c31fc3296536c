"""One sample's typed records through a real dock, each written and read by the consumer that owns it: the
trainer's prompt, a partial rollout resumed by a later claim, the reward, and the trainer's scored sample."""
import numpy as np
import pytest

from services.common.sample import FinishReason
from services.dock.rows import PromptRow, RewardPart, RolloutPart, ScoredSample, ScoringRow, claimed, names
from services.dock.schema import LABELS, PROMPTS, RESPONSES, DockLayout

pytestmark = pytest.mark.service

N = 2


def held(dock, columns) -> list[str]:
    """The names of `columns` the dock's layout holds (a claim names only those, as the services do)."""
    return names([c for c in columns if dock.layout.has(c)])


def test_a_sample_goes_from_prompt_to_scored_sample_through_the_dock(dock_factory):
    dock = dock_factory(DockLayout(n_samples_per_prompt=N, capacity_groups=1, partial_rollout_max_split=2))
    rows = dock.rows_of([0])
    dock.put(rows, PromptRow.to_columns([PromptRow(np.array([5, 6], np.int32), "7")] * N))

    # The first split: each row generates one token and goes back unfinished.
    claim = dock.claim("actor_rollout", [PROMPTS.name], N, partial_columns=names(RolloutPart.TOKEN_COLUMNS))
    assert RolloutPart.from_claim(claim) == [None] * N
    first = [RolloutPart(np.array([p[-1] + 1], np.int32), np.array([-0.5], np.float32), np.array([0], np.int32))
             for p in claimed(claim, PROMPTS)]
    dock.put(claim.indexes, RolloutPart.to_partial_columns(first), lease=claim.lease, partial=True)

    # The second split resumes them, and puts them final with one more token of version 1.
    claim = dock.claim("actor_rollout", [PROMPTS.name], N, partial_columns=names(RolloutPart.TOKEN_COLUMNS))
    prior = RolloutPart.from_claim(claim)
    assert [p.response_ids.tolist() for p in prior] == [[7], [7]]
    final = [RolloutPart(np.append(p.response_ids, 8).astype(np.int32), np.append(p.log_probs, -0.25).astype(np.float32),
                         np.append(p.versions, 1).astype(np.int32), FinishReason.STOP.value) for p in prior]
    dock.put(claim.indexes, RolloutPart.to_columns(final), lease=claim.lease, version=1)

    claim = dock.claim("rule_reward", names([RESPONSES, LABELS]), N, partial_columns=held(dock, ScoringRow.OPTIONAL_COLUMNS))
    scoring = ScoringRow.from_claim(claim)
    assert [(r.response_ids.tolist(), r.response_length, r.label) for r in scoring] == [([7, 8], 2, "7")] * N
    parts = [RewardPart(float(r.response_ids[0] == int(r.label)), np.array([1.0, 0.0], np.float32)) for r in scoring]
    dock.put(claim.indexes, RewardPart.to_columns(parts), lease=claim.lease)

    claim = dock.claim("actor_train", names(ScoredSample.COLUMNS), N, partial_columns=held(dock, ScoredSample.OPTIONAL_COLUMNS))
    samples = ScoredSample.from_claim(claim)
    assert [s.prompt_ids.tolist() for s in samples] == [[5, 6]] * N and [s.score for s in samples] == [1.0] * N
    assert [s.versions.tolist() for s in samples] == [[0, 1]] * N and [s.log_probs.tolist() for s in samples] == [[-0.5, -0.25]] * N
    assert [s.parts.tolist() for s in samples] == [[1.0, 0.0]] * N and {s.finish_reason for s in samples} == {"stop"}
    assert all(s.routed_experts is None for s in samples)  # no replica recorded routing: the column stays empty
