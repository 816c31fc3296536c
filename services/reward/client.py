"""A typed client of the Reward gRPC service (the CLI's `score --server` and the benchmark use it),
and the reward model of a split run as a rule replica reaches it: through a reward-model replica."""
from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Sequence

import grpc

from services.common.errors import InvalidArgument, Unavailable
from services.common.pb import reward_pb2, reward_pb2_grpc
from services.dock.registry import ReplicaRegistry
from services.reward.model import MODEL_VERIFIER
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

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> "RewardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteRewardModel:
    """The `reward_model` part for a rule replica's Score calls when the model runs on replicas of its
    own (reward_config.model_replicas > 0): each batch goes to a live `reward_model` replica from the
    registry. Same `encode` / `submit` contract as RewardModelScorer (what it encodes is the text)."""

    def __init__(self, registry: ReplicaRegistry, timeout_s: float = 600.0, threads: int = 4):
        self._registry = registry
        self._timeout_s = timeout_s
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="reward-model-remote")

    def encode(self, prompt: str, response: str, field: str) -> tuple[str, str]:
        """The sample as the remote replica takes it; it checks the tokens (and names the item) itself."""
        return prompt, response

    def submit(self, inputs: Sequence[tuple[str, str]]) -> concurrent.futures.Future:
        """Starts scoring `inputs` on a reward-model replica; the future gives one float per input, in order."""
        return self._executor.submit(self._score, list(inputs))

    def _score(self, inputs: list[tuple[str, str]]) -> list[float]:
        live = [r for r in self._registry.live("reward_model") if r.serves_grpc]
        if not live:
            raise Unavailable("no reward-model replica is registered to score the reward_model part (reward_config.model_replicas > 0)")
        address = random.choice(live).address  # spreads gRPC scoring over the model replicas
        with RewardClient(address, self._timeout_s) as client:
            try:
                results = client.score([ScoreInput(response, "", prompt=prompt) for prompt, response in inputs], [MODEL_VERIFIER], [1.0])
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    field, _, message = (exc.details() or "").partition(": ")
                    raise InvalidArgument(field, message) from None
                raise Unavailable(f"reward-model replica {address}: {exc.code().name}: {exc.details()}") from None
        return [r.total for r in results]

    def close(self) -> None:
        """Waits for the batches under way, then stops the threads."""
        self._executor.shutdown()

    def __enter__(self) -> "RemoteRewardModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
