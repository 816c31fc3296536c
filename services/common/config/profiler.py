"""profiler_config: torch.profiler per role, and where each role's traces go."""
from __future__ import annotations

import os
import pathlib
import socket
import typing
from dataclasses import field
from typing import Literal

from services.common.config.types import config_section

if typing.TYPE_CHECKING:
    from services.common.config.root import Config


@config_section
class ProfilerConfig:
    """torch.profiler around one role's steps, with MindSpeed-RL's profiler_config keys."""

    profile: bool = False  # profile the steps profile_step_start .. profile_step_end - 1
    mstx: bool = False  # Ascend's lightweight mstx marks: not built (must stay false)
    stage: Literal["all"] = "all"  # all: the whole iteration, each stage (log-prob passes, update, weight push) a named range
    profile_save_path: str = ""  # traces land here, one directory per trainer rank (rollout/, reward/ for those roles); empty: <trainer.log_dir>/profiler
    profile_export_type: Literal["text"] = "text"  # text: a Chrome trace (.pt.trace.json; TensorBoard, Perfetto); db is torch_npu's, not built
    profile_step_start: int = 1  # first profiled step (1-based)
    profile_step_end: int = 2  # first step not profiled
    profile_level: str = "level0"  # level0 only: torch_npu's levels have no torch.profiler counterpart
    profile_with_memory: bool = False  # record tensor allocations (torch.profiler profile_memory)
    profile_record_shapes: bool = False  # record operator input shapes
    profile_with_cpu: bool = True  # profile host-side operators (ProfilerActivity.CPU)
    profile_with_npu: bool = True  # profile device kernels where a GPU is present (ProfilerActivity.CUDA); no effect on CPU
    profile_with_module: bool = False  # record Python call stacks (torch.profiler with_stack)
    profile_analysis: bool = False  # torch_npu's analysis after capture: not built (must stay false); the traces open as written
    profile_ranks: tuple[int, ...] | str = "all"  # all, or a list of the trainer ranks that profile (rollout and reward: all)

    def traces_step(self, step: int) -> bool:
        """Whether `step` (a trainer iteration, 1-based) is profiled."""
        return self.profile and self.profile_step_start <= step < self.profile_step_end


@config_section
class ProfilerRoles:
    """profiler_config: one section per role (MindSpeed-RL's `integrated` is the colocated worker; here the trainer).

    A step is a trainer iteration in every role: a rollout replica profiles while it generates for
    the profiled iterations (policy version + 1), a reward worker while the dock's policy version + 1 is one."""

    trainer: ProfilerConfig = field(default_factory=ProfilerConfig)  # torch.profiler on each trainer rank, stages as named ranges
    rollout: ProfilerConfig = field(default_factory=ProfilerConfig)  # vLLM's torch profiler in each replica: its engine workers and API process
    reward: ProfilerConfig = field(default_factory=ProfilerConfig)  # torch.profiler in each reward worker around its claims and scoring


def profiler_trace_root(cfg: Config, role: str) -> pathlib.Path:
    """Where `role`'s traces go: its profile_save_path, else <trainer.log_dir>/profiler (rollout/ and reward/ below it)."""
    pc = getattr(cfg.profiler_config, role)
    root = pathlib.Path(pc.profile_save_path or pathlib.Path(cfg.trainer.log_dir) / "profiler")
    return root if role == "trainer" else root / role


def process_trace_dir(cfg: Config, role: str) -> pathlib.Path:
    """The directory of this process's `role` traces (rollout, reward: each replica writes in its own)."""
    return (profiler_trace_root(cfg, role) / f"{socket.gethostname()}_{os.getpid()}").resolve()
