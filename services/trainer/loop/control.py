"""The trainer's shared run state and control back-edges, used by the driver and the gRPC service.

The iteration driver records each step here, holds `step_lock` while a step runs, and calls
`wait_while_paused()` between iterations; the gRPC Trainer service reads the state and asks for
pauses and checkpoints. A checkpoint asked over gRPC waits for the running step to end, so it
never captures a half-updated model.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

RUN_STATES = ("starting", "rollout", "train", "push", "paused", "done", "failed")

# Saves a checkpoint to a directory ("" = the configured one); returns (path written, step).
CheckpointHandler = Callable[[str], tuple[str, int]]


@dataclass(frozen=True)
class StatusSnapshot:
    """What Status answers."""

    step: int
    version: int
    state: str
    paused: bool
    metrics: dict[str, float]
    train_iters: int


@dataclass
class TrainerControl:
    """Thread-safe run state; `checkpoint_handler` is set by whoever owns the model."""

    train_iters: int
    checkpoint_handler: CheckpointHandler | None = None
    step_lock: threading.Lock = field(default_factory=threading.Lock)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _resumed: threading.Event = field(default_factory=threading.Event)
    _step: int = 0
    _version: int = 0
    _state: str = "starting"
    _metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._resumed.set()

    def set_state(self, state: str) -> None:
        """Moves the run to `state` (one of RUN_STATES)."""
        if state not in RUN_STATES:
            raise ValueError(f"state: {state!r} is not one of {', '.join(RUN_STATES)}")
        with self._lock:
            self._state = state

    def record_step(self, step: int, metrics: dict[str, float], version: int | None = None) -> None:
        """Publishes a finished step's counters and metrics."""
        with self._lock:
            self._step = step
            self._metrics = dict(metrics)
            if version is not None:
                self._version = version

    def pause(self) -> None:
        """The driver stops at its next wait_while_paused()."""
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def wait_while_paused(self, timeout_s: float | None = None) -> bool:
        """Blocks while paused (state 'paused' meanwhile); returns False if still paused after timeout_s."""
        if not self.paused:
            return True
        with self._lock:
            previous, self._state = self._state, "paused"
        resumed = self._resumed.wait(timeout_s)
        if resumed:
            with self._lock:
                self._state = previous
        return resumed

    def snapshot(self) -> StatusSnapshot:
        with self._lock:
            return StatusSnapshot(self._step, self._version, self._state, self.paused, dict(self._metrics), self.train_iters)

    def checkpoint(self, path: str) -> tuple[str, int]:
        """Runs the checkpoint handler between steps; RuntimeError when no model is attached yet."""
        if self.checkpoint_handler is None:
            raise RuntimeError("no model is loaded yet; checkpoint after the first step starts")
        with self.step_lock:
            return self.checkpoint_handler(path)
