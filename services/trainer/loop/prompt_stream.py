"""The order prompts enter the dock: seeded epochs, a cursor that a checkpoint carries."""
from __future__ import annotations

import random
from dataclasses import dataclass

from services.common.preprocess import PromptRecord


@dataclass
class PromptStreamState:
    """Where the stream is: prompts handed out so far (over all epochs)."""

    cursor: int = 0


class PromptStream:
    """Hands out prompts in epochs; each epoch is a seeded shuffle (index order when `shuffle` is off).

    The same seed and cursor give the same prompts in the same order, so a resumed run sees the
    data an uninterrupted run would have seen.
    """

    def __init__(self, records: list[PromptRecord], seed: int, shuffle: bool = True):
        if not records:
            raise ValueError("megatron_training.data_path: the dataset has no prompts")
        self._records = records
        self._seed = seed
        self._shuffle = shuffle
        self.state = PromptStreamState()

    @classmethod
    def from_config(cls, records: list[PromptRecord], cfg) -> "PromptStream":
        """The run's stream: seeded by megatron_training.seed, in file order under no_shuffle or guarantee_order."""
        in_order = cfg.megatron_training.no_shuffle or cfg.rl_config.guarantee_order
        return cls(records, cfg.megatron_training.seed, shuffle=not in_order)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[PromptRecord]:
        """The next `count` prompts, continuing into the next epoch when one runs out."""
        out = []
        while len(out) < count:
            epoch, pos = divmod(self.state.cursor, len(self._records))
            out.append(self._records[self._order(epoch)[pos]])
            self.state.cursor += 1
        return out
