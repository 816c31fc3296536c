"""The Qwen2-layout model the rollout benchmarks build: the tiny one, or wider/deeper with head_dim 64."""
from __future__ import annotations

import pathlib

TINY_HIDDEN = 128


def build_bench_model(out_dir: pathlib.Path, hidden: int, layers: int) -> pathlib.Path:
    """The tiny model for hidden=128 (InitModelConfig defaults), else `layers` x `hidden` with head_dim 64."""
    from services.common.config import InitModelConfig
    from services.common.tiny_model import build_tiny_model

    if hidden == TINY_HIDDEN:
        return build_tiny_model(out_dir, InitModelConfig(num_layers=layers))
    cfg = InitModelConfig(hidden_size=hidden, num_layers=layers, num_attention_heads=hidden // 64,
                          num_key_value_heads=max(1, hidden // 128), intermediate_size=3 * hidden)
    return build_tiny_model(out_dir, cfg)
