"""The reward sections: the reward service (reward) and the reward model it serves (reward_config)."""
from __future__ import annotations

from services.common.config.types import NonNegativeInt, Port, PositiveInt, config_section


@config_section
class RewardServiceConfig:
    """Where reward replicas listen and what one Score request may hold."""

    host: str = "127.0.0.1"  # bind address
    grpc_port: Port = 50061  # gRPC port of the first replica (replica i: + i; reward-model replicas follow the rule ones)
    replicas: PositiveInt = 1  # rule reward replicas `dockrl up` starts (they also serve the reward model while reward_config.model_replicas is 0)
    max_items: PositiveInt = 4096  # items per Score request; more is INVALID_ARGUMENT
    max_response_chars: PositiveInt = 1_000_000  # characters per response; longer is INVALID_ARGUMENT
    max_request_mb: PositiveInt = 64  # gRPC receive limit for one Score request
    server_threads: PositiveInt = 8  # concurrent Score calls; they share the verifier pool
    metrics_port: Port = 0  # Prometheus /metrics (HTTP) on this port; 0: not served
    sandbox_address: str = ""  # host:port of the sandbox replica the sandbox_fusion verifier runs programs on; "": the run's own, sandbox.host:grpc_port, which `dockrl up` starts
    code_continuous: bool = False  # sandbox_fusion scores the fraction of the first 10 tests passed (verl's continuous) instead of 1 only when all pass


@config_section
class RewardModelConfig:
    """The reward model (scalar head) a reward replica serves as the `reward_model` verifier (MindSpeed-RL's `reward_config`)."""

    load: str = ""  # Hugging Face directory of a *ForSequenceClassification model with num_labels 1; empty: rules only
    seq_length: PositiveInt = 1024  # prompt + response tokens the model reads; a longer input keeps its last seq_length tokens
    model_replicas: NonNegativeInt = 0  # reward-model replicas `dockrl up` starts (consumer model_reward); 0: every reward replica serves the model itself
