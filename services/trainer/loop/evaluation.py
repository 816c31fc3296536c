"""Held-out accuracy: greedy generation on a rollout replica, scored by the reward service.

Both calls go through the services' gRPC contracts, so the figure is what a user calling the
deployed system would measure.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from services.common.auth import bearer_metadata
from services.common.pb import reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.common.preprocess import PromptRecord


@dataclass(frozen=True)
class EvalResult:
    """Share of held-out prompts answered correctly, and the mean response length."""

    accuracy: float
    mean_response_length: float
    count: int


def evaluate(rollout_address: str, reward_address: str, records: list[PromptRecord], max_tokens: int,
             token: str = "", concurrency: int = 16, timeout_s: float = 120.0) -> EvalResult:
    """Greedy-decodes every record on `rollout_address` and scores it on `reward_address`."""
    metadata = bearer_metadata(token)
    with grpc.insecure_channel(rollout_address) as rch, grpc.insecure_channel(reward_address) as wch:
        rollout = rollout_pb2_grpc.RolloutStub(rch)
        reward = reward_pb2_grpc.RewardStub(wch)

        def generate(record: PromptRecord) -> rollout_pb2.Completion:
            request = rollout_pb2.GenerateRequest(
                token_ids=rollout_pb2.TokenIds(ids=record.prompt_ids),
                sampling=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1, logprobs=0),
            )
            return rollout.Generate(request, timeout=timeout_s, metadata=metadata).completions[0]

        with ThreadPoolExecutor(concurrency) as pool:
            completions = list(pool.map(generate, records))
        items = [reward_pb2.ScoreItem(response=c.text, response_token_ids=list(c.token_ids), label=r.label,
                                      response_length=len(c.token_ids), prompt=r.prompt)
                 for c, r in zip(completions, records)]
        scores = reward.Score(reward_pb2.ScoreRequest(items=items), timeout=timeout_s, metadata=metadata).results
    correct = sum(1 for s in scores if s.score > 0)
    return EvalResult(correct / len(records), sum(len(c.token_ids) for c in completions) / len(records), len(records))
