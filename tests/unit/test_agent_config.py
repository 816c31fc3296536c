"""rollout.multi_turn: its keys (verl's names where verl has them), their checks, and what is off by default."""
import pytest

from services.common.config import ConfigError
from services.common.config import config_from_dict as _config

N = {"rl_config": {"n_samples_per_prompt": 2}}  # group_norm's groups need two samples


def config_from_dict(data):
    return _config({**N, **data})


def test_multi_turn_is_off_by_default():
    mtc = config_from_dict({}).rollout.multi_turn
    assert mtc.environment == "" and mtc.format == "tag" and mtc.tools == ("calculator",)
    assert (mtc.tool_call_start, mtc.tool_call_end) == ("<tool_call>", "</tool_call>")


def test_the_section_reads_its_keys():
    cfg = config_from_dict({"rollout": {"multi_turn": {
        "environment": "tools", "format": "hermes", "max_assistant_turns": 3, "max_tokens_per_turn": 64,
        "max_observation_tokens": 32, "tool_timeout_s": 2, "tools": "calculator"}}})
    mtc = cfg.rollout.multi_turn
    assert (mtc.format, mtc.max_assistant_turns, mtc.max_tokens_per_turn, mtc.max_observation_tokens) == ("hermes", 3, 64, 32)
    assert mtc.tool_timeout_s == 2.0 and mtc.tools == ("calculator",)


@pytest.mark.parametrize("keys, message", [
    ({"format": "json"}, "rollout.multi_turn.format: 'json' is not one of tag, hermes"),
    ({"max_assistant_turns": 0}, "rollout.multi_turn.max_assistant_turns: must be > 0"),
    ({"tool_timeout_s": 0}, "rollout.multi_turn.tool_timeout_s: must be > 0"),
    ({"max_turns": 3}, "rollout.multi_turn.max_turns: unknown key"),
    ({"environment": "tools", "tool_call_end": "<tool_call>"}, "rollout.multi_turn.tool_call_start: the tag format needs two different"),
    ({"environment": "tools", "tool_call_start": ""}, "the tag format needs two different non-empty tags"),
    ({"environment": "tools", "max_tokens_per_turn": 4096}, "rollout.multi_turn.max_tokens_per_turn: 4096 > generate_config"),
])
def test_bad_keys_are_refused_with_the_key(keys, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"rollout": {"multi_turn": keys}})


def test_partial_rollout_is_refused_with_episodes():
    with pytest.raises(ConfigError, match="rl_config.partial_rollout_max_split: 2 > 1 with rollout.multi_turn.environment "
                                          "'tools': partial rollout of multi-turn episodes is not built yet"):
        config_from_dict({"rl_config": {"n_samples_per_prompt": 2, "partial_rollout_max_split": 2},
                          "rollout": {"multi_turn": {"environment": "tools"}}})


def test_the_cross_key_checks_wait_for_an_environment():
    config_from_dict({"rollout": {"multi_turn": {"tool_call_start": "", "max_tokens_per_turn": 4096}}})
