"""How a rollout row ended: the values of the dock's `finish_reason` column, written by rollout
workers with each row's response and read by the trainer."""
from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    """Why a row's generation ended; only a FAILED row's group is dropped (counted, never trained)."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # the response budget (rl_config.rollout_max_tokens, or a partial-rollout split's share)
    ABORT = "abort"  # ended by an Abort (a drain, or a request the server cancelled); resumes or is regenerated
    FAILED = "failed"  # the engine refused the row (e.g. a prompt past its context); the replica's log says why
