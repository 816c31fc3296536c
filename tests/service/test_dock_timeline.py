"""The run's timeline against a real Redis: spans in the order written, the newest kept, a lost write never an error."""
import json

import pytest
import redis

from services.dock import timeline as timeline_module
from services.dock.timeline import Span, Timeline
from services.trainer.loop.run_log import draw_worker_timeline, write_trace
from tests.conftest import free_port

pytestmark = pytest.mark.service


@pytest.fixture
def timeline(dock_factory, redis_url):
    dock = dock_factory()  # only for its unique prefix and cleanup
    return Timeline(redis.Redis.from_url(redis_url), dock.keys)


def test_spans_come_back_in_order_and_only_the_newest_are_kept(timeline, monkeypatch):
    spans = [Span("rollout-a", "generate", 10.0 + i, 10.5 + i, 8) for i in range(5)]
    for span in spans:
        timeline.record(span)
    assert timeline.spans() == spans
    monkeypatch.setattr(timeline_module, "MAX_SPANS", 3)
    timeline.record(Span("trainer", "train", 20.0, 21.0, 32))
    assert timeline.spans() == [*spans[3:], Span("trainer", "train", 20.0, 21.0, 32)]


def test_a_span_redis_cannot_take_is_dropped_without_an_error(dock_factory):
    gone = Timeline(redis.Redis(port=free_port(), socket_connect_timeout=0.5), dock_factory().keys)
    gone.record(Span("reward-a", "score", 1.0, 2.0, 4))  # no Redis there: the worker goes on


def test_the_picture_has_the_trainer_then_rollout_then_reward_rows(tmp_path):
    spans = [Span("reward-b", "score", 3.0, 3.2, 4), Span("rollout-z", "generate", 1.0, 3.0, 8),
             Span("trainer", "wait", 1.0, 3.2), Span("trainer", "train", 3.2, 4.0), Span("trainer", "push", 4.0, 4.1),
             Span("rollout-a", "generate", 1.0, 2.5, 8), Span("reward-a", "score", 2.5, 2.6, 4)]
    rows = draw_worker_timeline(spans, tmp_path / "timeline.png")
    assert rows == ["trainer", "rollout-a", "rollout-z", "reward-a", "reward-b"]
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_the_trace_has_one_process_per_worker_and_one_event_per_span(tmp_path):
    spans = [Span("rollout-a", "generate", 1.0, 2.5, 8), Span("trainer", "wait", 1.0, 3.2),
             Span("reward-a", "score", 2.5, 2.6, 4), Span("trainer", "train", 3.2, 4.0, 128)]
    write_trace(spans, tmp_path / "timeline.trace.json")
    events = json.loads((tmp_path / "timeline.trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names[1] == "trainer" and sorted(names.values()) == ["reward-a", "rollout-a", "trainer"]
    work = [(names[e["pid"]], e["name"], e["ts"], e["dur"], e["args"]["rows"]) for e in events if e["ph"] == "X"]
    # microseconds, as Perfetto and chrome://tracing read them
    assert work == [("rollout-a", "generate", 1_000_000, 1_500_000, 8), ("trainer", "wait", 1_000_000, 2_200_000, 0),
                    ("reward-a", "score", 2_500_000, 100_000, 4), ("trainer", "train", 3_200_000, 800_000, 128)]
