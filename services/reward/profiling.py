"""torch.profiler on a reward worker (profiler_config.reward, MindSpeed-RL's keys).

While the dock's policy version + 1 (the trainer iteration being scored for) is a profiled step,
the worker's claims, response decoding, scoring calls and puts are recorded (named ranges
`dock_claim`, `score_samples`, `dock_put` around the operators); the trace is written
when the range ends (or the worker stops) as one Chrome trace,
<profile_save_path or trainer.log_dir/profiler>/reward/<host>_<pid>/reward_step<s>...pt.trace.json.
Verifiers that run in the worker's process pool (rl_config.verifier_parallel > 1) show as the wait for them.
"""
from __future__ import annotations

import contextlib
import logging
import pathlib

from services.common.config import Config, ProfilerConfig, process_trace_dir
from services.common.log import log_event

log = logging.getLogger("dockrl.reward")


class ScoringProfiler:
    """Starts torch.profiler when a profiled step begins and writes the trace when the range ends."""

    def __init__(self, pc: ProfilerConfig, trace_dir: pathlib.Path):
        self.pc = pc
        self.trace_dir = trace_dir
        self.prof = None

    @classmethod
    def from_config(cls, cfg: Config) -> "ScoringProfiler":
        """This worker's profiler: its traces under profiler_config.reward's save path, one directory per process."""
        return cls(cfg.profiler_config.reward, process_trace_dir(cfg, "reward"))

    @property
    def enabled(self) -> bool:
        """Whether profiler_config.reward profiles at all (else the worker asks no step)."""
        return self.pc.profile

    def at_step(self, step: int) -> None:
        """Called with each claim, before its rows are scored, with the trainer iteration being scored for."""
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        wanted = self.pc.traces_step(step)
        if wanted and self.prof is None:
            self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=self.pc.profile_record_shapes,
                                profile_memory=self.pc.profile_with_memory, with_stack=self.pc.profile_with_module,
                                on_trace_ready=tensorboard_trace_handler(str(self.trace_dir), worker_name=f"reward_step{step}"))
            self.prof.start()
            log_event(log, "profiler started", step=step)
        elif not wanted and self.prof is not None:
            self.stop()

    def range(self, name: str):
        """A named range in the trace while a profile runs (the worker's claim, scoring and put); otherwise nothing."""
        if self.prof is None:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(name)

    def stop(self) -> None:
        """Ends a running profile and writes its trace."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
            log_event(log, "profiler stopped; trace written", dir=str(self.trace_dir))
