"""The code verifier: a response's last code block run on a task's stdin/stdout tests in the sandbox service.

The label is the task's tests as the public code-RL sets write them (APPS / TACO `input_output`): JSON with
`inputs` and `outputs`, lists of strings. A test passes when the program ends ok and its stdout equals the
expected output up to trailing newlines (verl's comparison). `sandbox_fusion` (verl's name) scores 1.0 when every
test passes, else 0.0; with reward.code_continuous, verl's `continuous`: the fraction of the first 10 tests passed.
Call-based tests (`fn_name`) are not supported yet: such a label gets the verifier's timeout score.

The verifier runs in the reward pool's worker processes; `configure` gives each the sandbox to call (the pool
passes it at start), since a verifier itself sees only (response, label).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from services.common.sandbox_client import ExecStatus, Program, SandboxClient

CODE_VERIFIER = "sandbox_fusion"  # its name in the verifier registry
CONTINUOUS_TESTS = 10  # verl's continuous score reads the first 10 tests
BATCH = 8  # tests sent per ExecuteBatch: well under a sandbox replica's default workers + queue
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeSandbox:
    """Where the code verifier runs programs, and how it scores."""

    address: str  # host:port of a sandbox replica (reward.sandbox_address)
    token: str = ""  # the shared token, when the sandbox requires it
    continuous: bool = False  # reward.code_continuous


_SANDBOX: CodeSandbox | None = None


def configure(sandbox: CodeSandbox | None) -> None:
    """Sets the sandbox this process's code verifier calls (None: the verifier refuses to run)."""
    global _SANDBOX
    _SANDBOX = sandbox


def code_sandbox(cfg) -> CodeSandbox | None:
    """The config's sandbox for the code verifier, with the shared token: reward.sandbox_address, else the run's own
    replica (sandbox.address) when rl_config lists the verifier; None when neither."""
    from services.common.auth import resolve_token

    address = cfg.reward.sandbox_address or (cfg.sandbox.address() if CODE_VERIFIER in cfg.rl_config.verifier_function else "")
    if not address:
        return None
    return CodeSandbox(address, resolve_token(cfg.auth), cfg.reward.code_continuous)


def extract_code(response: str) -> str | None:
    """The last fenced code block of the response (```python, ```py or a bare fence), or None."""
    blocks = [b for b in _CODE_BLOCK.findall(response) if b.strip()]
    return blocks[-1] if blocks else None


def parse_tests(label: str) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of an APPS / TACO `input_output` label; ValueError for anything else."""
    tests = json.loads(label)
    if not isinstance(tests, dict):
        raise ValueError("the label is not a JSON object with inputs and outputs")
    if tests.get("fn_name"):
        raise ValueError("call-based tests (fn_name) are not supported")
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("inputs and outputs must be lists of the same, non-zero length")
    return [_text(x) for x in inputs], [_text(x) for x in outputs]


def _text(value) -> str:
    # TACO writes some tests as lists of lines
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def score_sandbox_fusion(response: str, label: str) -> float:
    """1.0 when the response's program passes every test (continuous: the fraction of the first 10 passed), else 0.0;
    a response without a code block scores 0.0."""
    if _SANDBOX is None:
        raise RuntimeError("the code verifier has no sandbox: set reward.sandbox_address")
    inputs, outputs = parse_tests(label)
    code = extract_code(response)
    if code is None:
        return 0.0
    if _SANDBOX.continuous:
        inputs, outputs = inputs[:CONTINUOUS_TESTS], outputs[:CONTINUOUS_TESTS]
    passed = 0
    with SandboxClient(_SANDBOX.address, _SANDBOX.token) as client:
        for start in range(0, len(inputs), BATCH):
            results = client.execute_batch([Program(code, stdin.encode()) for stdin in inputs[start:start + BATCH]])
            passed += sum(r.status is ExecStatus.OK and r.stdout.decode(errors="replace").rstrip("\n") == expected.rstrip("\n")
                          for r, expected in zip(results, outputs[start:start + BATCH]))
            if passed < start + len(results) and not _SANDBOX.continuous:
                return 0.0  # one failure decides pass-all: the rest need not run
    return passed / len(inputs) if _SANDBOX.continuous else float(passed == len(inputs))
