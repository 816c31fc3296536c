"""Tools the model may call: a name, a description and a JSON schema of its arguments (the OpenAI tool format),
and an async call bounded by a timeout; the calculator, the code interpreter, and the tools by name.

Model-written code never runs here: the calculator reads arithmetic with `ast` and evaluates only numbers and
the operators it lists, refusing anything else; the code interpreter sends the code to the sandbox service
(services/sandbox, docs/sandbox.md), whose replica runs it isolated and answers with what it printed.
"""
from __future__ import annotations

import ast
import asyncio
import math
import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from services.common.sandbox_client import ExecResult, ExecStatus, Program, SandboxClient


class ToolError(Exception):
    """A tool's refusal of its arguments; the message is what the model sees."""


@dataclass(frozen=True)
class Tool:
    """One callable tool."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    run: Callable[[dict], Awaitable[str]]  # the arguments -> the result's text; raises ToolError to refuse them

    @property
    def schema(self) -> dict:
        """The tool in the OpenAI tool format (what a chat template's `tools` takes)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def call(self, arguments: dict, timeout_s: float) -> str:
        """The result of one call; raises TimeoutError past `timeout_s`, ToolError (or whatever the tool raises)."""
        return await asyncio.wait_for(self.run(arguments), timeout_s)


# ---------------------------------------------------------------- the calculator

MAX_EXPRESSION_CHARS = 200  # bounds the parse's work on a model's runaway argument
MAX_EXPONENT = 64  # `**` with a larger exponent is refused: 9**9**9 would take the replica's CPU for minutes
MAX_MAGNITUDE = 10 ** 100  # larger intermediate results are refused, for the same reason

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses, unary minus; raises ToolError
    for anything else (names, calls, attributes, strings, ...) or a result too large to compute cheaply."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is an int subclass: refused
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
        if isinstance(result, complex):  # (-8) ** 0.5
            raise ToolError("the result is not a real number")
        if abs(result) > MAX_MAGNITUDE or (isinstance(result, float) and not math.isfinite(result)):
            raise ToolError("result too large")
        return result
    raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def format_number(value: int | float) -> str:
    """A result as the model reads it: an integral value without a fraction (6/3 is 2)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


async def _calculate(arguments: dict) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ToolError('arguments must be {"expression": "<arithmetic>"}')
    return format_number(evaluate(expression))


CALCULATOR = Tool(
    name="calculator",
    description="Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression, e.g. (12 + 7) * 3"}},
                "required": ["expression"]},
    run=_calculate,
)

# ---------------------------------------------------------------- the code interpreter

CODE_OUTPUT_CHARS = 1000  # of stdout and of stderr the model reads; a longer output keeps its end (where errors are)


class _SandboxConnection:
    """This process's client of the sandbox the code interpreter runs programs on (`connect_sandbox`)."""

    client: SandboxClient | None = None
    wall_s: float = 0.0


_SANDBOX = _SandboxConnection()


def connect_sandbox(address: str, token: str, wall_s: float) -> None:
    """Points the code interpreter at the sandbox replica `address` (rollout.multi_turn.sandbox_address); each
    program may run `wall_s` seconds there (the tool's timeout, so no program outlives its call)."""
    if _SANDBOX.client is not None:
        _SANDBOX.client.close()
    _SANDBOX.client, _SANDBOX.wall_s = SandboxClient(address, token, timeout_s=wall_s + 30.0), wall_s


def code_result_text(result: ExecResult) -> str:
    """What the model reads of a program's run: its stdout, then its stderr when it wrote any, each cut to its last
    CODE_OUTPUT_CHARS; a run that did not end ok is named first (timeout, memory, ...) with the sandbox's reason."""
    parts = [] if result.status is ExecStatus.OK else [f"{result.status.value}: {result.reason}"]
    for name, data, truncated in (("stdout", result.stdout, result.stdout_truncated), ("stderr", result.stderr, result.stderr_truncated)):
        text = data.decode(errors="replace").rstrip("\n")
        if len(text) > CODE_OUTPUT_CHARS or truncated:
            text = f"[{name} cut to its last {CODE_OUTPUT_CHARS} characters]\n" + text[-CODE_OUTPUT_CHARS:]
        if text:
            parts.append(text if name == "stdout" else f"stderr:\n{text}")
    return "\n".join(parts)


async def _run_code(arguments: dict) -> str:
    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        raise ToolError('arguments must be {"code": "<python source>"}')
    if _SANDBOX.client is None:
        raise ToolError("no sandbox to run code in (rollout.multi_turn.sandbox_address)")
    try:
        result = await asyncio.to_thread(_SANDBOX.client.execute, Program(code, wall_s=_SANDBOX.wall_s))
    except grpc.RpcError as exc:  # busy (RESOURCE_EXHAUSTED) or gone (UNAVAILABLE): the model reads it, the run goes on
        raise ToolError(f"the sandbox refused the program: {exc.code().name}: {exc.details()}") from None
    return code_result_text(result)


CODE_INTERPRETER = Tool(
    name="code_interpreter",  # MindSpeed-RL's ReTool and verl's name for it
    description="Runs a Python program in an isolated sandbox (no network, no files kept) and returns what it printed.",
    parameters={"type": "object",
                "properties": {"code": {"type": "string", "description": "the Python source; print what you need to read"}},
                "required": ["code"]},
    run=_run_code,
)

TOOLS: dict[str, Tool] = {CALCULATOR.name: CALCULATOR, CODE_INTERPRETER.name: CODE_INTERPRETER}


def tools_by_name(names: tuple[str, ...] | list[str]) -> dict[str, Tool]:
    """The tools `names` lists (rollout.multi_turn.tools); raises ValueError naming an unknown one and the known."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"rollout.multi_turn.tools: {', '.join(map(repr, unknown))} is not a tool; "
                         f"the tools: {', '.join(sorted(TOOLS))}")
    return {n: TOOLS[n] for n in names}
