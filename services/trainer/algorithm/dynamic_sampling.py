"""DAPO dynamic sampling: keep only groups whose metric varies, refilling from more batches."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def informative_groups(metric: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """Indexes of the groups (of n contiguous samples) whose metric has a non-zero std.

    A group where every sample scored the same gives zero advantage everywhere: no signal.
    """
    grouped = metric.float().view(-1, n_samples_per_prompt)
    std = grouped.std(dim=1) if n_samples_per_prompt > 1 else torch.zeros(grouped.size(0))
    return torch.nonzero(std > 0, as_tuple=False).flatten()


@dataclass
class DynamicSampler:
    """Accumulates informative groups over generation batches until `target_groups` are in hand.

    `add(metric)` takes one batch's per-sample metric [G*n] and keeps its informative groups;
    `done` once enough groups are kept or `max_batches` batches were seen (then training uses
    what it has, as DAPO's filter_groups_max_batches says); `max_batches` -1 sets no limit, as in MindSpeed-RL.
    """

    target_groups: int
    n_samples_per_prompt: int
    max_batches: int
    batches_seen: int = 0
    kept: list[tuple[int, int]] = field(default_factory=list)  # (batch index, group index)

    def add(self, metric: torch.Tensor) -> list[int]:
        """Keeps this batch's informative groups (up to the target); returns their group indexes."""
        if self.done:
            raise RuntimeError("DynamicSampler.add: already has its groups or reached max_batches")
        room = self.target_groups - len(self.kept)
        picked = informative_groups(metric, self.n_samples_per_prompt)[:room].tolist()
        self.kept.extend((self.batches_seen, g) for g in picked)
        self.batches_seen += 1
        return picked

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.target_groups or (self.max_batches != -1 and self.batches_seen >= self.max_batches)
