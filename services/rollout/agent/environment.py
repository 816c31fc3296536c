"""The environment interface an episode runs against, and the registry of environments by name.

The shape is Gymnasium's (`reset` starts an episode, `step` takes an action and returns the observation, a
reward and whether the episode is done) as the `verifiers` library adapts it to multi-turn LLM episodes: the
action is the model's turn as text, the observation is text the episode appends to the context (its tokens
masked out of the loss). Both methods are async so that a slow environment (a tool call, a remote service)
waits without holding the replica's event loop, on which many episodes run at once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.common.config import MultiTurnConfig


@dataclass(frozen=True)
class Task:
    """What an episode starts from: its dataset row."""

    prompt: str  # the prompt's text (chat template applied), as the model sees it
    label: str  # the row's reference answer ("" when it has none)


@dataclass(frozen=True)
class StepResult:
    """What the environment returns for one model turn."""

    observation: str  # text appended after the turn (tool responses, the template's turn separators); "" when done
    reward: float = 0.0  # the environment's reward contribution for this turn
    done: bool = False  # True: the episode ends with this turn (the observation is not appended)
    info: dict[str, int] = field(default_factory=dict)  # counters of this step, summed over the episode (tool_calls, errors by kind)


class Environment(Protocol):
    """One episode's environment (a new instance per episode, so it may keep the episode's state)."""

    async def reset(self, task: Task) -> str | None:
        """Starts the episode; returns a first observation to append after the prompt, or None."""

    async def step(self, model_turn: str) -> StepResult:
        """Takes the model's turn (its decoded text) and answers it."""


# An environment factory builds one episode's environment from the run's multi-turn config and the model's
# tokenizer (a parser of a real chat model's tool calls needs it).
EnvironmentFactory = Callable[[MultiTurnConfig, object], Environment]

_REGISTRY: dict[str, EnvironmentFactory] = {}


class UnknownEnvironment(KeyError):
    """An environment name that nothing registered."""

    def __str__(self) -> str:
        return str(self.args[0])


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    """Registers `factory` under `name` (rollout.multi_turn.environment names it); a name is registered once."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = factory


def environment_factory(name: str) -> EnvironmentFactory:
    """The factory registered as `name`; raises UnknownEnvironment naming the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownEnvironment(f"rollout.multi_turn.environment: {name!r} is not a registered environment; "
                                 f"registered: {', '.join(sorted(_REGISTRY)) or 'none'}") from None
