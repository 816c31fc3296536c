"""The driver's side of the dock: an iteration's prompts in, its scored groups out.

The trainer puts GBS prompts (n rows each) into the free group slots, then claims complete,
scored groups as the `actor_train` consumer until it holds GBS of them. Rollout and reward
workers do everything in between, pulling from the dock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import Unavailable
from services.common.preprocess import PromptRecord
from services.dock.client import Claim, Dock

TRAIN_CONSUMER = "actor_train"
TRAIN_COLUMNS = ("prompts", "responses", "rm_scores", "rollout_log_probs", "versions")


@dataclass
class ScoredBatch:
    """GBS complete groups, rows in group order: every list has B = groups * n entries."""

    indexes: list[int]
    prompts: list[list[int]]  # [B][P]
    responses: list[list[int]]  # [B][L]
    scores: list[float]  # [B]
    rollout_logprobs: list[list[float]]  # [B][L]
    versions: list[list[int]]  # [B][L], policy version per token
    claims: list[Claim] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.indexes)

    def extend(self, claim: Claim) -> None:
        """Adds a claim's rows, sorted by index so groups stay contiguous."""
        order = sorted(range(len(claim.indexes)), key=claim.indexes.__getitem__)
        cols = claim.columns
        for i in order:
            self.indexes.append(claim.indexes[i])
            self.prompts.append(np.asarray(cols["prompts"][i]).astype(int).tolist())
            self.responses.append(np.asarray(cols["responses"][i]).astype(int).tolist())
            self.scores.append(float(np.asarray(cols["rm_scores"][i]).reshape(-1)[0]))
            self.rollout_logprobs.append(np.asarray(cols["rollout_log_probs"][i], dtype=np.float64).tolist())
            self.versions.append(np.asarray(cols["versions"][i]).astype(int).tolist())
        self.claims.append(claim)

    @classmethod
    def empty(cls) -> "ScoredBatch":
        return cls([], [], [], [], [], [])


def put_prompts(dock: Dock, groups: list[int], prompts: list[PromptRecord]) -> list[int]:
    """Writes each prompt into the n rows of its group slot; returns the rows written."""
    n = dock.layout.n_samples_per_prompt
    rows = dock.rows_of(groups)
    expanded = [p for p in prompts for _ in range(n)]
    dock.put(rows, {
        "prompts": [np.asarray(p.prompt_ids, dtype=np.int32) for p in expanded],
        "prompt_length": [len(p.prompt_ids) for p in expanded],
        "labels": [p.label for p in expanded],
    })
    return rows


def collect_scored_groups(dock: Dock, rows_wanted: int, timeout_s: float, on_wait=None) -> ScoredBatch:
    """Claims complete, scored groups until `rows_wanted` rows are held; raises Unavailable on timeout.

    `on_wait(seconds_waited)` is called about once a second while nothing new arrives (progress logs).
    """
    batch = ScoredBatch.empty()
    n = dock.layout.n_samples_per_prompt
    start = last_note = time.monotonic()
    while len(batch) < rows_wanted:
        claim = dock.claim(TRAIN_CONSUMER, TRAIN_COLUMNS, count=rows_wanted - len(batch), group=True, min_count=n, timeout_s=1.0)
        if claim is not None:
            batch.extend(claim)
            continue
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise Unavailable(
                f"no scored groups for {waited:.0f} s ({len(batch)} of {rows_wanted} rows): are rollout and reward workers "
                f"running against this dock? ({dock.stats()})"
            )
        if on_wait is not None and time.monotonic() - last_note >= 1.0:
            on_wait(waited)
            last_note = time.monotonic()
    return batch


def ack_batch(dock: Dock, batch: ScoredBatch) -> None:
    """Tells the dock the trainer is done with every row of `batch` (they leave at the next begin_iteration)."""
    for claim in batch.claims:
        dock.ack(claim.lease, claim.indexes)
