"""One YAML -> typed, frozen dataclasses, validated once at load.

Sections and keys follow MindSpeed-RL (`megatron_training`, `rl_config`, `generate_config` with
`sampling_config`), plus the service sections of dockrl (`rollout`, `reward`, `trainer`, `dock`,
`auth`, `init_model`). Every error is collected and reported at once with the key's full path,
the bad value and what would be accepted.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import socket
import sys
import typing
from dataclasses import field
from typing import Any, Literal

import yaml

from services.common.config_types import (
    NonNegativeFloat, NonNegativeInt, Port, PositiveFloat, PositiveInt, Probability, Share, config_section, parse_section,
)
from services.common.mindspeed_layout import Translation, load_translated

log = logging.getLogger("dockrl.config")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny_cpu.yaml"


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
class ActorResource:
    """Processes (GPUs / NPUs / CPU ranks) the actor trains on."""

    num_npus: PositiveInt = 1  # ranks the actor trains on (GPUs, NPUs or CPU processes)


@config_section
class RLConfig:
    """Algorithm settings (rl_config), with MindSpeed-RL's names and defaults."""

    n_samples_per_prompt: PositiveInt = 1  # responses per prompt (the group size n)
    max_prompt_length: int = 2048  # longest prompt in tokens: the trainer leaves longer ones out (counted in summary.json), a dock put refuses them
    adv_estimator: Literal["group_norm", "gae"] = "group_norm"  # group_norm: GRPO's group-normalised rewards; gae: PPO's critic and GAE
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"  # kl (k1) | abs | mse | low_var_kl
    kl_ctrl_type: Literal["fixed", "adaptive"] = "fixed"  # fixed: the KL coefficient stays init_kl_coef; adaptive: it moves each step to keep the KL near kl_target
    init_kl_coef: NonNegativeFloat = 0.001  # KL penalty coefficient (the adaptive controller's start)
    kl_target: float = 100.0  # adaptive: the KL per token the coefficient steers toward (MindSpeed-RL's default)
    kl_horizon: int = 1000  # adaptive: samples over which the coefficient may change by up to 20% (MindSpeed-RL's default)
    use_kl_in_reward: bool = False  # subtract the KL penalty from the reward (PPO) instead of the loss
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    clip_ratio: float = 0.2  # PPO clip range epsilon
    clip_higher_enable: bool = False  # DAPO clip-higher: use clip_ratio_low / clip_ratio_high
    clip_ratio_low: float = 0.2  # lower clip range with clip-higher
    clip_ratio_high: float = 0.28  # upper clip range with clip-higher
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    token_level_loss: bool = True  # average the loss over tokens of the batch (DAPO) rather than per sequence; loss_agg_mode, when set, decides
    loss_agg_mode: str = ""  # verl's names: token-mean | seq-mean-token-mean | seq-mean-token-sum (Dr. GRPO); empty: token_level_loss decides
    entropy_coeff: NonNegativeFloat = 0.0  # entropy bonus coefficient
    cliprange_value: float = 0.5  # critic value clip range (PPO)
    mini_batch_size: int | None = None  # samples per update; default GBS * n
    epochs: PositiveInt = 1  # passes over each iteration's data
    shuffle_mini_batch: bool = False  # shuffle samples before splitting into mini-batches
    guarantee_order: bool = False  # claims return rows in index order (reproducible runs)
    partial_rollout_max_split: PositiveInt = 1  # split a response budget into this many rollout rounds (1: off)
    require_max_age_all_finished: bool = True  # finish every group at the maximum age before the iteration ends
    rollout_max_tokens: PositiveInt = 2048  # response budget the overlong penalty measures against
    overlong_buffer_enable: bool = False  # DAPO overlong reward shaping
    overlong_buffer: NonNegativeInt = 0  # tokens before rollout_max_tokens where the penalty ramps
    overlong_buffer_penalty_factor: float = 1.0  # penalty at rollout_max_tokens
    filter_groups_enable: bool = False  # DAPO dynamic sampling: drop groups whose metric has std 0
    filter_groups_metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"  # the per-sample metric dynamic sampling looks at: acc | score | seq_reward | seq_final_reward, each the sample's reward here
    filter_groups_max_batches: int = 10  # prompt batches dynamic sampling may draw per iteration; -1: no limit
    verifier_function: tuple[str, ...] = ("base_acc",)  # rule verifiers, and `reward_model` for reward_config's model, summed into the reward
    verifier_weight: tuple[float, ...] = (1.0,)  # one weight per verifier_function entry
    verifier_parallel: PositiveInt = 1  # verifier worker processes per reward replica
    verifier_timeout: PositiveFloat = 30.0  # seconds per sample before the verifier's timeout score is given
    use_remove_padding: bool = False  # pack sequences without padding for logprob/update passes
    use_dynamic_bsz: bool = False  # form micro-batches by token count instead of sample count
    max_packing_token_size: int = 4096  # tokens per packed micro-batch with use_dynamic_bsz
    max_staleness: NonNegativeInt = 0  # AReaL's eta: rollout runs up to eta versions ahead of the trainer; 0 is synchronous
    use_decoupled_loss: bool = False  # AReaL's decoupled PPO: clip against the policy before the update, weight by it over the rollout's (behaviour) policy
    behav_imp_weight_cap: float = 0.0  # decoupled loss: tokens whose behaviour importance weight exceeds it are left out (0: no cap)
    routing_replay: bool = False  # MoE: rollout records each token's routed experts, the trainer's forward passes replay them (slime's R3; docs/moe.md)
    use_tensorboard: bool = True  # write TensorBoard scalars
    use_wandb: bool = False  # also log every step to Weights & Biases (the `wandb` extra; WANDB_MODE=offline logs locally)
    wandb_project: str = ""  # W&B project (required with use_wandb)
    wandb_exp_name: str = ""  # W&B run name; empty: the trainer.log_dir's name
    wandb_save_dir: str = ""  # W&B writes its run files in a wandb/ folder here; empty: trainer.log_dir
    actor_resource: ActorResource = field(default_factory=ActorResource)
    # Derived at load as MindSpeed-RL derives them when left unset.
    actor_rollout_dispatch_size: int | None = None  # samples per rollout claim
    reward_dispatch_size: int | None = None  # samples per reward claim


