"""The one record every service passes around: a prompt's sample and how far it got."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SampleStatus(str, enum.Enum):
    """Where a sample is in its life; only COMPLETED and TRUNCATED samples are trained on."""

    PENDING = "pending"  # waiting for (more) generation
    COMPLETED = "completed"  # ended with EOS or a stop string
    TRUNCATED = "truncated"  # hit rollout_max_tokens
    ABORTED = "aborted"  # stopped by an Abort or a partial-rollout budget; resumes later
    FAILED = "failed"  # the engine refused it; the message says why


@dataclass
class Sample:
    """One row of the dock: prompt, response so far, and the policy version of every token."""

    index: int  # row index in the dock; a group's n rows are contiguous
    group: int  # prompt index
    prompt_ids: list[int]  # [P]
    label: str = ""
    response_ids: list[int] = field(default_factory=list)  # [L]
    response_logprobs: list[float] = field(default_factory=list)  # [L], rollout engine's log p
    versions: list[int] = field(default_factory=list)  # [L], policy version per token
    status: SampleStatus = SampleStatus.PENDING
    age: int = 0  # partial-rollout splits so far
    reward: float | None = None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)
