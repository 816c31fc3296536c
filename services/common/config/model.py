"""The tiny model (init_model) and the arithmetic dataset (arithmetic) the demo builds locally."""
from __future__ import annotations

from typing import Literal

from services.common.config.types import NonNegativeInt, Share, config_section

MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe")


@config_section
class InitModelConfig:
    """A tiny Qwen2-layout (or Qwen MoE) model built locally (`dockrl init-model`)."""

    architecture: Literal["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"] = "qwen2"  # qwen2 (dense, QKV bias) | qwen3 (dense, q/k norm, no bias) | qwen2_moe (routed experts + a sigmoid-gated shared expert) | qwen3_moe (routed experts, q/k norm)
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
    warm_start_accuracy: Share = 0.0  # SFT until this share of greedy answers is right, boxed or not (with warm_start_tool_share: of episodes made to call the tool, right and boxed); 0 skips the warm start
    warm_start_max_steps: int = 2000  # SFT step limit
    warm_start_boxed_fraction: Share = 1.0  # share of SFT targets written as `\\boxed{answer}`; the rest give the bare answer
    warm_start_tool_share: Share = 0.0  # share of SFT targets that are a whole episode calling the calculator (rollout.multi_turn's tag format: the call, the tool's response masked out, the boxed answer); needs the "tools" environment
    reward_fit_steps: NonNegativeInt = 20  # fit steps of the tiny reward model `prepare` builds where reward_config.load holds none (0: random head)


@config_section
class ArithmeticConfig:
    """The generated arithmetic dataset of the demo (`a op b=` -> `\\boxed{answer}`)."""

    out_dir: str = "runs/data"  # raw train.jsonl / test.jsonl land here
    min_operand: NonNegativeInt = 0  # operands in [min_operand, max_operand] (10: two-digit operands with max_operand 99)
    max_operand: int = 9  # operands in [min_operand, max_operand]
    ops: tuple[str, ...] = ("+",)  # operators: + - *
    test_fraction: Share = 0.2  # share of problems held out from RL (the warm start sees every problem)
    seed: int = 0  # shuffle seed