@config_section
class MegatronTrainingConfig:
    """The trainer's model, data and optimiser settings (megatron_training)."""

    model: str = "model"  # a name for logs
    tokenizer_name_or_path: str = ""  # Hugging Face tokenizer directory
    load: str = ""  # Hugging Face checkpoint the run starts from
    save: str = ""  # checkpoint directory
    data_path: str = ""  # preprocessed prompts (dockrl data preprocess)
    no_shuffle: bool = False  # hand out prompts in file order each epoch instead of a seeded shuffle (rl_config.guarantee_order implies it)
    global_batch_size: PositiveInt = 1  # prompts per iteration
    micro_batch_size: PositiveInt = 1  # samples per forward/backward
    seq_length: PositiveInt = 4096  # longest prompt + response the trainer handles
    train_iters: PositiveInt = 1  # RL iterations
    tensor_model_parallel_size: PositiveInt = 1  # Megatron tensor parallel size
    pipeline_model_parallel_size: PositiveInt = 1  # Megatron pipeline parallel size
    virtual_pipeline_model_parallel_size: int | None = None  # model chunks per pipeline stage: megatron's interleaved 1F1B schedule (>= 2, PP >= 2); null: 1F1B with one chunk
    context_parallel_size: PositiveInt = 1  # Megatron context parallel size: each sequence split over this many ranks (long responses)
    context_parallel_algo: Literal["ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo"] = "megatron_cp_algo"  # megatron_cp_algo (ring attention) | ulysses_cp_algo (all-to-all over heads) | hybrid_cp_algo (Ulysses within groups of ulysses_degree_in_cp ranks, the ring across them)
    ulysses_degree_in_cp: int | None = None  # hybrid_cp_algo only: CP ranks of one Ulysses group (consecutive); it and context_parallel_size / it both >= 2
    expert_model_parallel_size: PositiveInt = 1  # Megatron expert parallel size: each MoE layer's experts split over this many data-parallel ranks (must divide the model's experts)
    lr: NonNegativeFloat = 1e-6  # peak learning rate (AdamW)
    critic_lr: NonNegativeFloat = 0.0  # the PPO critic's peak learning rate; 0: lr
    min_lr: float = 0.0  # learning rate at the end of a decay
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"  # how the learning rate goes from lr to min_lr after the warmup
    lr_warmup_fraction: float = 0.0  # share of train_iters spent warming up
    weight_decay: NonNegativeFloat = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    clip_grad: NonNegativeFloat = 1.0  # gradient norm clip
    use_distributed_optimizer: bool = True  # shard the fp32 weights and Adam state over data-parallel ranks (Megatron's distributed optimizer)
    bf16: bool = False  # train in bfloat16 (fp32 when false)
    save_interval: int = 0  # 0: only at the end
    seed: int = 1234  # random seed (the trainer's, and the base of each rollout row's sampling seed unless sampling_config.seed is set)
    npu_deterministic: bool = False  # deterministic kernels on every rank (torch.use_deterministic_algorithms; HCCL_DETERMINISTIC on Ascend, CUBLAS_WORKSPACE_CONFIG on CUDA)
    distributed_backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"  # torch.distributed backend; auto: nccl with CUDA, hccl with an NPU, else gloo


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


@config_section
class RewardModelConfig:
    """The reward model (scalar head) a reward replica serves as the `reward_model` verifier (MindSpeed-RL's `reward_config`)."""

    load: str = ""  # Hugging Face directory of a *ForSequenceClassification model with num_labels 1; empty: rules only
    seq_length: PositiveInt = 1024  # prompt + response tokens the model reads; a longer input keeps its last seq_length tokens
    model_replicas: NonNegativeInt = 0  # reward-model replicas `dockrl up` starts (consumer model_reward); 0: every reward replica serves the model itself


