"""The locally built tiny model: loadable by transformers, deterministic, vLLM-compatible shape."""
import json

import pytest
import torch

from services.common.config import InitModelConfig
from services.common.tiny_model import build_tiny_model


def test_tiny_model_loads_and_is_deterministic(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = build_tiny_model(tmp_path / "again")
    a, b = load_file(tiny_model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = build_tiny_model(tmp_path / "other", InitModelConfig(seed=1))
    assert not torch.equal(a["model.embed_tokens.weight"], load_file(other / "model.safetensors")["model.embed_tokens.weight"])

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "12+30=42, ünïcode \\boxed{7}"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]) == [256, 258]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    logits = model(torch.tensor([tok("1+2=")["input_ids"]])).logits
    assert logits.shape[-1] == cfg["vocab_size"] and torch.isfinite(logits).all()


def test_unsupported_head_dim_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim 16"):
        build_tiny_model(tmp_path / "m", InitModelConfig(hidden_size=64, num_attention_heads=4))


@pytest.mark.parametrize("architecture,hf_name", [("qwen2_moe", "Qwen2MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_init_model_builds_a_tiny_moe_model(tmp_path, architecture, hf_name):
    from transformers import AutoModelForCausalLM

    from services.cli import main

    assert main(["init-model", "--out", str(tmp_path / "m"), "--set", f"init_model.architecture={architecture}"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == [hf_name] and cfg["num_experts_per_tok"] == 2
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.num_experts == 4 and torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
