"""The calculator (its results and refusals) and both tool-call formats, the malformed cases included."""
import asyncio
import json
import pathlib

import pytest

from services.rollout.agent.tool_calls import HermesParser, TagParser, ToolCall
from services.rollout.agent.tools import CALCULATOR, ToolError, evaluate, format_number, tools_by_name


@pytest.mark.parametrize("expression, value", [
    ("1 + 2", 3), ("(12 + 7) * 3", 57), ("-4 * -(2 + 1)", 12), ("7 / 2", 3.5), ("7 // 2", 3), ("7 % 4", 3),
    ("2 ** 10", 1024), ("2 ** -1", 0.5), ("1.5 * 4", 6.0), ("123456789 * 987654321", 121932631112635269),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "not Call"), ("x + 1", "not Name"), ("'a' * 3", "not Constant"),
    ("True + 1", "not Constant"), ("abs(-1)", "not Call"), ("1 if 1 else 2", "not IfExp"), ("[1, 2]", "not List"),
    ("1 < 2", "not Compare"), ("(1).real", "not Attribute"), ("1 / 0", "division by zero"), ("5 % 0", "division by zero"),
    ("9 ** 9 ** 9", "exponent 387420489 is larger than 64"), ("10 ** 60 * 10 ** 60", "result too large"),
    ("(-8) ** 0.5", "not a real number"), ("1 +", "not an arithmetic expression"), ("1" * 201, "longer than 200"),
    ("lambda: 1", "not Lambda"), ("~1", "not UnaryOp"), ("1 << 2", "not BinOp"),
])
def test_the_calculator_refuses_anything_but_arithmetic(expression, reason):
    with pytest.raises(ToolError, match=reason):
        evaluate(expression)


def test_results_read_as_numbers():
    assert format_number(6 / 3) == "2" and format_number(3.5) == "3.5" and format_number(-7) == "-7"


def test_the_calculator_tool_schema_and_call():
    assert CALCULATOR.schema == {"type": "function", "function": {
        "name": "calculator", "description": CALCULATOR.description, "parameters": CALCULATOR.parameters}}
    assert CALCULATOR.parameters["required"] == ["expression"]
    assert asyncio.run(CALCULATOR.call({"expression": "6 * 7"}, 1.0)) == "42"
    with pytest.raises(ToolError, match="arguments must be"):
        asyncio.run(CALCULATOR.call({"expr": "1"}, 1.0))


def test_unknown_tool_names_are_refused_with_the_known():
    assert list(tools_by_name(["calculator"])) == ["calculator"]
    with pytest.raises(ValueError, match="'python' is not a tool; the tools: calculator"):
        tools_by_name(["calculator", "python"])


def _call(name="calculator", **arguments):
    return json.dumps({"name": name, "arguments": arguments})


def test_the_tag_format_reads_calls_in_order():
    parser = TagParser("<tool_call>", "</tool_call>")
    text = f"Let me see. <tool_call>{_call(expression='1+2')}</tool_call> and <tool_call> {_call('other', a=1)} </tool_call>"
    parsed = parser.parse(text)
    assert parsed.calls == (ToolCall("calculator", {"expression": "1+2"}), ToolCall("other", {"a": 1}))
    assert parsed.errors == () and parsed.has_calls
    assert not parser.parse("The answer is 3.").has_calls


def test_the_tag_format_uses_its_configured_tags():
    parser = TagParser("[[", "]]")
    assert parser.parse(f"[[{_call(expression='2')}]]").calls == (ToolCall("calculator", {"expression": "2"}),)
    assert not parser.parse(f"<tool_call>{_call()}</tool_call>").has_calls


@pytest.mark.parametrize("body, reason", [
    ('{"name": "calculator", "arguments": {"expression": "1+2"', "invalid JSON"),
    ("not json", "invalid JSON"),
    ('["calculator"]', 'expected {"name"'),
    ('{"arguments": {}}', 'expected {"name"'),
    ('{"name": "calculator", "arguments": [1]}', "arguments must be an object, got list"),
    ('{"name": "calculator", "arguments": "{oops"}', "arguments is a string that is not a JSON object"),
])
def test_a_malformed_tag_call_is_a_parse_error_not_an_exception(body, reason):
    parsed = TagParser("<tool_call>", "</tool_call>").parse(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == () and len(parsed.errors) == 1 and reason in parsed.errors[0] and parsed.has_calls


def test_an_unclosed_tag_and_string_arguments():
    parser = TagParser("<tool_call>", "</tool_call>")
    parsed = parser.parse(f"<tool_call>{_call(expression='1')}</tool_call><tool_call>{_call()}")
    assert parsed.calls == (ToolCall("calculator", {"expression": "1"}),)
    assert parsed.errors == ("<tool_call> is not closed by </tool_call>",)
    as_string = '{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}'
    assert parser.parse(f"<tool_call>{as_string}</tool_call>").calls == (ToolCall("calculator", {"expression": "3"}),)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from services.common.tiny_model import build_tokenizer
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(pathlib.Path(out), "")
    return AutoTokenizer.from_pretrained(str(out))


def test_the_hermes_format_is_vllms_parser(tokenizer):
    parser = HermesParser(tokenizer)
    assert type(parser.parser).__module__ == "vllm.tool_parsers.hermes_tool_parser"
    text = f"I will compute.\n<tool_call>\n{_call(expression='2*3')}\n</tool_call>\n<tool_call>{_call('x', k='v')}</tool_call>"
    parsed = parser.parse(text)
    assert parsed.calls == (ToolCall("calculator", {"expression": "2*3"}), ToolCall("x", {"k": "v"}))
    assert parsed.errors == ()
    assert not parser.parse("The answer is 6.").has_calls


@pytest.mark.parametrize("body", ['{"name": "calculator", "arguments": {"expression": ', '{"arguments": {}}', "[]"])
def test_a_malformed_hermes_call_is_a_parse_error(tokenizer, body):
    parsed = HermesParser(tokenizer).parse(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == () and parsed.has_calls
    assert parsed.errors == ("a <tool_call> call that is not JSON with a name and arguments",)


def test_a_malformed_call_in_an_episode_logs_no_traceback_but_vllms_own_parsing_still_does(tokenizer):
    import logging

    parser = HermesParser(tokenizer)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    vllm_log = logging.getLogger(type(parser.parser).__module__)
    vllm_log.addHandler(handler)
    try:
        assert parser.parse("<tool_call>[]</tool_call>").errors  # counted and shown to the model: no traceback in the log
        assert records == []
        parser.parser.extract_tool_calls("<tool_call>[]</tool_call>", request=None)  # as vLLM's OpenAI server calls it
        assert [r.levelname for r in records] == ["ERROR"] and records[0].exc_info
    finally:
        vllm_log.removeHandler(handler)
