"""DAPO's overlong reward shaping: a linear penalty over the last `overlong_buffer` tokens of the budget."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.config import RLConfig


@dataclass(frozen=True)
class OverlongPenalty:
    """`expected = rollout_max_tokens - overlong_buffer`; a response longer than `expected` loses
    `(length - expected) / overlong_buffer * factor`, at most `factor` (the excess is capped at the buffer)."""

    enabled: bool = False
    buffer: int = 0
    factor: float = 1.0
    rollout_max_tokens: int = 2048

    @classmethod
    def from_rl_config(cls, rl: RLConfig) -> "OverlongPenalty":
        """The penalty the run's rl_config asks for (overlong_buffer_enable, overlong_buffer, ...)."""
        return cls(rl.overlong_buffer_enable, rl.overlong_buffer, rl.overlong_buffer_penalty_factor, rl.rollout_max_tokens)

    @property
    def expected_length(self) -> int:
        """Tokens a response may use before the penalty starts."""
        return self.rollout_max_tokens - self.buffer

    def __call__(self, response_length: int) -> float:
        """The penalty (<= 0) for a response of `response_length` tokens; 0 when disabled."""
        if not self.enabled or self.buffer <= 0:
            return 0.0
        excess = min(response_length - self.expected_length, self.buffer)
        return min(-excess / self.buffer * self.factor, 0.0)
