"""The trainer's sections: its model, data and optimiser (megatron_training) and its service (trainer)."""
from __future__ import annotations

from typing import Literal

from services.common.config.types import NonNegativeFloat, Port, PositiveFloat, PositiveInt, config_section


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
