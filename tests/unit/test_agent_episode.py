"""The episode runner with a scripted generate function and the demo's byte-level tokenizer: the trajectory holds
exactly the sampled ids and the observations' ids encoded once, the mask is 1 exactly on model tokens (also where
decoding and re-encoding a turn would change its ids), and each limit ends an episode as specified."""
import asyncio

import pytest

from services.common.config import MultiTurnConfig
from services.rollout.agent.environment import StepResult, Task
from services.rollout.agent.episode import EpisodeLimits, run_episode
from services.rollout.agent.tool_environment import make_tool_environment
from services.rollout.engine import Completion

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
OBSERVATION = "\n<tool_response>42</tool_response>\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from services.common.tiny_model import build_tokenizer
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, "")
    return AutoTokenizer.from_pretrained(str(out))


def spelled(tok, text):
    """`text` as one byte token per character: what the model may sample, and not what encoding the text gives
    when it holds a special token's spelling."""
    return [tok.encode(ch, add_special_tokens=False)[0] for ch in text]


class Script:
    """A generate function that plays back turns (ids, finish reason), as the engine would return them: cut to
    the turn's max tokens with finish reason length; the i-th turn's log-probs -(i+1)/10, its version 10 + i."""

    def __init__(self, *turns):
        self.turns = list(turns)
        self.calls = []  # (the ids generated from, max new tokens)

    async def __call__(self, ids, max_new):
        self.calls.append((list(ids), max_new))
        i = len(self.calls) - 1
        ids, reason = self.turns[i]
        if len(ids) > max_new:
            ids, reason = ids[:max_new], "length"
        return Completion(token_ids=list(ids), logprobs=[-(i + 1) / 10] * len(ids), versions=[10 + i] * len(ids),
                          finish_reason=reason)


def tools_env(**keys):
    return make_tool_environment(MultiTurnConfig(environment="tools", **keys), None)


def limits(**keys):
    return EpisodeLimits(**{"max_assistant_turns": 5, "max_response_tokens": 512, "max_model_len": 4096, **keys})


def run(script, tok, env=None, prompt=(1, 2, 3), **limit_keys):
    return asyncio.run(run_episode(list(prompt), Task("prompt", "42"), env or tools_env(), script, tok, limits(**limit_keys)))


