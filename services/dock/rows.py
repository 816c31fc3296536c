"""The typed records of one dock row (one sample), and their only conversion to and from the dock's columns.

Each service writes its part of a row and reads the parts it needs; data moves one way:

    record        written by            columns (services/dock/schema.py)
    PromptRow     the trainer (put)     prompts, prompt_length, labels
    RolloutPart   a rollout replica     responses, rollout_log_probs, versions (a partial put: these alone),
                                        response_length, finish_reason, routed_experts (when recorded),
                                        loss_mask, episode_stats (multi-turn episodes)
    RewardPart    a rule reward replica rm_scores, rm_parts (when the layout has it)
    ModelScore    a reward-model replica rm_model (when the reward model runs apart)
    ScoringRow    read by the reward    responses, response_length, and labels / prompts / rm_model as claimed;
                                        loss_mask, episode_stats when stored
    ScoredSample  read by the trainer   prompts, responses, rm_scores, rollout_log_probs, versions; rm_parts,
                                        finish_reason, routed_experts, loss_mask, episode_stats when stored

`to_columns(records)` gives a put's columns (one list per column, a value per row); `from_claim(claim)`
gives a claim's rows as records, in the claim's row order, None for a value whose column the claim did not
take or the row does not hold yet. Values read from the dock are numpy arrays as the codec decodes them
(read-only views). The records that are put check their shapes, naming the column of a value that does not fit.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.common.errors import InvalidArgument
from services.dock.client import Claim
from services.dock.schema import (EPISODE_STATS, EPISODE_STATS_FIELDS, FINISH_REASON, LABELS, LOSS_MASK, PROMPT_LENGTH, PROMPTS, RESPONSE_LENGTH,
                                  RESPONSES, RM_MODEL, RM_PARTS, RM_SCORES, ROLLOUT_LOG_PROBS, ROUTED_EXPERTS,
                                  VERSIONS, ColumnSpec)


def claimed(claim: Claim, column: ColumnSpec) -> list:
    """The claim's values of `column`, one per row; all None when the claim did not take the column."""
    return claim.columns.get(column.name) or [None] * len(claim)


def names(columns: Sequence[ColumnSpec]) -> list[str]:
    """The names of `columns`, as a claim takes them."""
    return [c.name for c in columns]


def _all_or_none(column: ColumnSpec, values: Sequence) -> bool:
    """Whether a put carries `column`: every row gives a value, or none does."""
    given = sum(v is not None for v in values)
    if given not in (0, len(values)):
        raise InvalidArgument(column.name, f"given for {given} of {len(values)} rows; a put needs all or none")
    return given > 0


def _check_rank(column: ColumnSpec, value: np.ndarray) -> None:
    if value.ndim != len(column.shape):
        raise InvalidArgument(column.name, f"shape {value.shape} does not fit the column's per-row shape {column.shape_text}")


def _scalar(value) -> float:
    return float(np.asarray(value).reshape(-1)[0])


def episode_stats(counters: Mapping[str, float], reward: float) -> np.ndarray:
    """[K] float32 an episode's EPISODE_STATS value: its counters (a kind it never counted: 0) and its reward."""
    values = {**counters, "environment_reward": reward}
    return np.array([float(values.get(name, 0.0)) for name in EPISODE_STATS_FIELDS], np.float32)


def episode_stat(stats: np.ndarray, name: str) -> float:
    """One field of an EPISODE_STATS value, by name."""
    return float(stats[EPISODE_STATS_FIELDS.index(name)])


@dataclass(frozen=True)
class PromptRow:
    """A prompt as the trainer admits it; each of its group's n rows holds the same one."""

    prompt_ids: np.ndarray  # [P] int32 prompt token ids (chat template applied)
    label: str  # the reference answer the verifiers compare with

    def __post_init__(self):
        _check_rank(PROMPTS, self.prompt_ids)

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @staticmethod
    def to_columns(rows: Sequence[PromptRow]) -> dict[str, list]:
        """A put's columns for `rows`."""
        return {PROMPTS.name: [r.prompt_ids for r in rows], PROMPT_LENGTH.name: [r.prompt_length for r in rows],
                LABELS.name: [r.label for r in rows]}


