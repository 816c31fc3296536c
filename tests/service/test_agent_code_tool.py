"""The agent's code_interpreter tool against a real sandbox server on loopback: the model's Python runs there, never
in the rollout replica, and what it printed, its error or its limit comes back as the observation; a refused or
unreachable sandbox is an error the model reads, counted, and the episode goes on."""
import asyncio
import json

import pytest

from sandbox_harness import sandbox_server

from services.common.config import ConfigError, MultiTurnConfig, config_from_dict
from services.common.sandbox_client import ExecResult, ExecStatus
from services.rollout.agent.tool_environment import TOOL_ERROR, TOOL_TIMEOUT, make_tool_environment
from services.rollout.agent.tools import CODE_OUTPUT_CHARS, code_result_text, connect_sandbox

pytestmark = pytest.mark.service

CALL = "<tool_call>{}</tool_call>"


def _call(code: str) -> str:
    return CALL.format(json.dumps({"name": "code_interpreter", "arguments": {"code": code}}))


def _step(env, turn: str):
    return asyncio.run(env.step(turn))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with sandbox_server(tmp_path_factory.mktemp("sandbox")) as (_, address):
        mtc = MultiTurnConfig(environment="tools", tools=("code_interpreter",), sandbox_address=address, tool_timeout_s=3.0)
        connect_sandbox(address, "", mtc.tool_timeout_s)
        yield make_tool_environment(mtc, None)


def test_the_models_program_runs_in_the_sandbox_and_its_output_is_the_observation(env):
    result = _step(env, "Let me compute. " + _call("import os\nprint(6 * 7, os.getuid(), sorted(os.environ))"))
    assert result.observation == "\n<tool_response>42 65534 ['HOME', 'LANG', 'PATH', 'PWD']</tool_response>\n"
    assert not result.done and result.info == {"tool_calls": 1}


def test_an_error_a_limit_and_no_network_are_what_the_model_reads(env):
    error = _step(env, _call("print('before')\n1 / 0"))
    assert error.observation.startswith("\n<tool_response>runtime_error: exit status 1\nbefore\nstderr:\nTraceback")
    assert "ZeroDivisionError: division by zero" in error.observation and error.info == {"tool_calls": 1}
    network = _step(env, _call("import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=1)"))
    assert "runtime_error" in network.observation and "ConnectionRefusedError" in network.observation  # Redis listens on the host
    looping = _step(env, _call("while True: pass"))
    # the tool's timeout and the sandbox's wall limit are the same seconds: whichever ends it first, the model reads it
    assert looping.info.get(TOOL_TIMEOUT) == 1 or "<tool_response>timeout:" in looping.observation, looping
    again = _step(env, _call("print('still serving')"))
    assert again.observation == "\n<tool_response>still serving</tool_response>\n"


def test_a_long_output_keeps_its_end_where_the_error_is():
    long = ExecResult(ExecStatus.OK, "", 0, b"x" * 5000 + b"END", b"", False, False, 1.0)
    text = code_result_text(long)
    assert text.startswith(f"[stdout cut to its last {CODE_OUTPUT_CHARS} characters]\n") and text.endswith("xEND")
    assert len(text) < CODE_OUTPUT_CHARS + 60


def test_an_unreachable_sandbox_is_a_tool_error_the_model_reads(tmp_path):
    mtc = MultiTurnConfig(environment="tools", tools=("code_interpreter",), sandbox_address="127.0.0.1:9", tool_timeout_s=3.0)
    connect_sandbox(mtc.sandbox_address, "", mtc.tool_timeout_s)
    result = _step(make_tool_environment(mtc, None), _call("print(1)"))
    assert result.info == {"tool_calls": 1, TOOL_ERROR: 1}
    assert "the sandbox refused the program: UNAVAILABLE" in result.observation


def test_without_an_address_the_tool_needs_the_runs_sandbox_at_a_fixed_port():
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.sandbox_address: empty, so the run's own sandbox replicas"):
        config_from_dict({"rollout": {"multi_turn": {"environment": "tools", "tools": ["code_interpreter"]}},
                          "sandbox": {"grpc_port": 0}})