@config_section
class TrainerServiceConfig:
    """The trainer's control port, weight push and logs."""

    host: str = "127.0.0.1"  # bind address
    grpc_port: Port = 50071  # gRPC port
    bucket_mb: PositiveInt = 64  # weight-push bucket size in MiB
    push_mode: Literal["fanout", "chain"] = "fanout"  # weight_transport grpc: fanout, one stream to each replica; chain, one to the first, each replica relaying to the next
    weight_transport: Literal["grpc", "collective"] = "grpc"  # grpc: buckets as gRPC messages | collective: gRPC control, bytes over a gloo group per replica (docs/trainer.md)
    weight_group_host: str = ""  # collective: the address replicas reach the trainer's weight-group rendezvous at; empty: trainer.host
    push_stall_s: PositiveFloat = 120.0  # a replica that takes no weight chunk (or gives no answer after the last) this long misses the push
    log_dir: str = "runs/default"  # TensorBoard scalars, JSONL metrics and PNG curves
    eval_data_path: str = ""  # preprocessed prompts RL trains on, evaluated greedily (train accuracy); empty: none
    test_data_path: str = ""  # preprocessed prompts held out from RL (held-out accuracy); empty: none
    rollout_timeout_s: float = 600.0  # an iteration fails when no scored group arrives for this long
    log_logprob_diff: bool = True  # log train_rollout_logprob_diff each step, from the update's own log-probs before its first step (no extra pass)
    eval_interval: int = 0  # iterations between held-out evaluations; 0: start and end only


@config_section
class DockConfig:
    """The Redis-backed data dock."""

    redis_url: str = ""  # empty: `dockrl up` starts a local redis-server
    prefix: str = "dockrl"  # Redis key prefix
    run_id: str = "default"  # run name; keys live under prefix:run_id
    lease_seconds: PositiveFloat = 120.0  # a claim returns to the pool if not put back within this time
    durability: bool = False  # ask Redis for AOF with appendfsync always (a crash loses no acknowledged dock write)
    redis_password: str = ""  # Redis AUTH password
    redis_tls: bool = False  # connect to Redis over TLS
    redis_username: str = ""  # Redis ACL user; empty: the default user
    redis_tls_ca_file: str = ""  # CA bundle that signs the server's certificate (with redis_tls)
    redis_cluster: bool = False  # redis_url names one node of a Redis Cluster; a run's keys share one hash slot
    socket_timeout_s: PositiveFloat = 30.0  # a Redis call that takes longer fails as Unavailable
    reconnect_timeout_s: PositiveFloat = 60.0  # Redis unreachable: calls retry with backoff this long, then fail as Unavailable
    capacity_groups: NonNegativeInt = 0  # group slots in the pool; 0: (max_staleness + 1) * GBS, one GBS more under partial rollout
    rollout_consumer: str = "actor_rollout"  # the consumer partial rollout (oldest first, ages) applies to
    claim_poll_s: PositiveFloat = 0.05  # longest a waiting claim waits before asking again (a put or release of rows wakes it sooner)
    max_memory_mb: NonNegativeFloat = 0.0  # a put that would take Redis's used_memory past this is refused (ResourceExhausted); 0: no limit
    redis_sentinels: tuple[str, ...] = ()  # host:port of each Redis Sentinel; set: the dock asks them for the primary and follows failovers (redis_url stays empty)
    redis_sentinel_master: str = ""  # the master name the sentinels monitor (`sentinel monitor NAME ...`); needed with redis_sentinels
    min_replicas_acked: NonNegativeInt = 0  # every dock write waits (Redis WAIT) until this many replicas hold it, so a failover loses no acknowledged write; 0: asynchronous
    replica_ack_timeout_s: PositiveFloat = 5.0  # how long a write waits for min_replicas_acked replicas before it fails as Unavailable


@config_section
class AuthConfig:
    """Shared bearer token for calls that change weights or data; empty disables the check."""

    token: str = ""  # the token itself (prefer token_env)
    token_env: str = "DOCKRL_TOKEN"  # read when `token` is empty


@config_section
class InitModelConfig:
    """A tiny Qwen2-layout (or Qwen MoE) model built locally (`dockrl init-model`)."""

    architecture: Literal["qwen2", "qwen2_moe", "qwen3_moe"] = "qwen2"  # qwen2 (dense) | qwen2_moe (routed experts + a sigmoid-gated shared expert) | qwen3_moe (routed experts, q/k norm)
    hidden_size: int = 128  # model width
    num_layers: int = 2  # transformer layers
    num_attention_heads: int = 4  # query heads (hidden_size / heads must be a vLLM CPU head_dim)
    num_key_value_heads: int = 2  # KV heads (GQA)
    intermediate_size: int = 384  # SwiGLU hidden size
    num_experts: int = 4  # MoE architectures: routed experts per layer
    num_experts_per_tok: int = 2  # MoE architectures: experts each token is routed to (top-k)
    moe_intermediate_size: int = 96  # MoE architectures: each routed expert's SwiGLU hidden size
    shared_expert_intermediate_size: int = 192  # qwen2_moe: the shared expert's SwiGLU hidden size
    max_position_embeddings: int = 512  # RoPE positions
    tie_word_embeddings: bool = False  # share input embedding and output layer
    seed: int = 0  # random seed
    prompt_type: str = "empty"  # chat template stored with the tokenizer
    warm_start_accuracy: Share = 0.0  # SFT until this share of greedy answers is right, boxed or not; 0 skips the warm start
    warm_start_max_steps: int = 2000  # SFT step limit
    warm_start_boxed_fraction: Share = 1.0  # share of SFT targets written as `\\boxed{answer}`; the rest give the bare answer
    reward_fit_steps: NonNegativeInt = 20  # fit steps of the tiny reward model `prepare` builds where reward_config.load holds none (0: random head)