def test_the_trajectory_is_the_sampled_ids_and_the_observation_ids(tok):
    # The model's first turn ends with "<|im_end|>" spelled in byte tokens and a lone first byte of "é":
    # decoding it and encoding the text again would give the special token's one id and three bytes of U+FFFD.
    turn1 = tok.encode("I will use the tool. " + CALL, add_special_tokens=False) + spelled(tok, "<|im_end|>")
    turn1 += [tok.encode("é", add_special_tokens=False)[0]]
    turn2 = tok.encode("The answer is 42.", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.encode(tok.decode(turn1), add_special_tokens=False) != turn1  # the case is real
    obs = tok.encode(OBSERVATION, add_special_tokens=False)
    script = Script((turn1, "stop"), (turn2, "stop"))

    t = run(script, tok)

    assert t.response_ids == turn1 + obs + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert t.log_probs == [-0.1] * len(turn1) + [0.0] * len(obs) + [-0.2] * len(turn2)
    assert t.versions == [10] * len(turn1) + [10] * len(obs) + [11] * len(turn2)
    assert t.segments == [len(turn1), len(obs), len(turn2)]
    assert t.finish_reason == "stop" and t.reward == 0.0
    # each turn generated from all the ids so far, the earlier turns' exactly as sampled
    assert script.calls == [([1, 2, 3], 512), ([1, 2, 3] + turn1 + obs, 512 - len(turn1) - len(obs))]
    assert {k: v for k, v in t.counters.items() if k != "environment_s"} == {"turns": 2, "tool_calls": 1}
    assert t.counters["environment_s"] >= 0


def test_a_malformed_call_is_an_observation_and_the_episode_goes_on(tok):
    bad = tok.encode("<tool_call>{oops</tool_call>", add_special_tokens=False)
    final = tok.encode("done", add_special_tokens=False)
    t = run(Script((bad, "stop"), (final, "stop")), tok)
    obs = t.response_ids[len(bad):-len(final)]
    assert tok.decode(obs).startswith("\n<tool_response>error: malformed tool call: invalid JSON")
    assert t.finish_reason == "stop" and t.counters["malformed_call"] == 1 and t.counters["turns"] == 2


def test_the_turn_limit_ends_an_episode_still_calling_tools_with_length(tok):
    call = tok.encode(CALL, add_special_tokens=False)
    script = Script(*[(call, "stop")] * 5)
    t = run(script, tok, max_assistant_turns=2)
    obs = tok.encode(OBSERVATION, add_special_tokens=False)
    assert len(script.calls) == 2 and t.finish_reason == "length"
    assert t.response_ids == call + obs + call  # no observation after the last turn
    assert t.segments == [len(call), len(obs), len(call)] and t.counters["turns"] == 2


def test_the_response_budget_counts_model_and_environment_tokens(tok):
    call = tok.encode(CALL, add_special_tokens=False)
    obs = tok.encode(OBSERVATION, add_special_tokens=False)
    budget = len(call) + len(obs) + 5
    script = Script((call, "stop"), (call, "stop"))
    t = run(script, tok, max_response_tokens=budget)
    assert script.calls[1][1] == 5  # the second turn may take what the first turn and its observation left
    assert t.finish_reason == "length" and len(t.response_ids) == budget
    assert t.response_ids == call + obs + call[:5] and t.counters["turns"] == 2
    assert "tool_calls" in t.counters and t.counters["tool_calls"] == 1  # the cut turn never reached the environment


def test_the_context_bounds_the_budget(tok):
    script = Script((list(range(40, 140)), "stop"))
    t = run(script, tok, prompt=list(range(30)), max_model_len=50)
    assert script.calls == [(list(range(30)), 20)]
    assert t.finish_reason == "length" and len(t.response_ids) == 20


def test_an_observation_that_leaves_no_room_ends_the_episode(tok):
    call = tok.encode(CALL, add_special_tokens=False)
    obs = tok.encode(OBSERVATION, add_special_tokens=False)
    script = Script((call, "stop"), (call, "stop"))
    t = run(script, tok, max_response_tokens=len(call) + len(obs))
    assert len(script.calls) == 1 and t.response_ids == call and t.finish_reason == "length"


def test_the_per_turn_limit_cuts_a_turn_which_the_environment_still_reads(tok):
    call = tok.encode(CALL, add_special_tokens=False)
    final = tok.encode("ok", add_special_tokens=False)
    script = Script((call, "stop"), (final, "stop"))
    t = run(script, tok, max_tokens_per_turn=20)
    assert [m for _, m in script.calls] == [20, 20]
    assert t.response_ids[:20] == call[:20]
    assert tok.decode(t.response_ids[20:-len(final)]).startswith("\n<tool_response>error: malformed tool call: <tool_call> is not closed")
    assert t.finish_reason == "stop" and t.counters["malformed_call"] == 1


def test_the_observation_limit_cuts_its_ids(tok):
    call = tok.encode(CALL, add_special_tokens=False)
    final = tok.encode("ok", add_special_tokens=False)
    t = run(Script((call, "stop"), (final, "stop")), tok, max_observation_tokens=7)
    assert t.response_ids == call + tok.encode(OBSERVATION, add_special_tokens=False)[:7] + final
    assert t.segments == [len(call), 7, len(final)] and t.counters["observations_cut"] == 1


def test_an_aborted_turn_ends_the_episode_as_the_engine_ended_it(tok):
    call = tok.encode(CALL, add_special_tokens=False)
    t = run(Script((call[:4], "abort")), tok)
    assert t.finish_reason == "abort" and t.response_ids == call[:4] and t.loss_mask == [1] * 4


class Counting:
    """An environment with a first observation that answers every turn with its count, done after two."""

    def __init__(self):
        self.turns = []

    async def reset(self, task):
        return f"task {task.label}:"

    async def step(self, model_turn):
        self.turns.append(model_turn)
        return StepResult(f"[{len(self.turns)}]", 0.5, len(self.turns) == 2, {"steps": 1})


def test_a_first_observation_and_the_environments_reward(tok):
    env = Counting()
    first, a, b = (tok.encode(s, add_special_tokens=False) for s in ("task 42:", "a", "b"))
    t = run(Script((a, "stop"), (b, "length")), tok, env=env)
    assert t.response_ids == first + a + tok.encode("[1]", add_special_tokens=False) + b
    assert t.loss_mask == [0] * len(first) + [1] + [0] * 3 + [1]
    assert t.versions == [10] * len(first) + [10] + [10] * 3 + [11]  # a first observation: the first turn's version
    assert env.turns == ["a", "b"] and t.reward == 1.0 and t.finish_reason == "length"
    assert t.counters["steps"] == 2 and t.counters["turns"] == 2
