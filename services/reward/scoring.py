"""A sample's reward: the weighted sum of its verifier scores plus the overlong penalty, plus, for a multi-turn
episode, its environment's reward times rollout.multi_turn.environment_reward_weight (0 by default: reported in
the trainer's agent/ metrics, not paid).

The parts are the rule verifiers (run by the process pool) and, when `reward_model` is listed,
the reward model's score: run by this process's vLLM engine at the same time as the rules, or,
when reward-model replicas run apart (reward_config.model_replicas), read from the dock's
`rm_model` column that one of them put (`ScoreInput.model_score`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.config import RLConfig
from services.common.errors import InvalidArgument
from services.reward.model import MODEL_VERIFIER, ModelScorer
from services.reward.overlong import OverlongPenalty
from services.reward.pool import VerifierOutcome, VerifierRunner, VerifyTask
from services.reward.verifiers import get_verifier


@dataclass(frozen=True)
class ScoringPlan:
    """Which verifiers, their weights, and the overlong penalty; build it with `create` (validated)."""

    verifiers: tuple[str, ...]
    weights: tuple[float, ...]
    overlong: OverlongPenalty
    environment_weight: float = 0.0  # rollout.multi_turn.environment_reward_weight: the environment reward's weight

    @classmethod
    def create(cls, verifiers: Sequence[str], weights: Sequence[float], overlong: OverlongPenalty,
               environment_weight: float = 0.0) -> "ScoringPlan":
        """A plan, or InvalidArgument naming verifier_function / verifier_weight / environment_reward_weight."""
        if environment_weight < 0:
            raise InvalidArgument("rollout.multi_turn.environment_reward_weight", f"{environment_weight} is negative; give >= 0")
        if not verifiers:
            raise InvalidArgument("verifier_function", "give at least one verifier")
        for name in verifiers:
            if name != MODEL_VERIFIER:
                get_verifier(name)
        if len(weights) != len(verifiers):
            raise InvalidArgument(
                "verifier_weight", f"{len(weights)} weights for {len(verifiers)} verifier_function entries; give one per verifier"
            )
        return cls(tuple(verifiers), tuple(float(w) for w in weights), overlong, float(environment_weight))

    @property
    def uses_model(self) -> bool:
        """Whether the reward model is one of the parts."""
        return MODEL_VERIFIER in self.verifiers

    @property
    def rules(self) -> tuple[str, ...]:
        """The rule verifiers among the parts, in order."""
        return tuple(name for name in self.verifiers if name != MODEL_VERIFIER)

    @classmethod
    def from_rl_config(cls, rl: RLConfig) -> "ScoringPlan":
        """The plan the run's rl_config asks for."""
        return cls.create(rl.verifier_function, rl.verifier_weight, OverlongPenalty.from_rl_config(rl))

    @classmethod
    def from_config(cls, cfg) -> "ScoringPlan":
        """The run's plan: rl_config's, with rollout.multi_turn's environment reward weight (a dock worker's rows
        carry the environment's reward; the gRPC Score service's never do)."""
        plan = cls.from_rl_config(cfg.rl_config)
        return cls.create(plan.verifiers, plan.weights, plan.overlong, cfg.rollout.multi_turn.environment_reward_weight)


@dataclass(frozen=True)
class ScoreInput:
    """One decoded response to score; `response_length` in tokens (for the overlong penalty);
    `prompt` (text, chat template included) is read by the reward model only; `model_score` is
    the reward model's score when another replica computed it already; `answer` is what the rule verifiers read
    when it differs from `response` (a multi-turn episode's last model turn); `environment_reward` is a multi-turn
    episode's environment reward (weighted by the plan's environment_weight)."""

    response: str
    label: str
    response_length: int = 0
    prompt: str = ""
    model_score: float | None = None
    answer: str | None = None  # None: the rules read `response`
    environment_reward: float = 0.0


@dataclass(frozen=True)
class PartScore:
    """One verifier's unweighted score on a sample."""

    name: str
    score: float
    timed_out: bool = False


@dataclass(frozen=True)
class SampleScore:
    """`total = sum(weight * part.score) + overlong_penalty + environment_weight * environment_reward`."""

    total: float
    parts: tuple[PartScore, ...]
    overlong_penalty: float


def score_samples(samples: Sequence[ScoreInput], plan: ScoringPlan, runner: VerifierRunner,
                  model: ModelScorer | None = None) -> list[SampleScore]:
    """Scores every sample with the plan's parts: rules through `runner` (the pool or in-process),
    `reward_model` through `model`, both at once. InvalidArgument when the plan needs a model this
    process has none of, or a sample gives the model no token (field `items[i].response`). Samples
    that all carry `model_score` take the model's part from it instead of `model`."""
    model_values = [s.model_score for s in samples]
    pending = None
    if plan.uses_model and (None in model_values or not samples):
        if model is None:
            raise InvalidArgument(
                "verifier_function", f"{MODEL_VERIFIER} is not served here (reward_config.load is empty, or "
                                     "reward_config.model_replicas > 0 puts the model on reward-model replicas only)"
            )
        ids = [model.encode(s.prompt, s.response, f"items[{i}].response") for i, s in enumerate(samples)]
        pending = model.submit(ids)
    rule_outcomes = runner.run([VerifyTask(s.response if s.answer is None else s.answer, s.label, plan.rules) for s in samples]) if plan.rules else [[] for _ in samples]
    if pending is not None:
        model_values = pending.result()
    scored = []
    for i, (sample, outcomes) in enumerate(zip(samples, rule_outcomes)):
        rule_parts = iter(outcomes)
        parts = tuple(
            PartScore(name, model_values[i]) if name == MODEL_VERIFIER else _rule_part(name, next(rule_parts))
            for name in plan.verifiers
        )
        penalty = plan.overlong(sample.response_length)
        total = sum(w * p.score for w, p in zip(plan.weights, parts)) + penalty
        if plan.environment_weight:
            total += plan.environment_weight * sample.environment_reward
        scored.append(SampleScore(total, parts, penalty))
    return scored


def _rule_part(name: str, outcome: VerifierOutcome) -> PartScore:
    return PartScore(name, outcome.score, outcome.timed_out)
