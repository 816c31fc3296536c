"""The agent demo's warm start: its episodes are the rollout's own tokens, its teacher's share of calls shows in
the model, and its config keys are checked."""
import asyncio
import json

import pytest

from services.common.arithmetic_data import arithmetic_problems
from services.common.config import ArithmeticConfig, ConfigError, InitModelConfig, config_from_dict
from services.common.tiny_model import build_tiny_model
from services.common.warm_start import ToolTeacher, WarmStartSpec, _segments, warm_start
from services.launch.prepare import prepare_run
from services.reward.verifiers import run_verifier
from services.rollout.agent.tool_environment import make_tool_environment

N = {"rl_config": {"n_samples_per_prompt": 2}}
JSON_CALL = '<c>{"name":"calculator","arguments":{"expression":"47*86"}}</c>'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model(out, InitModelConfig(), prompt_type="empty")
    from transformers import AutoTokenizer

    return out, AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("tag_body, written", [("json", JSON_CALL), ("argument", "<c>47*86</c>")])
def test_a_tool_target_is_the_episode_the_rollout_runs(tiny, tag_body, written):
    _, tok = tiny
    problem = {"problem": "47*86=", "answer": "4042"}
    teacher = ToolTeacher(share=1.0, start="<c>", end="</c>", body=tag_body)
    (call, trained_call), (obs, trained_obs), (answer, trained_answer) = _segments(tok, problem, "tool", teacher)
    assert (trained_call, trained_obs, trained_answer) == (True, False, True)
    assert tok.decode(call) == written
    # The rollout's tools environment (of the config the demo runs) reads the call, runs the calculator and
    # appends exactly these tokens.
    cfg = config_from_dict({**N, "rollout": {"multi_turn": {"environment": "tools", "tool_call_start": "<c>",
                                                            "tool_call_end": "</c>", "tag_body": tag_body}}})
    env = make_tool_environment(cfg.rollout.multi_turn, tok)
    result = asyncio.run(env.step(tok.decode(call)))
    assert result.info == {"tool_calls": 1} and not result.done
    assert tok.encode(result.observation, add_special_tokens=False) == obs
    assert tok.decode(obs) == "\n<tool_response>4042</tool_response>\n"
    # The answer turn is what the reward pays, and ends the episode.
    assert answer[-1] == tok.eos_token_id
    assert run_verifier("math_17k_acc", tok.decode(answer[:-1]), "4042") == 1.0
    assert asyncio.run(env.step(tok.decode(answer[:-1]))).done
    assert _segments(tok, problem, "boxed", teacher) == [(tok.encode("\\boxed{4042}", add_special_tokens=False) + [tok.eos_token_id], True)]


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_the_teachers_share_of_calls_is_what_the_model_learns(tmp_path, share):
    model = tmp_path / "model"
    build_tiny_model(model, InitModelConfig(), prompt_type="empty")
    problems = arithmetic_problems(ArithmeticConfig(min_operand=10, max_operand=14, ops=("*",))).all
    spec = WarmStartSpec(target_accuracy=1.0, max_steps=40, eval_every=40, batch_size=16, lr=3e-3,
                         tool=ToolTeacher(share, "<c>", "</c>", "argument"))
    result = warm_start(model, problems, spec)
    if share:
        assert result.call_probability > 0.7 and result.greedy_calls == 1.0, result
    else:
        assert result.call_probability < 0.05 and result.greedy_calls == 0.0, result


def test_operands_from_min_operand():
    problems = arithmetic_problems(ArithmeticConfig(min_operand=10, max_operand=99, ops=("*",), test_fraction=0.01)).all
    assert len(problems) == 90 * 90
    assert {p["problem"] for p in problems} == {f"{a}*{b}=" for a in range(10, 100) for b in range(10, 100)}


@pytest.mark.parametrize("data, message", [
    ({"init_model": {"warm_start_tool_share": 0.4}, "arithmetic": {}},
     r"init_model\.warm_start_tool_share: 0\.4 needs rollout\.multi_turn\.environment 'tools' with format 'tag'"),
    ({"init_model": {"warm_start_tool_share": 0.4}, "rollout": {"multi_turn": {"environment": "tools"}}},
     r"init_model\.warm_start_tool_share: 0\.4 needs an arithmetic section"),
    ({"init_model": {"warm_start_tool_share": 1.5}}, r"init_model\.warm_start_tool_share: must be in \[0, 1\], got 1\.5"),
    ({"arithmetic": {"min_operand": 12, "max_operand": 9}}, r"arithmetic\.min_operand: 12 > max_operand 9"),
    ({"rollout": {"multi_turn": {"environment": "tools", "tag_body": "argument", "format": "hermes"}}},
     r"rollout\.multi_turn\.tag_body: 'argument' names no tool, so it needs format 'tag' and exactly one tool"),
])
def test_refusals(data, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**N, **data})


def test_prepare_warm_starts_with_the_tool_teacher_of_the_config(tmp_path):
    cfg = config_from_dict({
        **N,
        "megatron_training": {"load": str(tmp_path / "model"), "tokenizer_name_or_path": str(tmp_path / "model"),
                              "data_path": str(tmp_path / "data/train")},
        "rollout": {"multi_turn": {"environment": "tools", "tool_call_start": "<c>", "tool_call_end": "</c>"}},
        "init_model": {"warm_start_accuracy": 0.9, "warm_start_max_steps": 2, "warm_start_tool_share": 0.5},
        "arithmetic": {"out_dir": str(tmp_path / "raw"), "min_operand": 10, "max_operand": 12, "ops": ["*"]},
    })
    done = prepare_run(cfg)
    assert "greedy calls" in done[-1] and "episodes made to call right" in done[-1], done
    marker = json.loads((tmp_path / "model/warm_start.json").read_text())
    assert {"greedy_calls", "call_probability", "call_answered"} <= set(marker)
