"""vLLM's own torch profiler on a rollout replica (profiler_config.rollout, MindSpeed-RL's keys).

The engine is started with vLLM's `--profiler-config` (torch profiler, traces under
<profile_save_path or trainer.log_dir/profiler>/rollout/<host>_<pid>/), and the dock worker starts
it before generating a claim's rows for a profiled trainer iteration (its policy version + 1) and
stops it before the first claim past the last one. vLLM writes one Chrome trace per engine worker: the model's
forward, sampling and scheduling, as Perfetto and TensorBoard open them.
"""
from __future__ import annotations

import logging
import pathlib

import torch

from services.common.config import Config, ProfilerConfig, process_trace_dir
from services.common.log import log_event

log = logging.getLogger("dockrl.rollout")


def rollout_trace_dir(cfg: Config) -> pathlib.Path | None:
    """This replica's trace directory when profiler_config.rollout.profile is on, else None."""
    if not cfg.profiler_config.rollout.profile:
        return None
    return process_trace_dir(cfg, "rollout")


def vllm_profiler_config(pc: ProfilerConfig, trace_dir: pathlib.Path) -> dict:
    """profiler_config.rollout as vLLM's ProfilerConfig (the value of `--profiler-config`)."""
    activities = (["CPU"] if pc.profile_with_cpu else []) + (["CUDA"] if pc.profile_with_npu and torch.cuda.is_available() else [])
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_activities": activities,
        "torch_profiler_with_stack": pc.profile_with_module,
        "torch_profiler_record_shapes": pc.profile_record_shapes,
        "torch_profiler_with_memory": pc.profile_with_memory,
        "torch_profiler_use_gzip": False,  # plain .json, as the trainer's traces
        # vLLM starts and stops the API process's own profiler on different threads, and torch's trace
        # export then crashed the replica (SIGSEGV in ActivityTraceWrapper::save, vLLM 0.32 on CPU):
        # the engine workers' traces hold the model, sampling and scheduling; the API process is left out.
        "ignore_frontend": True,
    }


class EngineProfiler:
    """Runs vLLM's profiler over the profiled iterations' generation; a no-op when profiling is off."""

    def __init__(self, llm, pc: ProfilerConfig):
        self.llm = llm  # vllm AsyncLLM
        self.pc = pc
        self.active = False

    async def at_step(self, step: int) -> None:
        """Called with each claim, before its rows are generated, with the iteration they feed: starts or stops the profiler."""
        wanted = self.pc.traces_step(step)
        if wanted and not self.active:
            await self.llm.start_profile(profile_prefix=f"step{step}")
            self.active = True
            log_event(log, "profiler started", step=step)
        elif not wanted and self.active:
            await self.stop()

    async def stop(self) -> None:
        """Stops a running profile; vLLM writes its traces."""
        if self.active:
            self.active = False
            await self.llm.stop_profile()
            log_event(log, "profiler stopped; traces written", dir=self.pc.profile_save_path or "<trainer.log_dir>/profiler/rollout")