@dataclass(frozen=True)
class RolloutPart:
    """What a rollout replica generated for a row: the whole response so far and, per token, its log-prob and version.

    A partial put (partial rollout: the row goes back unfinished) carries only the per-token fields, which the
    claim that resumes the row reads back (`from_claim`), and appends to. A multi-turn trajectory fits the same
    record: `response_ids` then holds its segments after the prompt in turn, model and environment tokens alike,
    and `loss_mask` [L] says which are the model's (1). Environment tokens keep a log-prob and a version slot,
    masked out. Partial rollout does not carry episodes yet (the config refuses both together), so the mask is put
    with a final put only; the segment lengths [S] are not stored until a consumer needs the turns.
    """

    response_ids: np.ndarray  # [L] int32 response token ids
    log_probs: np.ndarray  # [L] float32 the rollout engine's log p of each token
    versions: np.ndarray  # [L] int32 the policy version that generated each token
    finish_reason: str | None = None  # a FinishReason value; None: unfinished (a partial put carries none)
    # [P+L-1, MoE layers, top_k] uint8 expert ids each computed position was routed to (rl_config.routing_replay;
    # [0, layers, top_k] for a row that failed before a token); None: not recorded
    routed_experts: np.ndarray | None = None
    loss_mask: np.ndarray | None = None  # [L] uint8 1: a model token, 0: an environment's; None: single-turn (all 1)
    episode_stats: np.ndarray | None = None  # [K] float32 EPISODE_STATS (episode_stats()); None: single-turn

    # The columns a partial put writes and a resuming claim reads (Dock.claim's partial_columns).
    TOKEN_COLUMNS = (RESPONSES, ROLLOUT_LOG_PROBS, VERSIONS)

    def __post_init__(self):
        for column, value in zip(self.TOKEN_COLUMNS, (self.response_ids, self.log_probs, self.versions)):
            _check_rank(column, value)
        if len(self.versions) != len(self.response_ids):
            raise InvalidArgument(VERSIONS.name, f"{len(self.versions)} versions for {len(self.response_ids)} response tokens")
        if self.routed_experts is not None:
            _check_rank(ROUTED_EXPERTS, self.routed_experts)
        if self.loss_mask is not None and (self.loss_mask.ndim != 1 or len(self.loss_mask) != len(self.response_ids)):
            raise InvalidArgument(LOSS_MASK.name, f"shape {self.loss_mask.shape} for {len(self.response_ids)} response tokens")
        if self.episode_stats is not None and self.episode_stats.shape != (len(EPISODE_STATS_FIELDS),):
            raise InvalidArgument(EPISODE_STATS.name, f"shape {self.episode_stats.shape}; one value per field of {EPISODE_STATS_FIELDS}")

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @staticmethod
    def to_partial_columns(parts: Sequence[RolloutPart]) -> dict[str, list]:
        """A partial put's columns: the per-token fields of `parts` (the responses so far)."""
        return {RESPONSES.name: [p.response_ids for p in parts], ROLLOUT_LOG_PROBS.name: [p.log_probs for p in parts],
                VERSIONS.name: [p.versions for p in parts]}

    @staticmethod
    def to_columns(parts: Sequence[RolloutPart]) -> dict[str, list]:
        """A final put's columns: every field; routed_experts, loss_mask and episode_stats only when every part has them."""
        columns = {**RolloutPart.to_partial_columns(parts), RESPONSE_LENGTH.name: [p.response_length for p in parts],
                   FINISH_REASON.name: [p.finish_reason for p in parts]}
        for column, values in ((ROUTED_EXPERTS, [p.routed_experts for p in parts]), (LOSS_MASK, [p.loss_mask for p in parts]),
                               (EPISODE_STATS, [p.episode_stats for p in parts])):
            if _all_or_none(column, values):
                columns[column.name] = values
        return columns

    @staticmethod
    def from_claim(claim: Claim) -> list[RolloutPart | None]:
        """The responses so far of a claim's rows (taken as TOKEN_COLUMNS); None for a row with none stored."""
        return [None if ids is None else RolloutPart(ids, log_probs, versions)
                for ids, log_probs, versions in zip(*(claimed(claim, c) for c in RolloutPart.TOKEN_COLUMNS))]


