"""The environment registry and the tools environment's observation for each fault, each counted by kind."""
import asyncio

import pytest

from services.common.config import MultiTurnConfig
from services.rollout.agent.environment import (StepResult, Task, UnknownEnvironment, environment_factory,
                                                register_environment)
from services.rollout.agent.tool_calls import TagParser
from services.rollout.agent.tool_environment import ToolEnvironment, make_tool_environment
from services.rollout.agent.tools import CALCULATOR, TOOLS, Tool


async def _raises(arguments):
    raise RuntimeError("disk on fire")


async def _sleeps(arguments):
    await asyncio.sleep(10)
    return "never"


RAISING = Tool("raising", "raises", {"type": "object", "properties": {}}, _raises)
SLOW = Tool("slow", "sleeps", {"type": "object", "properties": {}}, _sleeps)


def _env(**extra):
    tools = {"calculator": CALCULATOR, **extra}
    return ToolEnvironment(tools, TagParser("<tool_call>", "</tool_call>"), 0.05, "tag")


def _step(env, text) -> StepResult:
    return asyncio.run(env.step(text))


def test_tools_is_registered_and_an_unknown_name_lists_the_known():
    assert environment_factory("tools") is make_tool_environment
    with pytest.raises(UnknownEnvironment, match="'chess' is not a registered environment; registered: .*tools"):
        environment_factory("chess")


def test_a_name_is_registered_once():
    register_environment("tools", make_tool_environment)  # the same factory again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_environment("tools", lambda cfg, tok: None)


def test_the_configured_environment_is_built_from_its_section():
    env = make_tool_environment(MultiTurnConfig(environment="tools", tool_call_start="[[", tool_call_end="]]"), None)
    assert asyncio.run(env.reset(Task("prompt", "3"))) is None
    result = _step(env, '[[{"name": "calculator", "arguments": {"expression": "1+2"}}]]')
    assert result.observation == "\n<tool_response>3</tool_response>\n"


def test_a_turn_without_a_call_ends_the_episode():
    assert _step(_env(), "The answer is 42.") == StepResult("", 0.0, True, {})


def test_each_call_is_answered_in_order():
    result = _step(_env(), 'x <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
                           '<tool_call>{"name": "calculator", "arguments": {"expression": "2**5"}}</tool_call>')
    assert result == StepResult("\n<tool_response>42</tool_response><tool_response>32</tool_response>\n", 0.0, False,
                                {"tool_calls": 2})


@pytest.mark.parametrize("call, response, kind", [
    ('{"name": "calculator", "arguments": {"expression": "1+"', "error: malformed tool call: invalid JSON", "malformed_call"),
    ('{"name": "search", "arguments": {}}', "error: unknown tool 'search'; the tools: calculator, raising, slow", "unknown_tool"),
    ('{"name": "calculator", "arguments": {"expression": "1/0"}}', "error: calculator: division by zero", "tool_error"),
    ('{"name": "calculator", "arguments": {"expression": "open(1)"}}', "error: calculator: only numbers", "tool_error"),
    ('{"name": "raising", "arguments": {}}', "error: raising failed: RuntimeError: disk on fire", "tool_error"),
    ('{"name": "slow", "arguments": {}}', "error: slow timed out after 0.05 s", "tool_timeout"),
])
def test_each_fault_is_an_observation_and_is_counted(call, response, kind):
    result = _step(_env(raising=RAISING, slow=SLOW), f"<tool_call>{call}</tool_call>")
    assert not result.done and result.reward == 0.0
    assert result.observation.startswith("\n<tool_response>" + response)
    assert result.observation.endswith("</tool_response>\n")
    assert result.info == {"tool_calls": 1, kind: 1}


def test_faults_and_results_mix_in_one_turn():
    result = _step(_env(), '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
                           '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad</tool_call>')
    assert result.observation == ("\n<tool_response>error: malformed tool call: invalid JSON (Expecting property name "
                                  "enclosed in double quotes at character 1)</tool_response><tool_response>4</tool_response>"
                                  "<tool_response>error: unknown tool 'nope'; the tools: calculator</tool_response>\n")
    assert result.info == {"tool_calls": 3, "malformed_call": 1, "unknown_tool": 1}


def test_the_hermes_format_answers_in_a_chatml_turn(tmp_path):
    from transformers import AutoTokenizer

    from services.common.tiny_model import build_tokenizer
    build_tokenizer(tmp_path, "")
    env = make_tool_environment(MultiTurnConfig(environment="tools", format="hermes"), AutoTokenizer.from_pretrained(str(tmp_path)))
    result = _step(env, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*3"}}\n</tool_call><|im_end|>')
    assert result.observation == "\n<|im_start|>user\n<tool_response>9</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_prompt_that_opens_a_call_has_the_first_turn_finish_it():
    env = _env()
    asyncio.run(env.reset(Task('Use the tool. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}', "")))
    assert _step(env, "</tool_call>").observation == "\n<tool_response>42</tool_response>\n"
    assert _step(env, "</tool_call>").done  # the prefill belongs to the first turn only
    asyncio.run(env.reset(Task("<tool_call>", "")))
    assert _step(env, "oops").info == {"tool_calls": 1, "malformed_call": 1}
    asyncio.run(env.reset(Task('<tool_call>{"name": "calculator", "arguments": {}}</tool_call> closed', "")))
    assert _step(env, "The answer.").done


def test_a_bare_tag_body_is_the_one_tools_argument():
    # rollout.multi_turn.tag_body argument: <c>12*34</c> calls the calculator on 12*34 (the tiny agent demo's form).
    env = make_tool_environment(MultiTurnConfig(environment="tools", tool_call_start="<c>", tool_call_end="</c>",
                                                tag_body="argument"), tokenizer=None)
    assert _step(env, "<c>12*34</c>") == StepResult("\n<tool_response>408</tool_response>\n", 0.0, False, {"tool_calls": 1})
    result = _step(env, "<c>12*x</c>")  # a body the tool refuses is its error, counted as such
    assert result.observation.startswith("\n<tool_response>error: calculator: ") and result.info == {"tool_calls": 1, "tool_error": 1}
    assert _step(env, r"\boxed{408}").done


def test_a_bare_tag_body_needs_a_tool_with_one_required_argument(monkeypatch):
    two = Tool("two", "two required", {"type": "object", "required": ["a", "b"]}, _raises)
    monkeypatch.setitem(TOOLS, "two", two)
    with pytest.raises(ValueError, match=r"rollout\.multi_turn\.tag_body: 'argument' needs a tool with one required "
                                         r"argument; two requires \['a', 'b'\]"):
        make_tool_environment(MultiTurnConfig(environment="tools", tools=("two",), tag_body="argument"), tokenizer=None)
