"""A typed client of the Reward gRPC service (the CLI's `score --server` and the benchmark use it)."""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.pb import reward_pb2, reward_pb2_grpc
from services.reward.scoring import PartScore, SampleScore, ScoreInput


class RewardClient:
    """Scores through a running reward server at `target` ("host:port")."""

    def __init__(self, target: str, timeout_s: float = 600.0):
        self._channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
        self._stub = reward_pb2_grpc.RewardStub(self._channel)
        self._timeout_s = timeout_s

    def score(self, samples: Sequence[ScoreInput], verifiers: Sequence[str] = (), weights: Sequence[float] = ()) -> list[SampleScore]:
        """Per-sample scores; empty `verifiers` uses the server's rl_config.verifier_function."""
        request = reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreItem(response=s.response, label=s.label, response_length=s.response_length, prompt=s.prompt)
                   for s in samples],
            verifier_function=list(verifiers),
            verifier_weight=list(weights),
        )
        response = self._stub.Score(request, timeout=self._timeout_s)
        return [
            SampleScore(r.score, tuple(PartScore(p.name, p.score, p.timed_out) for p in r.parts), r.overlong_penalty)
            for r in response.results
        ]

    def list_verifiers(self) -> list[reward_pb2.VerifierInfo]:
        """The verifiers the server knows, with descriptions and timeout scores."""
        return list(self._stub.ListVerifiers(reward_pb2.ListVerifiersRequest(), timeout=self._timeout_s).verifiers)

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> "RewardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