@config_section
class ArithmeticConfig:
    """The generated arithmetic dataset of the demo (`a op b=` -> `\\boxed{answer}`)."""

    out_dir: str = "runs/data"  # raw train.jsonl / test.jsonl land here
    max_operand: int = 9  # operands in [0, max_operand]
    ops: tuple[str, ...] = ("+",)  # operators: + - *
    test_fraction: Share = 0.2  # share of problems held out from RL (the warm start sees every problem)
    seed: int = 0  # shuffle seed


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
    auth: AuthConfig = field(default_factory=AuthConfig)
    profiler_config: ProfilerRoles = field(default_factory=ProfilerRoles)
    init_model: InitModelConfig | None = None
    arithmetic: ArithmeticConfig | None = None

    @property
    def samples_per_iteration(self) -> int:
        """GBS * n: rows the dock holds for one iteration."""
        return self.megatron_training.global_batch_size * self.rl_config.n_samples_per_prompt

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


# ---------------------------------------------------------------- parsing


# ---------------------------------------------------------------- validation


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # rl_config.loss_agg_mode, verl's names


def _check_choice(errors: list[str], path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        errors.append(f"{path}: {value!r} is not one of {', '.join(choices)}")


def _check_positive(errors: list[str], path: str, value: int | float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        errors.append(f"{path}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe")
# rl_config.verifier_function's names: the reward service's rule verifiers (services/reward/verifiers.py, whose
# registry a test keeps equal to this) and REWARD_MODEL, reward_config's model
RULE_VERIFIERS = ("format", "strict_format", "base_acc", "acc", "math_17k_acc", "acc_for_ppo", "math_verify",
                  "math_verify_reward", "acc_for_dapo", "step")
REWARD_MODEL = "reward_model"


def _validate_init_model_moe(init: InitModelConfig, errors: list[str]) -> None:
    """init_model's architecture and its MoE sizes; an MoE key set for a model that has no such part is an error."""
    default = InitModelConfig()
    unused = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    if init.architecture in MOE_ARCHITECTURES:
        unused = ["shared_expert_intermediate_size"] if init.architecture == "qwen3_moe" else []
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            _check_positive(errors, f"init_model.{key}", getattr(init, key))
        if init.num_experts_per_tok > init.num_experts:
            errors.append(f"init_model.num_experts_per_tok: {init.num_experts_per_tok} is more than num_experts {init.num_experts}")
    for key in unused:
        if getattr(init, key) != getattr(default, key):
            errors.append(f"init_model.{key}: {getattr(init, key)!r} has no effect on architecture {init.architecture!r}; remove it")


def _check_sentinel_keys(dock: DockConfig, errors: list[str]) -> None:
    """The keys of a dock behind Redis Sentinel and of replica-acknowledged writes: each set only where it has an effect."""
    if dock.min_replicas_acked and dock.replica_ack_timeout_s >= dock.socket_timeout_s:
        errors.append(f"dock.replica_ack_timeout_s: {dock.replica_ack_timeout_s} must be below dock.socket_timeout_s "
                      f"{dock.socket_timeout_s} (the WAIT for replicas holds the connection's reply that long)")
    if dock.min_replicas_acked and dock.redis_cluster:
        errors.append("dock.min_replicas_acked: not supported with dock.redis_cluster (WAIT has no key to route it to the run's "
                      "node); set 0, or run the dock on one Redis or behind dock.redis_sentinels")
    if not dock.redis_sentinels:
        if dock.redis_sentinel_master:
            errors.append("dock.redis_sentinel_master: set without dock.redis_sentinels, where it has no effect; "
                          "list the sentinels (host:port) or remove it")
        return
    for i, address in enumerate(dock.redis_sentinels):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            errors.append(f"dock.redis_sentinels[{i}]: {address!r} is not host:port")
    if not dock.redis_sentinel_master:
        errors.append("dock.redis_sentinel_master: empty; give the master name the sentinels monitor (`sentinel monitor NAME ...`)")
    if dock.redis_url:
        errors.append(f"dock.redis_url: {dock.redis_url!r} set together with dock.redis_sentinels; the sentinels name the "
                      "primary, so leave redis_url empty")
    if dock.redis_cluster:
        errors.append("dock.redis_cluster: cannot be true with dock.redis_sentinels (a cluster fails over by itself)")
    if dock.redis_tls:
        errors.append("dock.redis_tls: not supported with dock.redis_sentinels yet (the sentinel connections would need "
                      "their own TLS settings); use one of the two")


def _derive_dispatch_sizes(cfg: Config, errors: list[str]) -> Config:
    """Fills unset *_dispatch_size keys as MindSpeed-RL does: GBS * n / data-parallel size.

    Only the rollout and reward consumers claim by dispatch size: the trainer takes each iteration's
    GBS x n rows in one claim, so MindSpeed-RL's actor_logprob, ref, adv and actor_update sizes have
    no counterpart (a MindSpeed-RL layout file's are dropped with that reason)."""
    rl = cfg.rl_config
    total = cfg.samples_per_iteration
    rollout_dp = cfg.rollout.replicas
    n = rl.n_samples_per_prompt
    derived = {
        "actor_rollout_dispatch_size": (rl.actor_rollout_dispatch_size, rollout_dp),
        "reward_dispatch_size": (rl.reward_dispatch_size, 1),
    }
    values = {}
    for key, (given, dp) in derived.items():
        if given is None:
            if total % dp:
                errors.append(
                    f"rl_config.{key}: global_batch_size * n_samples_per_prompt = {total} is not divisible "
                    f"by the data-parallel size {dp}; set {key} explicitly"
                )
                given = max(n, total // dp)
            else:
                given = total // dp
        values[key] = given
        _check_positive(errors, f"rl_config.{key}", given)
        if given and given % n:
            errors.append(f"rl_config.{key}: {given} is not a multiple of n_samples_per_prompt={n} (groups travel whole)")
    if rl.mini_batch_size is None:
        values["mini_batch_size"] = total
    return dataclasses.replace(cfg, rl_config=dataclasses.replace(rl, **values))


def _validate_context_parallel(cfg: Config, errors: list[str]) -> None:
    """megatron_training.context_parallel_*: the algorithms built, and what context parallel cannot be combined with yet.

    The attention heads a TP rank holds are checked against Ulysses when the model is built (they are in its config.json).
    """
    mt, cp = cfg.megatron_training, cfg.megatron_training.context_parallel_size
    _validate_ulysses_degree(mt, errors)
    if cp <= 1:
        return
    if mt.seq_length % (2 * cp):
        errors.append(f"megatron_training.seq_length: {mt.seq_length} is not a multiple of 2 * context_parallel_size = {2 * cp} "
                      "(each sequence is padded to a multiple of it and split into that many chunks)")


def _validate_ulysses_degree(mt: MegatronTrainingConfig, errors: list[str]) -> None:
    """megatron_training.ulysses_degree_in_cp: hybrid_cp_algo's Ulysses groups, U consecutive CP ranks, the ring across
    the R = CP / U groups. U = 1 would be the ring alone and R = 1 Ulysses alone, which the other two algorithms are."""
    key, u, cp = "megatron_training.ulysses_degree_in_cp", mt.ulysses_degree_in_cp, mt.context_parallel_size
    if mt.context_parallel_algo != "hybrid_cp_algo":
        if u is not None:
            errors.append(f"{key}: {u} is read by context_parallel_algo hybrid_cp_algo only, not {mt.context_parallel_algo}; "
                          "set it null")
        return
    if u is None:
        if cp > 1:
            errors.append(f"{key}: hybrid_cp_algo needs it (the CP ranks of one Ulysses group, a divisor of "
                          f"context_parallel_size {cp} with both it and the quotient >= 2)")
        return
    if u < 2:
        errors.append(f"{key}: {u}; hybrid_cp_algo needs Ulysses groups of at least 2 ranks (with 1 use megatron_cp_algo)")
    elif cp % u:
        errors.append(f"{key}: {u} does not divide context_parallel_size {cp}")
    elif cp // u < 2:
        errors.append(f"{key}: {u} leaves a ring of {cp // u} group(s) out of context_parallel_size {cp}; hybrid_cp_algo "
                      "needs at least 2 (with Ulysses over every CP rank use ulysses_cp_algo)")


def _validate_virtual_pipeline(cfg: Config, errors: list[str]) -> None:
    """megatron_training.virtual_pipeline_model_parallel_size: what megatron-core 0.16.1's interleaved schedule needs.

    num_hidden_layers a multiple of PP x VPP is checked when the model is built (it is in the model's config.json).
    """
    mt, rl, vpp = cfg.megatron_training, cfg.rl_config, cfg.megatron_training.virtual_pipeline_model_parallel_size
    if vpp is None:
        return
    key, pp = "megatron_training.virtual_pipeline_model_parallel_size", mt.pipeline_model_parallel_size
    if vpp < 2:
        errors.append(f"{key}: {vpp}; use at least 2 chunks per stage, or null for the non-interleaved schedule")
    if pp < 2:
        errors.append(f"{key}: the interleaved schedule needs pipeline_model_parallel_size >= 2, got {pp}")
    if mt.context_parallel_size > 1:
        errors.append(f"{key}: not built with context_parallel_size > 1 (the schedule's one activation shape would have to "
                      "pad each CP rank's share); set one of them to 1 (or null)")
    mini = rl.mini_batch_size or cfg.samples_per_iteration
    if rl.use_dynamic_bsz:
        # Token-budget micro-batches are cut until their count is a multiple of PP (logprobs.micro_batches), which a
        # rank's rows of a mini-batch always allow when they are a multiple of PP themselves.
        if not rl.use_remove_padding:
            errors.append(f"{key}: with rl_config.use_dynamic_bsz the interleaved schedule pads every micro-batch to the "
                          "tallest and widest of them, past max_packing_token_size; set rl_config.use_remove_padding true "
                          "(packed micro-batches stay within it)")
        rows = mini // cfg.actor_data_parallel_size
        if pp >= 2 and rows % pp:
            errors.append(f"{key}: with rl_config.use_dynamic_bsz each rank's rows of a mini-batch must be a multiple of "
                          f"pipeline_model_parallel_size {pp}; rl_config.mini_batch_size {mini} / data-parallel size "
                          f"{cfg.actor_data_parallel_size} = {rows}")
        return
    per_rank = mt.micro_batch_size * cfg.actor_data_parallel_size
    # A mini-batch that is not a multiple of micro_batch_size x DP is reported by rl_config.mini_batch_size's own check.
    if pp >= 2 and mini % per_rank == 0 and (mini // per_rank) % pp:
        errors.append(f"{key}: the interleaved schedule needs the micro-batches of a mini-batch a multiple of "
                      f"pipeline_model_parallel_size {pp}; rl_config.mini_batch_size {mini} / (micro_batch_size "
                      f"{mt.micro_batch_size} x data-parallel size {cfg.actor_data_parallel_size}) = {mini // per_rank}")


def _validate(cfg: Config, errors: list[str]) -> None:
    """The checks that span several keys (each key's own range or choices sit beside it, checked as it is read)."""
    mt, rl, gen, smp = cfg.megatron_training, cfg.rl_config, cfg.generate_config, cfg.generate_config.sampling_config
    if 0 < mt.critic_lr < mt.min_lr:
        errors.append(f"megatron_training.critic_lr: {mt.critic_lr!r} is below megatron_training.min_lr {mt.min_lr!r}")
    if smp.top_k == 0 or smp.top_k < -1:
        errors.append(f"generate_config.sampling_config.top_k: must be -1 (off) or >= 1, got {smp.top_k!r}")
    if gen.expert_map_path and not gen.enforce_eager:
        errors.append("generate_config.expert_map_path: needs generate_config.enforce_eager: true; vLLM's compiled model "
                      "(torch.compile, CUDA graphs) skips the router hook that counts the tokens the map's imbalance is of")
    if rl.loss_agg_mode:
        _check_choice(errors, "rl_config.loss_agg_mode", rl.loss_agg_mode, LOSS_AGG_MODES)
        if rl.loss_agg_mode == "token-mean" and not rl.token_level_loss:
            errors.append("rl_config.loss_agg_mode: token-mean contradicts token_level_loss: false; set one of them")
    if rl.kl_ctrl_type == "adaptive":
        if rl.init_kl_coef <= 0:
            errors.append(f"rl_config.init_kl_coef: the adaptive KL controller scales the coefficient, so it needs one > 0, got {rl.init_kl_coef!r}")
        if rl.kl_target <= 0:
            errors.append(f"rl_config.kl_target: must be > 0 for kl_ctrl_type adaptive, got {rl.kl_target!r}")
        if rl.kl_horizon < 1:
            errors.append(f"rl_config.kl_horizon: must be >= 1 for kl_ctrl_type adaptive, got {rl.kl_horizon!r}")
    if not 0 <= rl.clip_ratio < 1:
        errors.append(f"rl_config.clip_ratio: must be in [0, 1), got {rl.clip_ratio!r}")
    if rl.clip_ratio_c <= 1:
        errors.append(f"rl_config.clip_ratio_c: the dual-clip bound must be > 1, got {rl.clip_ratio_c!r}")
    if rl.rollout_max_tokens != smp.max_tokens:
        errors.append(
            f"rl_config.rollout_max_tokens: {rl.rollout_max_tokens} != generate_config.sampling_config.max_tokens "
            f"{smp.max_tokens}; the overlong penalty and the rollout budget must agree (set both to one value)"
        )
    if rl.max_prompt_length + smp.max_tokens > gen.max_model_len:
        errors.append(
            f"generate_config.max_model_len: {gen.max_model_len} < rl_config.max_prompt_length + "
            f"sampling_config.max_tokens = {rl.max_prompt_length + smp.max_tokens}"
        )
    if rl.guarantee_order and rl.partial_rollout_max_split > 1:
        errors.append(
            "rl_config.guarantee_order: cannot be true with partial_rollout_max_split > 1 "
            "(partial rollout serves the oldest groups first, which reorders rows)"
        )
    if rl.partial_rollout_max_split > 1 and smp.max_tokens % rl.partial_rollout_max_split:
        errors.append(
            f"rl_config.partial_rollout_max_split: {rl.partial_rollout_max_split} does not divide "
            f"sampling_config.max_tokens {smp.max_tokens}"
        )
    if len(rl.verifier_function) != len(rl.verifier_weight):
        errors.append(
            f"rl_config.verifier_weight: {len(rl.verifier_weight)} weights for "
            f"{len(rl.verifier_function)} verifier_function entries; give one weight per verifier"
        )
    unknown = [name for name in rl.verifier_function if name not in RULE_VERIFIERS + (REWARD_MODEL,)]
    if unknown:
        errors.append(f"rl_config.verifier_function: {', '.join(map(repr, unknown))} is not a verifier; the verifiers: "
                      f"{', '.join(RULE_VERIFIERS)}, and {REWARD_MODEL} (reward_config's model)")
    if "reward_model" in rl.verifier_function and not cfg.reward_config.load:
        errors.append("rl_config.verifier_function: reward_model is listed but reward_config.load is empty; "
                      "give the reward model's directory (dockrl init-model --reward builds a tiny one)")
    if rl.overlong_buffer_enable and not 0 < rl.overlong_buffer < rl.rollout_max_tokens:
        errors.append(
            f"rl_config.overlong_buffer: must be in (0, rollout_max_tokens={rl.rollout_max_tokens}) "
            f"when overlong_buffer_enable is true, got {rl.overlong_buffer}"
        )
    if rl.use_kl_in_reward and rl.adv_estimator == "group_norm":
        errors.append("rl_config.use_kl_in_reward: group_norm advantages normalise each group's rewards, so a KL subtracted "
                      "from them does not reach the update; use adv_estimator: gae, or the KL in the loss (use_kl_in_reward: false)")
    if rl.filter_groups_max_batches == 0 or rl.filter_groups_max_batches < -1:
        errors.append(f"rl_config.filter_groups_max_batches: must be -1 (no limit) or >= 1, got {rl.filter_groups_max_batches}")
    if rl.use_wandb and not rl.wandb_project:
        errors.append("rl_config.wandb_project: required with rl_config.use_wandb (the W&B project the run logs to)")
    if rl.behav_imp_weight_cap and rl.behav_imp_weight_cap <= 1:
        errors.append(f"rl_config.behav_imp_weight_cap: must be 0 (no cap) or > 1, got {rl.behav_imp_weight_cap!r}")
    if rl.behav_imp_weight_cap and not rl.use_decoupled_loss:
        errors.append("rl_config.behav_imp_weight_cap: caps the decoupled loss's behaviour weight; set rl_config.use_decoupled_loss: true "
                      "or leave it 0")
    if rl.clip_higher_enable and rl.clip_ratio_high < rl.clip_ratio_low:
        errors.append(f"rl_config.clip_ratio_high: {rl.clip_ratio_high} < clip_ratio_low {rl.clip_ratio_low}")
    if rl.adv_estimator == "group_norm" and rl.n_samples_per_prompt < 2:
        errors.append("rl_config.n_samples_per_prompt: group_norm advantages need at least 2 samples per prompt")
    ep = mt.expert_model_parallel_size
    tp_pp = mt.tensor_model_parallel_size * mt.pipeline_model_parallel_size
    if ep > 1 and rl.actor_resource.num_npus % (tp_pp * ep):
        errors.append(
            f"megatron_training.expert_model_parallel_size: {ep} expert-parallel ranks x tensor_model_parallel_size x "
            f"pipeline_model_parallel_size = {tp_pp * ep} does not divide rl_config.actor_resource.num_npus {rl.actor_resource.num_npus}"
        )
    mp = tp_pp * mt.context_parallel_size
    if mp > 0 and rl.actor_resource.num_npus % mp:
        errors.append(
            f"rl_config.actor_resource.num_npus: {rl.actor_resource.num_npus} is not a multiple of "
            f"tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size = {mp}"
        )
    _validate_context_parallel(cfg, errors)
    _validate_routing_replay(cfg, errors)
    _validate_virtual_pipeline(cfg, errors)
    if rl.mini_batch_size is not None:
        total = cfg.samples_per_iteration
        if rl.mini_batch_size <= 0 or total % rl.mini_batch_size:
            errors.append(
                f"rl_config.mini_batch_size: {rl.mini_batch_size} must divide global_batch_size * "
                f"n_samples_per_prompt = {total}"
            )
        elif rl.mini_batch_size % (mt.micro_batch_size * cfg.actor_data_parallel_size):
            errors.append(
                f"rl_config.mini_batch_size: {rl.mini_batch_size} is not a multiple of micro_batch_size * "
                f"data-parallel size = {mt.micro_batch_size * cfg.actor_data_parallel_size}"
            )
    admitted_groups = (rl.max_staleness + 1) * mt.global_batch_size  # without the partial-rollout carry-over, which may wait
    if cfg.dock.capacity_groups and cfg.dock.capacity_groups < admitted_groups:
        errors.append(
            f"dock.capacity_groups: {cfg.dock.capacity_groups} < (rl_config.max_staleness + 1) * megatron_training.global_batch_size "
            f"= {admitted_groups}; the pool must hold the groups the trainer admits (or 0 for the default)"
        )
    if cfg.init_model is not None:
        _validate_init_model_moe(cfg.init_model, errors)
    if cfg.reward_config.model_replicas > 0:
        if "reward_model" not in rl.verifier_function:
            errors.append(f"reward_config.model_replicas: {cfg.reward_config.model_replicas} reward-model replicas would have "
                          "nothing to score: rl_config.verifier_function does not list reward_model (add it, or set 0)")
        elif set(rl.verifier_function) == {"reward_model"}:
            errors.append("reward_config.model_replicas: rl_config.verifier_function lists only reward_model, so the reward "
                          "replicas already score nothing else; set 0 and scale reward.replicas instead")
    _check_sentinel_keys(cfg.dock, errors)
    for role in ("trainer", "rollout", "reward"):
        _validate_profiler(getattr(cfg.profiler_config, role), f"profiler_config.{role}", errors)
        if role != "trainer" and getattr(cfg.profiler_config, role).profile_ranks != "all":
            errors.append(f"profiler_config.{role}.profile_ranks: {role} replicas have no rank; set all "
                          "(each replica writes its traces in its own directory)")
    for path, value in (("dock.prefix", cfg.dock.prefix), ("dock.run_id", cfg.dock.run_id), ("dock.rollout_consumer", cfg.dock.rollout_consumer)):
        if not value or ":" in value or "*" in value:
            errors.append(f"{path}: {value!r} must be non-empty without ':' or '*' (it is part of Redis key names)")


def _validate_routing_replay(cfg: Config, errors: list[str]) -> None:
    """What rl_config.routing_replay needs from the rollout (docs/moe.md)."""
    if not cfg.rl_config.routing_replay:
        return
    gen = cfg.generate_config
    if not gen.enforce_eager:
        errors.append("rl_config.routing_replay: needs generate_config.enforce_eager: true; vLLM's compiled model "
                      "(torch.compile, CUDA graphs) skips the router hook that records the routed experts")
    if gen.enable_prefix_caching:
        errors.append("rl_config.routing_replay: needs generate_config.enable_prefix_caching: false; prompt tokens found "
                      "in the prefix cache are never computed, so their routing would be missing from the record")
    if (cfg.megatron_training.virtual_pipeline_model_parallel_size or 1) > 1:
        errors.append("rl_config.routing_replay: not built with megatron_training.virtual_pipeline_model_parallel_size "
                      "(the interleaved schedule pads every micro-batch to one shape, which the replayed routing would have to follow)")


def _validate_profiler(pc: ProfilerConfig, path: str, errors: list[str]) -> None:
    """Refuses the profiler_config values that name torch_npu's features (dockrl profiles with torch.profiler)."""
    if pc.mstx:
        errors.append(f"{path}.mstx: Ascend's mstx marks are not built; the trace names each stage already (set false)")
    if pc.profile_analysis:
        errors.append(f"{path}.profile_analysis: torch_npu's analysis is not built; the Chrome traces open as written (set false)")
    if pc.profile_level != "level0":
        errors.append(f"{path}.profile_level: {pc.profile_level!r}: the levels are torch_npu's and torch.profiler has none; "
                      "choose the detail with profile_with_cpu / profile_with_memory / profile_record_shapes / "
                      "profile_with_module (or leave level0)")
    if pc.profile_step_start < 1 or pc.profile_step_end <= pc.profile_step_start:
        errors.append(f"{path}.profile_step_end: steps {pc.profile_step_start} .. {pc.profile_step_end} (end excluded) "
                      "profile nothing; need 1 <= profile_step_start < profile_step_end")
    if isinstance(pc.profile_ranks, str) and pc.profile_ranks != "all":
        errors.append(f"{path}.profile_ranks: {pc.profile_ranks!r} is not 'all' or a list of ranks")
    if pc.profile and not (pc.profile_with_cpu or pc.profile_with_npu):
        errors.append(f"{path}.profile_with_cpu: with profile_with_npu false too the profiler records nothing")


# ---------------------------------------------------------------- public API


def _apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError([f"--set {override!r}: expected section.key=value"])
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError([f"{key}: {part} is not a section"])
    # `key=` means the empty string (YAML would read it as null).
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def parse_dataclass(cls: type, data: dict, path: str = ""):
    """Builds any config section (`config_section`) from a mapping with the same checks as the run config."""
    if not isinstance(data, dict):
        raise ConfigError([f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}"])
    value, errors = parse_section(cls, data, path)
    if errors:
        raise ConfigError(errors)
    return value


def config_from_dict(data: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds and validates a Config from a parsed YAML mapping plus `section.key=value` overrides."""
    data = dict(data or {})
    for override in overrides:
        _apply_override(data, override)
    cfg, errors = parse_section(Config, data)
    if not errors:
        cfg = _derive_dispatch_sizes(cfg, errors)
        _validate(cfg, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


ENV_PREFIX = "DOCKRL__"


def env_overrides(environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """`DOCKRL__SECTION__KEY=value` environment variables as `section.key=value` overrides.

    Containers configure services this way (compose, Kubernetes); sections nest with `__`.
    """
    environ = os.environ if environ is None else environ
    return [
        f"{name[len(ENV_PREFIX):].lower().replace('__', '.')}={value}"
        for name, value in sorted(environ.items())
        if name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX)
    ]


def load_config(path: str | pathlib.Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Loads a YAML config file (default: the embedded tiny CPU config).

    Precedence: the file, then `DOCKRL__SECTION__KEY` environment variables, then `overrides`.
    """
    return config_from_translation(read_config_file(path), [*env_overrides(), *overrides])


def config_from_translation(translation: Translation, overrides: typing.Sequence[str] = ()) -> Config:
    """Builds and validates the Config a read file (`read_config_file`) describes, logging each MindSpeed-RL
    layout change; the translation's errors and the config's are reported together."""
    for change in translation.changes:
        log.info("MindSpeed-RL layout: %s", change)
    try:
        cfg = config_from_dict(translation.data, overrides)
    except ConfigError as exc:
        raise ConfigError([*translation.errors, *exc.errors]) from None
    if translation.errors:
        raise ConfigError(translation.errors)
    return cfg


def read_config_file(path: str | pathlib.Path | None = None) -> Translation:
    """The YAML at `path` (default: the embedded tiny CPU config) in dockrl's layout: a file in MindSpeed-RL's
    layout comes back translated, with its changes and the keys that cannot run (docs/config.md)."""
    path = pathlib.Path(path) if path else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such config file"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections"])
    return load_translated(data or {}, path)


def config_to_dict(cfg: Config) -> dict:
    """The config as plain data (for logs and for passing to child processes as YAML)."""
    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value
    return plain(dataclasses.asdict(cfg))
