"""The code verifier's parsing: the program a response holds, and the tests an APPS / TACO label holds; the config's
refusal of sandbox_fusion without a sandbox."""
import json

import pytest

from services.common.config import ConfigError, load_config
from services.reward.code_tests import extract_code, parse_tests


def test_the_last_fenced_block_is_the_program():
    response = "First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\nand ```\n```"
    assert extract_code(response) == "print(2)\n"
    assert extract_code("```\nx = input()\n```") == "x = input()\n"
    assert extract_code("print(3) with no fence") is None


def test_an_apps_label_gives_its_inputs_and_outputs_and_taco_line_lists_are_joined():
    assert parse_tests(json.dumps({"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", ["7"]]})) == (["1 2\n", "3\n4"], ["3\n", "7"])


@pytest.mark.parametrize("label, message", [
    ('{"inputs": ["1"], "outputs": ["1"], "fn_name": "solve"}', "call-based tests"),
    ('{"inputs": ["1", "2"], "outputs": ["1"]}', "same, non-zero length"),
    ('{"inputs": [], "outputs": []}', "same, non-zero length"),
    ('[1, 2]', "not a JSON object"),
])
def test_a_label_that_is_not_stdin_stdout_tests_is_refused(label, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(label)


def test_sandbox_fusion_without_an_address_takes_the_runs_own_sandbox_at_a_fixed_port():
    with pytest.raises(ConfigError, match=r"reward\.sandbox_address: empty, so the run's own sandbox replicas .* sandbox\.grpc_port is 0"):
        load_config(overrides=["rl_config.verifier_function=[sandbox_fusion]", "rl_config.verifier_weight=[1.0]",
                               "sandbox.grpc_port=0"])
    cfg = load_config(overrides=["rl_config.verifier_function=[sandbox_fusion]", "rl_config.verifier_weight=[1.0]",
                                 "reward.sandbox_address=127.0.0.1:50091"])
    assert cfg.reward.sandbox_address == "127.0.0.1:50091"
