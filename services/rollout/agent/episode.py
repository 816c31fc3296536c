"""One episode, run token-exact: the trajectory the trainer trains on holds the model's tokens exactly as sampled.

Each turn generates from ALL the episode's ids so far (the prompt's, then every turn's), so nothing earlier is
re-rendered or re-tokenized. A model turn is decoded only to be read by the environment; its ids, log-probs and
versions are kept as the engine returned them. An observation is encoded once (no special tokens added) and
appended with loss mask 0. The generate function is passed in (in a replica: its engine), so this logic runs
without one in the unit tests.

Limits (EpisodeLimits): model turns; tokens after the prompt, model and environment together (the trainer's
response length), and the context; tokens per model turn; tokens per observation (cut to it). An episode that
runs out of budget or context, or whose last allowed turn still calls a tool, ends with finish reason `length`.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from services.common.sample import FinishReason
from services.rollout.agent.environment import Environment, Task
from services.rollout.engine import Completion

# generate(all ids so far, max new tokens) -> the turn as sampled: token ids, log-probs, versions, finish reason
Generate = Callable[[Sequence[int], int], Awaitable[Completion]]


@dataclass(frozen=True)
class EpisodeLimits:
    """How far one episode may run (rollout.multi_turn, and the rollout budget and context)."""

    max_assistant_turns: int  # model turns
    max_response_tokens: int  # tokens after the prompt, model and environment (generate_config.sampling_config.max_tokens)
    max_model_len: int  # prompt + response tokens the engine accepts
    max_tokens_per_turn: int = 0  # tokens of one model turn; 0: the rest of the budget
    max_observation_tokens: int = 0  # tokens of one observation (cut to it); 0: no cut


@dataclass
class Trajectory:
    """One episode's tokens after the prompt, turn after turn, and what happened in it."""

    response_ids: list[int]  # [L] model and environment tokens in order
    loss_mask: list[int]  # [L] 1: a model token (trained), 0: an environment token
    log_probs: list[float]  # [L] the engine's log p of each model token; 0.0 on environment tokens
    versions: list[int]  # [L] the policy version of each model token; an environment token: its turn's before
    segments: list[int]  # [S] lengths of the runs of model and environment tokens, in order (sum: L)
    finish_reason: str  # a FinishReason value
    reward: float  # the environment's reward, summed over the turns
    counters: dict[str, float]  # turns, tool_calls, each error kind, observations_cut, environment_s


class _Builder:
    """The trajectory as it grows; observation versions are filled once the model tokens around them are known."""

    def __init__(self):
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[int | None] = []
        self.segments: list[int] = []

    def add(self, ids: Sequence[int], model: bool, log_probs: Sequence[float] = (), versions: Sequence[int] = ()) -> None:
        if not ids:
            return
        if self.segments and self.mask[-1] == int(model):
            self.segments[-1] += len(ids)
        else:
            self.segments.append(len(ids))
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.log_probs += list(log_probs) if model else [0.0] * len(ids)
        self.versions += list(versions) if model else [None] * len(ids)

    def versions_filled(self) -> list[int]:
        """Each environment token's version: the model token's before it (the first model token's for a first
        observation; 0 when there is no model token at all). Masked out, it only keeps the column's shape."""
        known = [v for v in self.versions if v is not None]
        last = known[0] if known else 0
        filled = []
        for v in self.versions:
            last = last if v is None else v
            filled.append(last)
        return filled


async def run_episode(prompt_ids: Sequence[int], task: Task, env: Environment, generate: Generate, tokenizer,
                      limits: EpisodeLimits) -> Trajectory:
    """Runs one episode of `env` from `prompt_ids`; `tokenizer` decodes model turns and encodes observations."""
    out = _Builder()
    counts: Counter[str] = Counter()
    reward, finish = 0.0, FinishReason.LENGTH.value
    budget = min(limits.max_response_tokens, limits.max_model_len - len(prompt_ids))

    first = await _timed(counts, env.reset(task))
    if first and not _observe(out, first, tokenizer, limits, budget, counts):
        return _trajectory(out, finish, reward, counts)
    for turn in range(limits.max_assistant_turns):
        room = budget - len(out.ids)
        if room <= 0:
            break  # the budget or the context ran out: finish reason length
        max_new = min(room, limits.max_tokens_per_turn or room)
        sampled = await generate([*prompt_ids, *out.ids], max_new)
        out.add(sampled.token_ids, True, sampled.logprobs, sampled.versions)
        counts["turns"] += 1
        if sampled.finish_reason not in (FinishReason.STOP.value, FinishReason.LENGTH.value):
            finish = sampled.finish_reason  # aborted or failed in the engine: the episode ends as the turn did
            break
        if sampled.finish_reason == FinishReason.LENGTH.value and len(sampled.token_ids) >= room:
            break  # the budget or the context ran out mid-turn
        result = await _timed(counts, env.step(tokenizer.decode(sampled.token_ids, skip_special_tokens=False)))
        reward += result.reward
        counts.update(result.info)
        if result.done:
            finish = sampled.finish_reason
            break
        if turn + 1 == limits.max_assistant_turns:
            break  # still calling tools after the last allowed turn: length, without an observation nobody reads
        if not _observe(out, result.observation, tokenizer, limits, budget, counts):
            break
    return _trajectory(out, finish, reward, counts)


async def _timed(counts: Counter, awaitable: Awaitable):
    """Awaits an environment call, adding its seconds to counts["environment_s"]."""
    start = time.perf_counter()
    try:
        return await awaitable
    finally:
        counts["environment_s"] += time.perf_counter() - start


def _observe(out: _Builder, text: str, tokenizer, limits: EpisodeLimits, budget: int, counts: Counter) -> bool:
    """Appends an observation, encoded once; False when it does not fit the budget (the episode ends: length)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if limits.max_observation_tokens and len(ids) > limits.max_observation_tokens:
        ids = ids[:limits.max_observation_tokens]
        counts["observations_cut"] += 1
    if len(out.ids) + len(ids) >= budget:  # no room left for the model to answer it
        return False
    out.add(ids, False)
    return True


def _trajectory(out: _Builder, finish: str, reward: float, counts: Counter) -> Trajectory:
    return Trajectory(out.ids, out.mask, out.log_probs, out.versions_filled(), out.segments, finish, reward,
                      dict(counts))
