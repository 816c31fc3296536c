"""A tiny Qwen2-layout Hugging Face checkpoint and a byte-level tokenizer, built locally.

No weights can be downloaded on the machines this project targets, so tests and the demo build
their model here, deterministically for a seed. head_dim = hidden_size / num_attention_heads must
be one vLLM's CPU attention supports (32, 64, 128...; 16 is refused).
"""
from __future__ import annotations

import json
import pathlib

from services.common.config import InitModelConfig
from services.common.templates import load_templates

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
SUPPORTED_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 256)


def build_tokenizer(out_dir: pathlib.Path, chat_template: str) -> int:
    """Writes a byte-level tokenizer (256 byte tokens + specials) to `out_dir`; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return len(fast)


def build_tiny_model(out_dir: str | pathlib.Path, cfg: InitModelConfig = InitModelConfig(), prompt_type: str = "qwen",
                     vocab_size: int = 0) -> pathlib.Path:
    """Builds a randomly initialised Qwen2-layout model and its tokenizer under `out_dir`.

    `vocab_size` (0: the tokenizer's, padded to 64) gives the embedding a real model's size, e.g.
    for benchmarks; ids past the tokenizer's are valid token ids without text.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    head_dim, rem = divmod(cfg.hidden_size, cfg.num_attention_heads)
    if rem or head_dim not in SUPPORTED_CPU_HEAD_DIMS:
        raise ValueError(
            f"init_model.num_attention_heads: hidden_size {cfg.hidden_size} / {cfg.num_attention_heads} heads "
            f"gives head_dim {cfg.hidden_size / cfg.num_attention_heads}; vLLM on CPU needs one of {SUPPORTED_CPU_HEAD_DIMS}"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError("init_model.num_key_value_heads: must divide num_attention_heads")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, load_templates()[prompt_type])
    padded_vocab = -(-vocab // 64) * 64  # divisible by common TP sizes, as Megatron pads
    if vocab_size and vocab_size < padded_vocab:
        raise ValueError(f"vocab_size: {vocab_size} is smaller than the tokenizer's {padded_vocab} tokens")
    padded_vocab = vocab_size or padded_vocab
    eos_id = 256  # the first special token follows the 256 byte tokens
    config = Qwen2Config(
        vocab_size=padded_vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id + 3,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    # <|im_end|> ends a chat turn, so generation stops at either special token.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id, eos_id + 2], "pad_token_id": eos_id + 3}))
    return out
