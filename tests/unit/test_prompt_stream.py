"""Prompt order: seeded epochs, and a cursor that resumes where it stopped; prompts over the limit left out."""
from services.common.preprocess import PromptRecord
import pytest

from services.trainer.loop.prompt_stream import PromptStream

RECORDS = [PromptRecord(i, f"p{i}", [i], str(i)) for i in range(10)]


def test_epochs_cover_every_prompt_and_resume_is_identical():
    stream = PromptStream(RECORDS, seed=7)
    first = [r.index for r in stream.take(10)]
    assert sorted(first) == list(range(10)) and first != list(range(10))
    second = [r.index for r in stream.take(10)]
    assert sorted(second) == list(range(10)) and second != first

    uninterrupted = PromptStream(RECORDS, seed=7)
    expected = [r.index for r in uninterrupted.take(13)] + [r.index for r in uninterrupted.take(9)]
    resumed = PromptStream(RECORDS, seed=7)
    head = [r.index for r in resumed.take(13)]
    restarted = PromptStream(RECORDS, seed=7)
    restarted.state.cursor = resumed.state.cursor
    assert head + [r.index for r in restarted.take(9)] == expected


def test_index_order_without_shuffle():
    assert [r.index for r in PromptStream(RECORDS, seed=0, shuffle=False).take(12)] == list(range(10)) + [0, 1]


@pytest.mark.parametrize("key", ["megatron_training.no_shuffle", "rl_config.guarantee_order"])
def test_the_run_config_keeps_file_order_under_no_shuffle_or_guarantee_order(key):
    from services.common.config import load_config

    shuffled = PromptStream.from_config(RECORDS, load_config(None))
    assert [r.index for r in shuffled.take(10)] != list(range(10))
    in_order = PromptStream.from_config(RECORDS, load_config(None, [f"{key}=true"]))
    assert [r.index for r in in_order.take(10)] == list(range(10))
