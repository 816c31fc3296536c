"""A sample's reward: the weighted sum of its verifier scores plus the overlong penalty."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.config import RLConfig
from services.common.errors import InvalidArgument
from services.reward.overlong import OverlongPenalty
from services.reward.pool import VerifierRunner, VerifyTask
from services.reward.verifiers import get_verifier


@dataclass(frozen=True)
class ScoringPlan:
    """Which verifiers, their weights, and the overlong penalty; build it with `create` (validated)."""

    verifiers: tuple[str, ...]
    weights: tuple[float, ...]
    overlong: OverlongPenalty

    @classmethod
    def create(cls, verifiers: Sequence[str], weights: Sequence[float], overlong: OverlongPenalty) -> "ScoringPlan":
        """A plan, or InvalidArgument naming verifier_function / verifier_weight."""
        if not verifiers:
            raise InvalidArgument("verifier_function", "give at least one verifier")
        for name in verifiers:
            get_verifier(name)
        if len(weights) != len(verifiers):
            raise InvalidArgument(
                "verifier_weight", f"{len(weights)} weights for {len(verifiers)} verifier_function entries; give one per verifier"
            )
        return cls(tuple(verifiers), tuple(float(w) for w in weights), overlong)

    @classmethod
    def from_rl_config(cls, rl: RLConfig) -> "ScoringPlan":
        """The plan the run's rl_config asks for."""
        return cls.create(rl.verifier_function, rl.verifier_weight, OverlongPenalty.from_rl_config(rl))


@dataclass(frozen=True)
class ScoreInput:
    """One decoded response to score; `response_length` in tokens (for the overlong penalty)."""

    response: str
    label: str
    response_length: int = 0


@dataclass(frozen=True)
class PartScore:
    """One verifier's unweighted score on a sample."""

    name: str
    score: float
    timed_out: bool = False


@dataclass(frozen=True)
class SampleScore:
    """`total = sum(weight * part.score) + overlong_penalty`."""

    total: float
    parts: tuple[PartScore, ...]
    overlong_penalty: float


def score_samples(samples: Sequence[ScoreInput], plan: ScoringPlan, runner: VerifierRunner) -> list[SampleScore]:
    """Scores every sample with the plan's verifiers through `runner` (the pool or in-process)."""
    tasks = [VerifyTask(s.response, s.label, plan.verifiers) for s in samples]
    outcomes = runner.run(tasks)
    scored = []
    for sample, sample_outcomes in zip(samples, outcomes):
        parts = tuple(PartScore(name, o.score, o.timed_out) for name, o in zip(plan.verifiers, sample_outcomes))
        penalty = plan.overlong(sample.response_length)
        total = sum(w * p.score for w, p in zip(plan.weights, parts)) + penalty
        scored.append(SampleScore(total, parts, penalty))
    return scored