@dataclass(frozen=True)
class ScoringRow:
    """A row as the reward reads it to score it."""

    response_ids: np.ndarray  # [L] int32 response token ids
    response_length: int | None  # []; None: not stored (then the response's token count)
    label: str  # "": not claimed (a reward-model replica needs none)
    prompt_ids: np.ndarray | None  # [P] int32; None: not claimed (only the reward model reads the prompt)
    model_score: float | None  # [] the reward model's score from its own replicas; None: not claimed
    loss_mask: np.ndarray | None = None  # [L] uint8 a multi-turn episode's (1: the model's tokens); None: not stored
    episode_stats: np.ndarray | None = None  # [K] float32 EPISODE_STATS; None: not stored

    # Read when stored, never waited for (a claim's partial_columns; those of them the layout has): loss_mask and
    # episode_stats are put with the responses, so a row whose responses are final holds them when its layout does.
    OPTIONAL_COLUMNS = (RESPONSE_LENGTH, LOSS_MASK, EPISODE_STATS)

    @staticmethod
    def from_claim(claim: Claim) -> list[ScoringRow]:
        """The claim's rows (it took RESPONSES and any of LABELS, PROMPTS, RM_MODEL)."""
        return [ScoringRow(ids, None if length is None else int(length), "" if label is None else label, prompt,
                           None if model is None else _scalar(model), mask, stats)
                for ids, length, label, prompt, model, mask, stats in zip(
                    claimed(claim, RESPONSES), claimed(claim, RESPONSE_LENGTH), claimed(claim, LABELS),
                    claimed(claim, PROMPTS), claimed(claim, RM_MODEL), claimed(claim, LOSS_MASK),
                    claimed(claim, EPISODE_STATS))]

    @property
    def final_turn_ids(self) -> np.ndarray:
        """The tokens a rule verifier reads: a multi-turn episode's last model turn (the tokens after its last
        environment token), so a tool response is never scored as the answer; the whole response without a mask."""
        if self.loss_mask is None:
            return self.response_ids
        environment = np.flatnonzero(np.asarray(self.loss_mask) == 0)
        return self.response_ids if len(environment) == 0 else self.response_ids[int(environment[-1]) + 1:]

    @property
    def environment_reward(self) -> float:
        """The episode's environment reward; 0.0 for a row without episode stats."""
        return 0.0 if self.episode_stats is None else episode_stat(self.episode_stats, "environment_reward")


@dataclass(frozen=True)
class RewardPart:
    """What a rule reward replica puts for a row: the weighted reward and each verifier's unweighted score."""

    score: float  # [] reward of the whole response
    parts: np.ndarray | None  # [V] float32 each verifier's score (rl_config.verifier_function order); None: not put

    def __post_init__(self):
        if self.parts is not None:
            _check_rank(RM_PARTS, self.parts)

    @staticmethod
    def to_columns(parts: Sequence[RewardPart]) -> dict[str, np.ndarray]:
        """A put's columns: rm_scores, and rm_parts when the parts carry them (a layout may have no rm_parts)."""
        columns = {RM_SCORES.name: np.array([p.score for p in parts], dtype=np.float32)}
        if _all_or_none(RM_PARTS, [p.parts for p in parts]):
            columns[RM_PARTS.name] = np.array([p.parts for p in parts], dtype=np.float32)
        return columns


@dataclass(frozen=True)
class ModelScore:
    """What a reward-model replica puts for a row, when the reward model runs apart from the rules."""

    score: float  # [] the reward model's score, before weighting

    @staticmethod
    def to_columns(scores: Sequence[ModelScore]) -> dict[str, np.ndarray]:
        """A put's column: rm_model."""
        return {RM_MODEL.name: np.array([s.score for s in scores], dtype=np.float32)}


@dataclass(frozen=True)
class ScoredSample:
    """A complete, scored row as the trainer claims it to train on."""

    prompt_ids: np.ndarray  # [P] int32
    response_ids: np.ndarray  # [L] int32
    score: float  # [] reward of the whole response
    log_probs: np.ndarray  # [L] float32 the rollout engine's log p of each token
    versions: np.ndarray  # [L] int32 the policy version that generated each token
    parts: np.ndarray | None  # [V] float32 each verifier's score; None: not stored
    finish_reason: str | None  # a FinishReason value; None: not stored
    routed_experts: np.ndarray | None  # [P+L-1, MoE layers, top_k] uint8; None: not recorded
    loss_mask: np.ndarray | None = None  # [L] uint8 1: a model token (trained), 0: an environment's; None: all 1
    episode_stats: np.ndarray | None = None  # [K] float32 EPISODE_STATS (episode_stat() reads a field); None: single-turn

    # A claim waits for these to be final.
    COLUMNS = (PROMPTS, RESPONSES, RM_SCORES, ROLLOUT_LOG_PROBS, VERSIONS)
    # Read when stored, never waited for: routed_experts, loss_mask and episode_stats are put with the responses
    # (same put), so a scored row holds them whenever its replica wrote them.
    OPTIONAL_COLUMNS = (RM_PARTS, FINISH_REASON, ROUTED_EXPERTS, LOSS_MASK, EPISODE_STATS)

    @staticmethod
    def from_claim(claim: Claim) -> list[ScoredSample]:
        """The claim's rows (it took COLUMNS, and those of OPTIONAL_COLUMNS its layout has)."""
        return [ScoredSample(prompt, response, _scalar(score), log_probs, versions, parts, reason, routed, mask, stats)
                for prompt, response, score, log_probs, versions, parts, reason, routed, mask, stats in zip(
                    *(claimed(claim, c) for c in (*ScoredSample.COLUMNS, *ScoredSample.OPTIONAL_COLUMNS)))]
