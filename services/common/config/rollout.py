"""The rollout sections: vLLM's engine and sampling settings (generate_config) and the rollout service (rollout)."""
from __future__ import annotations

from dataclasses import field
from typing import Literal

from services.common.config.types import (
    NonNegativeFloat, NonNegativeInt, Port, PositiveFloat, PositiveInt, Probability, Share, config_section,
)


@config_section
class SamplingConfig:
    """vLLM sampling parameters used for rollout (generate_config.sampling_config)."""

    temperature: NonNegativeFloat = 1.0  # softmax temperature; 0 is greedy
    top_p: Probability = 1.0  # nucleus sampling mass in (0, 1]
    top_k: int = -1  # -1 disables top-k
    min_p: Share = 0.0  # minimum token probability relative to the best token
    max_tokens: PositiveInt = 2048  # response budget; must equal rl_config.rollout_max_tokens
    logprobs: NonNegativeInt = 1  # 1 returns the sampled token's logprob (the trainer needs it)
    n: PositiveInt = 1  # completions per request; the dock worker asks n_samples_per_prompt
    stop: tuple[str, ...] = ()  # strings that end a response
    seed: int | None = None  # base of the rollout rows' seeds (each row: a hash of it, the prompt and its index in the group); null: megatron_training.seed; the API's default seed
    detokenize: bool = False  # return text as well as token ids to the dock worker


@config_section
class GenerateConfig:
    """The rollout engine (vLLM) settings."""

    infer_tensor_parallel_size: int = 1  # vLLM tensor parallel size per rollout replica
    infer_pipeline_parallel_size: int = 1  # vLLM pipeline parallel size per rollout replica
    max_num_seqs: PositiveInt = 256  # sequences vLLM schedules at once
    max_model_len: PositiveInt = 4096  # prompt + response tokens the engine accepts
    max_num_batched_tokens: int = 8192  # tokens per engine step
    gpu_memory_utilization: Probability = 0.9  # share of accelerator memory vLLM may take
    enforce_eager: bool = True  # no CUDA graphs or torch.compile (MoE expert token counts for EPLB need it: docs/moe.md)
    enable_prefix_caching: bool = False  # reuse KV cache across requests with a common prefix
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # the rollout engine's weights and activations (pushed weights are cast to it)
    trust_remote_code: bool = False  # allow model code from the checkpoint directory
    seed: int = 1234  # random seed
    cpu_kvcache_space_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    expert_map_path: str = ""  # MoE, MindSpeed-RL's key: an expert map file (vllm-ascend's format, written by `dockrl eplb`); each replica checks it at start and reports its imbalance on GET /v1/expert_load (docs/moe.md)
    tool_call_parser: str = ""  # vLLM's --tool-call-parser (e.g. hermes for Qwen) with auto tool choice on the HTTP API; "": tools off
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)


@config_section
class MultiTurnConfig:
    """Agentic rollout (rollout.multi_turn, verl's path and key names where verl has the key): each row runs as an
    episode of model turns and environment observations in the replicas' dock workers (docs/agents.md). An
    episode's tokens after the prompt, model and environment alike, share generate_config.sampling_config.max_tokens
    (the trainer's response length); the model's own tokens are kept exactly as sampled."""

    environment: str = ""  # a registered environment ("tools": tool calls answered by the tools below); "": off, one generation per row; not with partial rollout yet
    format: Literal["tag", "hermes"] = "tag"  # how tool calls are read from a turn: tag (tool_call_start/end around JSON, for models without tool tokens) or hermes (vLLM's hermes parser, Qwen and Hermes chat models, whose observations are ChatML turns)
    tool_call_start: str = "<tool_call>"  # format tag: the text opening a call {"name": ..., "arguments": {...}}
    tool_call_end: str = "</tool_call>"  # format tag: the text closing a call; a turn stops there (the model reads the response next)
    tag_body: Literal["json", "argument"] = "json"  # format tag: what a call holds between its tags: json ({"name": ..., "arguments": {...}}) or argument (the value of the one required argument of the one tool listed, e.g. <c>12*34</c> for the calculator: fewer tokens for a small model to write)
    tools: tuple[str, ...] = ("calculator",)  # the tools the environment offers, by name
    max_assistant_turns: PositiveInt = 5  # model turns per episode; an episode still calling tools after the last ends with finish reason length
    max_tokens_per_turn: NonNegativeInt = 0  # tokens one model turn may generate; 0: the rest of the episode's budget
    max_observation_tokens: PositiveInt = 256  # tokens of one observation (its ids are cut to this, and the cut counted)
    tool_timeout_s: PositiveFloat = 5.0  # seconds one tool call may take; past it the model sees a timeout error
    sandbox_address: str = ""  # host:port of the sandbox replica (`dockrl sandbox serve`) the code_interpreter tool runs programs on, each for at most tool_timeout_s; "": the run's own, sandbox.host:grpc_port (each rollout replica one of the sandbox.replicas), which `dockrl up` starts
    environment_reward_weight: NonNegativeFloat = 0.0  # the environment's reward is added to the verifiers' weighted reward times this; 0: reported in the agent/ metrics, not paid


@config_section
class RolloutServiceConfig:
    """Where rollout replicas listen and how much they queue."""

    host: str = "127.0.0.1"  # bind address
    grpc_port: Port = 50051  # gRPC port of the first replica (replica i: + i); 0: each binds a free one
    http_port: Port = 8000  # OpenAI-compatible HTTP port of the first replica (replica i: + i); 0: each binds a free one
    replicas: PositiveInt = 1  # replicas `dockrl up` starts
    max_queue: PositiveInt = 256  # requests waiting or running; past it 429 / RESOURCE_EXHAUSTED
    served_model_name: str = ""  # default: the model directory's name
    heartbeat_ttl_s: float = 10.0  # a replica that misses heartbeats this long leaves the registry
    omp_threads_bind: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND on CPU (auto: distinct cores per replica, one each left for its scheduler)
    drain_s: PositiveFloat = 30.0  # on SIGTERM: seconds to finish or return held work and stop the engine, in all
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
