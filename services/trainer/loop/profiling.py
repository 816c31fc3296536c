"""torch.profiler around the trainer's iterations (profiler_config.trainer, MindSpeed-RL's keys).

Each profiled step is one trace per rank, written by torch's TensorBoard trace handler as a
Chrome trace (`<save path>/rank<r>/rank<r>_step<s>.<host>.<pid>.<ms>.pt.trace.json`): TensorBoard's
profiler plugin and Perfetto (ui.perfetto.dev) open it. Inside a step the trainer marks its stages
with `torch.profiler.record_function` (MindSpeed-RL's stage names where it has them:
`actor_compute_log_prob`, `reference_compute_log_prob`, `critic_compute_values`, `actor_update`,
`critic_update`; and `collect_scored_groups`, `weight_gather`, `weight_push`); outside a profiled
step such a range costs a check.
"""
from __future__ import annotations

import contextlib
import pathlib
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

from services.common.config import Config, ProfilerConfig, profiler_trace_root


def trace_dir(cfg: Config, rank: int) -> pathlib.Path:
    """Where this rank's traces go: profile_save_path (default <trainer.log_dir>/profiler), one directory per rank."""
    return profiler_trace_root(cfg, "trainer") / f"rank{rank}"


class StepProfiler:
    """Profiles the configured steps on the configured ranks; a no-op everywhere else."""

    def __init__(self, pc: ProfilerConfig, out_dir: pathlib.Path, rank: int):
        self.pc = pc
        self.out_dir = out_dir
        self.rank = rank
        self.enabled = pc.profile and (pc.profile_ranks == "all" or rank in pc.profile_ranks)

    @classmethod
    def from_config(cls, cfg: Config, rank: int) -> "StepProfiler":
        """The trainer's profiler for `rank`."""
        return cls(cfg.profiler_config.trainer, trace_dir(cfg, rank), rank)

    def profiles(self, step: int) -> bool:
        """Whether `step` is traced on this rank."""
        return self.enabled and self.pc.traces_step(step)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Traces the body when `step` is configured; the trace is written when the body ends."""
        if not self.profiles(step):
            yield
            return
        activities = []
        if self.pc.profile_with_cpu:
            activities.append(ProfilerActivity.CPU)
        if self.pc.profile_with_npu and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        handler = tensorboard_trace_handler(str(self.out_dir), worker_name=f"rank{self.rank}_step{step}")
        with profile(activities=activities, record_shapes=self.pc.profile_record_shapes,
                     profile_memory=self.pc.profile_with_memory, with_stack=self.pc.profile_with_module,
                     on_trace_ready=handler):
            with record_function(f"iteration {step}"):
                yield

