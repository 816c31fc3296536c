"""The sandbox_fusion verifier through the reward service's verifier pool against a real sandbox server: programs
that pass every test, some, or none; pass-all against verl's continuous score; no code; a program past the limit."""
import json

import grpc
import pytest
from sandbox_harness import sandbox_server

from services.common.pb import reward_pb2, reward_pb2_grpc
from services.reward.code_tests import CodeSandbox
from services.reward.overlong import OverlongPenalty
from services.reward.pool import VerifierPool
from services.reward.scoring import ScoreInput, ScoringPlan, score_samples

pytestmark = pytest.mark.service

# sum of two numbers; 12 tests, so continuous reads the first 10
TESTS = json.dumps({"inputs": [f"{a} {a + 1}\n" for a in range(12)], "outputs": [f"{2 * a + 1}\n" for a in range(12)]})
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG_FROM_5 = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
PLAN = ScoringPlan.create(["sandbox_fusion"], [1.0], OverlongPenalty())
LOOPS = "```python\nwhile True:\n    pass\n```"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    # 3 s per program: a right program is never cut short on a loaded machine
    with sandbox_server(tmp_path_factory.mktemp("code-tests"), {"wall_s": 3.0, "workers": 4}) as (proc, target):
        yield target


@pytest.mark.parametrize("continuous, expected", [(False, [1.0, 0.0, 0.0, 0.0]), (True, [1.0, 0.5, 0.0, 0.0])])
def test_sandbox_fusion_scores_the_program_on_the_tests(sandbox, continuous, expected):
    responses = [RIGHT, WRONG_FROM_5, "the answer is print(a+b), no code block", RIGHT.replace("a + b", "a - b")]
    with VerifierPool(2, 60.0, CodeSandbox(sandbox, continuous=continuous)) as pool:
        scored = score_samples([ScoreInput(r, TESTS) for r in responses], PLAN, pool)
    assert [s.total for s in scored] == expected


def test_a_program_past_the_wall_limit_fails_its_tests(sandbox):
    with VerifierPool(1, 60.0, CodeSandbox(sandbox)) as pool:
        (scored,) = score_samples([ScoreInput(LOOPS, json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}))], PLAN, pool)
    assert scored.total == 0.0


def test_a_call_based_label_gets_the_timeout_score(sandbox):
    label = json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"})
    with VerifierPool(1, 60.0, CodeSandbox(sandbox)) as pool:
        (scored,) = score_samples([ScoreInput(RIGHT, label)], PLAN, pool)
    assert scored.total == 0.0 and scored.parts[0].name == "sandbox_fusion"


def test_a_reward_server_with_a_sandbox_lists_and_scores_the_code_verifier(sandbox):
    from services.common.config import config_from_dict
    from services.reward.client import RewardClient
    from services.reward.code_tests import code_sandbox
    from services.reward.server import start_server

    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": 2, "verifier_function": ["sandbox_fusion"], "verifier_weight": [1.0]},
                            "reward": {"sandbox_address": sandbox, "code_continuous": True}})
    with VerifierPool(1, 60.0, code_sandbox(cfg)) as pool:
        server = start_server(cfg, pool, "127.0.0.1", 0)
        try:
            with RewardClient(f"127.0.0.1:{server.port}") as client:
                right, half = client.score([ScoreInput(RIGHT, TESTS), ScoreInput(WRONG_FROM_5, TESTS)])
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                listed = {v.name for v in reward_pb2_grpc.RewardStub(channel).ListVerifiers(reward_pb2.ListVerifiersRequest()).verifiers}
        finally:
            server.stop()
    assert (right.total, half.total) == (1.0, 0.5) and "sandbox_fusion" in listed
