"""The "tools" environment: each model turn's tool calls are answered with the tools' results; a turn without a
call is the final answer and ends the episode. A prompt may end inside an opened call (a prefill that makes the
model call a tool): the first turn is then read as that call's continuation.

Nothing the model writes ends a run: a malformed call, an unknown tool, a tool that refuses its arguments or
raises, and a call past its timeout each become an error in the observation, which the model reads next turn,
and are counted by kind in the step's info. The environment's reward is 0: the reward service scores the final
answer as it scores a single-turn response.
"""
from __future__ import annotations

from collections import Counter

from services.common.config import MultiTurnConfig
from services.common.tool_text import observation_text
from services.rollout.agent.environment import StepResult, Task, register_environment
from services.rollout.agent.tool_calls import HermesParser, TagParser, ToolCall, make_parser, open_call
from services.rollout.agent.tools import Tool, ToolError, tools_by_name

# The kinds of error a step counts (info keys), one per way a call can fail.
MALFORMED, UNKNOWN_TOOL, TOOL_ERROR, TOOL_TIMEOUT = "malformed_call", "unknown_tool", "tool_error", "tool_timeout"
ERROR_KINDS = (MALFORMED, UNKNOWN_TOOL, TOOL_ERROR, TOOL_TIMEOUT)


class ToolEnvironment:
    """One episode's tool environment."""

    def __init__(self, tools: dict[str, Tool], parser: TagParser | HermesParser, timeout_s: float, fmt: str):
        self.tools, self.parser, self.timeout_s = tools, parser, timeout_s
        self.fmt = fmt
        self.prefill = ""  # the call the prompt leaves open, read before the first turn

    async def reset(self, task: Task) -> None:
        """No first observation: the prompt already offers the tools."""
        self.prefill = open_call(task.prompt, self.parser.start, self.parser.end)
        return None

    async def step(self, model_turn: str) -> StepResult:
        """The tools' responses to the turn's calls, in order; done when the turn calls none."""
        parsed = self.parser.parse(self.prefill + model_turn)
        self.prefill = ""
        if not parsed.has_calls:
            return StepResult("", 0.0, True)
        counts: Counter[str] = Counter(tool_calls=len(parsed.calls) + len(parsed.errors), **{MALFORMED: len(parsed.errors)})
        responses = [f"error: malformed tool call: {reason}" for reason in parsed.errors]
        for call in parsed.calls:
            text, error = await self._answer(call)
            responses.append(text)
            counts[error] += 1
        counts.pop("", None)  # the calls answered without error
        # the wrap's separators are tokenized once with the responses and never re-rendered
        return StepResult(observation_text(responses, self.fmt), 0.0, False, dict(+counts))  # + drops the kinds counted 0

    async def _answer(self, call: ToolCall) -> tuple[str, str]:
        """(the response to one call, the kind of error it is or "")."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools: {', '.join(sorted(self.tools))}", UNKNOWN_TOOL
        try:
            return await tool.call(call.arguments, self.timeout_s), ""
        except TimeoutError:
            return f"error: {call.name} timed out after {self.timeout_s:g} s", TOOL_TIMEOUT
        except ToolError as exc:
            return f"error: {call.name}: {exc}", TOOL_ERROR
        except Exception as exc:  # a tool's own bug must not end the run: the model sees it, the count shows it
            return f"error: {call.name} failed: {type(exc).__name__}: {exc}", TOOL_ERROR


def make_tool_environment(cfg: MultiTurnConfig, tokenizer) -> ToolEnvironment:
    """The tools environment of rollout.multi_turn `cfg`."""
    tools = tools_by_name(cfg.tools)
    parser = make_parser(cfg.format, cfg.tool_call_start, cfg.tool_call_end, tokenizer,
                         _bare_argument(tools) if cfg.tag_body == "argument" else None)
    return ToolEnvironment(tools, parser, cfg.tool_timeout_s, cfg.format)


def _bare_argument(tools: dict[str, Tool]) -> tuple[str, str]:
    """(tool, argument) a bare tag body fills: the one required argument of the one tool (config checks the one)."""
    (tool,) = tools.values()
    required = tool.parameters.get("required", [])
    if len(required) != 1:
        raise ValueError(f"rollout.multi_turn.tag_body: 'argument' needs a tool with one required argument; {tool.name} "
                         f"requires {required}; use tag_body 'json'")
    return tool.name, required[0]


register_environment("tools", make_tool_environment)
