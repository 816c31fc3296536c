"""The run's timeline in Redis: when each worker (rollout replica, reward replica, trainer) worked on
what, as spans on one list, for the picture a run draws at its end.

Telemetry, not data: a span that cannot be written is dropped with a debug line, never an error
for the worker. The list keeps the newest MAX_SPANS spans. Times are wall clocks (time.time()), so
spans of services on different machines line up only as well as their clocks agree.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

import redis

from services.dock.schema import Keys

MAX_SPANS = 20_000
logger = logging.getLogger("dockrl.dock")


@dataclass(frozen=True)
class Span:
    """`worker` (a replica id, or "trainer") spent [start, end] (s since the epoch) on `stage` over `rows` rows."""

    worker: str
    stage: str  # generate | score | wait | train | push
    start: float
    end: float
    rows: int = 0


class Timeline:
    """The spans of one run (key `<run base>timeline`, in the run's Redis Cluster slot)."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.client = client
        self.key = keys.base + "timeline"

    def record(self, span: Span) -> None:
        """Appends `span` (the oldest spans go past MAX_SPANS)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.rpush(self.key, json.dumps(asdict(span)))
            pipe.ltrim(self.key, -MAX_SPANS, -1)
            pipe.execute()
        except redis.RedisError as exc:
            logger.debug("timeline span dropped: %s", exc)

    def spans(self) -> list[Span]:
        """Every span kept, in the order written."""
        return [Span(**json.loads(raw)) for raw in self.client.lrange(self.key, 0, -1)]
