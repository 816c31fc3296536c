"""One YAML -> typed, frozen dataclasses, validated once at load.

Sections and keys follow MindSpeed-RL (`megatron_training`, `rl_config`, `generate_config` with
`sampling_config`), plus the service sections of dockrl (`rollout`, `reward`, `trainer`, `dock`,
`sandbox`, `auth`, `init_model`). Every error is collected and reported at once with the key's full path,
the bad value and what would be accepted.

The package's modules, one job each (import the names from here):
  types      how a section is declared and read (config_section, the constrained field types, parse_section)
  rollout    generate_config (with sampling_config) and rollout (with multi_turn)
  algorithm  rl_config (with actor_resource), and the loss modes and verifiers its keys accept
  training   megatron_training and trainer
  reward     reward and reward_config
  sandbox    sandbox (the code sandbox service)
  dock       dock and auth
  model      init_model and arithmetic
  profiler   profiler_config, and where each role's traces go
  root       Config (the whole run), ConfigError, exit_status
  checks     the checks that span several keys, and the derived *_dispatch_size keys
  load       file, environment and --set overrides -> a validated Config; a Config -> plain data
"""
from __future__ import annotations

from services.common.config.algorithm import LOSS_AGG_MODES, REWARD_MODEL, RULE_VERIFIERS, ActorResource, RLConfig
from services.common.config.dock import AuthConfig, DockConfig
from services.common.config.load import (
    DEFAULT_CONFIG, ENV_PREFIX, REPO_ROOT, config_from_dict, config_from_translation, config_to_dict, env_overrides,
    load_config, parse_dataclass, read_config_file,
)
from services.common.config.model import MOE_ARCHITECTURES, ArithmeticConfig, InitModelConfig
from services.common.config.profiler import ProfilerConfig, ProfilerRoles, process_trace_dir, profiler_trace_root
from services.common.config.reward import RewardModelConfig, RewardServiceConfig
from services.common.config.rollout import GenerateConfig, MultiTurnConfig, RolloutServiceConfig, SamplingConfig
from services.common.config.sandbox import SandboxConfig
from services.common.config.root import Config, ConfigError, exit_status
from services.common.config.training import MegatronTrainingConfig, TrainerServiceConfig

__all__ = [
    "ActorResource", "ArithmeticConfig", "AuthConfig", "Config", "ConfigError", "DEFAULT_CONFIG", "DockConfig",
    "ENV_PREFIX", "GenerateConfig", "InitModelConfig", "LOSS_AGG_MODES", "MOE_ARCHITECTURES", "MegatronTrainingConfig",
    "MultiTurnConfig", "ProfilerConfig", "ProfilerRoles", "REPO_ROOT", "REWARD_MODEL", "RLConfig", "RULE_VERIFIERS",
    "RewardModelConfig",
    "RewardServiceConfig", "RolloutServiceConfig", "SamplingConfig", "SandboxConfig", "TrainerServiceConfig", "config_from_dict",
    "config_from_translation", "config_to_dict", "env_overrides", "exit_status", "load_config", "parse_dataclass",
    "process_trace_dir", "profiler_trace_root", "read_config_file",
]
