"""The whole run's config (Config, one field per section), the error a config that cannot run raises, and how a
command line reports it."""
from __future__ import annotations

import sys
import typing
from dataclasses import field

from services.common.config.algorithm import RLConfig
from services.common.config.dock import AuthConfig, DockConfig
from services.common.config.model import ArithmeticConfig, InitModelConfig
from services.common.config.profiler import ProfilerRoles
from services.common.config.reward import RewardModelConfig, RewardServiceConfig
from services.common.config.rollout import GenerateConfig, RolloutServiceConfig
from services.common.config.sandbox import SandboxConfig
from services.common.config.training import MegatronTrainingConfig, TrainerServiceConfig
from services.common.config.types import config_section


class ConfigError(ValueError):
    """A config that cannot run; `errors` lists every problem as 'path: message'."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("invalid config:\n  " + "\n  ".join(self.errors))


def exit_status(command: typing.Callable[[], int | None]) -> int:
    """Runs a command line's work; a config that cannot run is reported as `dockrl config check` reports it
    (every problem with its key's path, on stderr, no traceback) with exit status 2."""
    try:
        return int(command() or 0)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2


@config_section
class Config:
    """The whole run."""

    megatron_training: MegatronTrainingConfig = field(default_factory=MegatronTrainingConfig)
    rl_config: RLConfig = field(default_factory=RLConfig)
    generate_config: GenerateConfig = field(default_factory=GenerateConfig)
    rollout: RolloutServiceConfig = field(default_factory=RolloutServiceConfig)
    reward: RewardServiceConfig = field(default_factory=RewardServiceConfig)
    reward_config: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerServiceConfig = field(default_factory=TrainerServiceConfig)
    dock: DockConfig = field(default_factory=DockConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    profiler_config: ProfilerRoles = field(default_factory=ProfilerRoles)
    init_model: InitModelConfig | None = None
    arithmetic: ArithmeticConfig | None = None

    @property
    def sandbox_clients(self) -> dict[str, str]:
        """The run's clients of the code sandbox (the sandbox_fusion verifier, the agent's code_interpreter tool): the
        config key of each one's address -> that address, "" for the run's own replicas (sandbox.address)."""
        mtc, clients = self.rollout.multi_turn, {}
        if "sandbox_fusion" in self.rl_config.verifier_function:
            clients["reward.sandbox_address"] = self.reward.sandbox_address
        if mtc.environment and "code_interpreter" in mtc.tools:
            clients["rollout.multi_turn.sandbox_address"] = mtc.sandbox_address
        return clients

    @property
    def samples_per_iteration(self) -> int:
        """GBS * n: rows the dock holds for one iteration."""
        return self.megatron_training.global_batch_size * self.rl_config.n_samples_per_prompt

    @property
    def trained_samples_per_iteration(self) -> int:
        """Samples one update trains: GBS * n, or with DAPO's dynamic sampling filter_groups_train_batch_size * n
        (groups kept over as many rounds of GBS prompts as it takes)."""
        rl = self.rl_config
        groups = (rl.filter_groups_train_batch_size if rl.filter_groups_enable else 0) or self.megatron_training.global_batch_size
        return groups * rl.n_samples_per_prompt

    @property
    def admitted_groups(self) -> int:
        """Untrained groups the trainer keeps in the dock, AReaL's admission bound: (max_staleness + 1) * GBS,
        one GBS more under partial rollout (room for the carry-over of unfinished groups)."""
        rl = self.rl_config
        return (rl.max_staleness + 1 + (rl.partial_rollout_max_split > 1)) * self.megatron_training.global_batch_size

    @property
    def actor_data_parallel_size(self) -> int:
        mt = self.megatron_training
        model_parallel = mt.tensor_model_parallel_size * mt.pipeline_model_parallel_size * mt.context_parallel_size
        return max(1, self.rl_config.actor_resource.num_npus // max(1, model_parallel))
