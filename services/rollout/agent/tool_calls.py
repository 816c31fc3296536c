"""A model turn's text -> the tool calls it makes, in one of two formats (rollout.multi_turn.format).

`tag`: calls between configured tags around `{"name": ..., "arguments": {...}}` JSON, for models without tool
tokens (the tiny demo). `hermes`: vLLM's own hermes parser (`vllm.tool_parsers`), as vLLM's OpenAI server reads
Qwen and Hermes chat models' calls. A malformed call is part of the result, with its reason, never an exception:
the environment shows it to the model as an observation.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedTurn:
    """The tool calls of one model turn, in the order written."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()  # why each malformed call could not be read

    @property
    def has_calls(self) -> bool:
        """Whether the turn tried to call a tool (well-formed or not); a turn that did not is the final answer."""
        return bool(self.calls or self.errors)


def read_call(payload: str) -> ToolCall | str:
    """A call's JSON `{"name": str, "arguments": {...}}` as a ToolCall, or why it is malformed."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return 'expected {"name": "<tool>", "arguments": {...}}'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as the OpenAI API carries them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "arguments is a string that is not a JSON object"
    if not isinstance(arguments, dict):
        return f"arguments must be an object, got {type(arguments).__name__}"
    return ToolCall(data["name"], arguments)


def open_call(text: str, start: str, end: str) -> str:
    """The call `text` leaves open at its end (from its last `start` tag on, when no `end` follows), or "": what a
    prompt that prefills the opening of a call hands the model's first turn to finish."""
    at = text.rfind(start)
    return text[at:] if at >= 0 and text.find(end, at) < 0 else ""


class TagParser:
    """Calls between `start` and `end` tags; an opened tag never closed is a malformed call. A call's body is JSON
    `{"name": ..., "arguments": {...}}`, or with `argument` = (tool, argument name) the value of that one argument
    (rollout.multi_turn.tag_body argument: `<c>12*34</c>` calls the calculator on 12*34)."""

    def __init__(self, start: str, end: str, argument: tuple[str, str] | None = None):
        self.start, self.end, self.argument = start, end, argument

    def parse(self, text: str) -> ParsedTurn:
        """The calls written in `text`."""
        calls, errors = [], []
        at = text.find(self.start)
        while at >= 0:
            body = at + len(self.start)
            close = text.find(self.end, body)
            if close < 0:
                errors.append(f"{self.start} is not closed by {self.end}")
                break
            payload = text[body:close].strip()
            call = ToolCall(self.argument[0], {self.argument[1]: payload}) if self.argument else read_call(payload)
            (calls if isinstance(call, ToolCall) else errors).append(call)
            at = text.find(self.start, close + len(self.end))
        return ParsedTurn(tuple(calls), tuple(errors))


class _QuietWhileParsing(logging.Filter):
    """Drops the records vLLM's parser logs while an episode's turn is parsed on this thread: it logs a whole
    traceback for each call it cannot read, which the episode already counts and shows the model. Its records
    from anywhere else (vLLM's OpenAI server on the same replica) pass."""

    def __init__(self):
        super().__init__()
        self.threads: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return threading.get_ident() not in self.threads


_QUIET = _QuietWhileParsing()


class HermesParser:
    """vLLM's hermes tool parser (`ToolParserManager.get_tool_parser("hermes")`) over a whole turn.

    vLLM's parser returns "no tool called" for a turn whose call it cannot read; a turn that opens a call tag
    and yields no call is therefore reported as malformed here, so the model sees why."""

    def __init__(self, tokenizer):
        from vllm.tool_parsers import ToolParserManager

        self.parser = ToolParserManager.get_tool_parser("hermes")(tokenizer)
        self.start, self.end = self.parser.tool_call_start_token, self.parser.tool_call_end_token
        parser_log = logging.getLogger(type(self.parser).__module__)
        if _QUIET not in parser_log.filters:
            parser_log.addFilter(_QUIET)

    def parse(self, text: str) -> ParsedTurn:
        """The calls written in `text`."""
        # The hermes parser reads only the text (its request argument is for streaming and request tweaks).
        _QUIET.threads.add(threading.get_ident())
        try:
            info = self.parser.extract_tool_calls(text, request=None)
        finally:
            _QUIET.threads.discard(threading.get_ident())
        if not info.tools_called:
            opened = self.start in text
            return ParsedTurn(errors=(f"a {self.start} call that is not JSON with a name and arguments",) if opened else ())
        calls, errors = [], []
        for tc in info.tool_calls:
            call = read_call(json.dumps({"name": tc.function.name, "arguments": tc.function.arguments}))
            (calls if isinstance(call, ToolCall) else errors).append(call)
        return ParsedTurn(tuple(calls), tuple(errors))


def make_parser(fmt: str, start: str, end: str, tokenizer, argument: tuple[str, str] | None = None) -> TagParser | HermesParser:
    """The parser of rollout.multi_turn.format `fmt` (tag: between `start` and `end`, bodies JSON or, with `argument`
    = (tool, argument name), that argument's value; hermes: vLLM's, on `tokenizer`)."""
    return HermesParser(tokenizer) if fmt == "hermes" else TagParser(start, end, argument)
