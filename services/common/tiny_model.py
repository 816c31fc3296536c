"""A tiny Qwen2-layout (or Qwen3, Qwen2-MoE, Qwen3-MoE) Hugging Face checkpoint and a byte-level tokenizer, built locally.

No weights can be downloaded on the machines this project targets, so tests and the demo build
their model here, deterministically for a seed. head_dim = hidden_size / num_attention_heads must
be one vLLM's CPU attention supports (32, 64, 128...; 16 is refused).
"""
from __future__ import annotations

import json
import pathlib

from services.common.config import ArithmeticConfig, InitModelConfig
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
                     vocab_size: int = 0, reward: bool = False) -> pathlib.Path:
    """Builds a randomly initialised model of `cfg.architecture` (Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) and its tokenizer under `out_dir`.

    `vocab_size` (0: the tokenizer's, padded to 64) gives the embedding a real model's size, e.g.
    for benchmarks; ids past the tokenizer's are valid token ids without text. `reward` builds a
    reward model instead: Qwen2ForSequenceClassification with one label, a scalar head on the last
    token (what vLLM's pooling runner and Hugging Face both read), dense whatever `cfg.architecture`
    says; `fit_reward_model` trains it.
    """
    import torch
    import transformers
    from transformers import Qwen2ForSequenceClassification

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
    architecture = "qwen2" if reward else cfg.architecture
    config = _hf_config(
        cfg, architecture,
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
        pad_token_id=eos_id + 3,  # also how Hugging Face's sequence classifier finds the last real token
        torch_dtype="float32",
        **({"num_labels": 1} if reward else {}),
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForSequenceClassification(config) if reward else getattr(transformers, _CAUSAL_LM[architecture])(config)
    model.save_pretrained(str(out), safe_serialization=True)
    if reward:
        return out
    # <|im_end|> ends a chat turn, so generation stops at either special token.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id, eos_id + 2], "pad_token_id": eos_id + 3}))
    return out


_CAUSAL_LM = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _hf_config(cfg: InitModelConfig, architecture: str, **common):
    """The transformers config of `architecture` with the shared fields `common` and cfg's MoE sizes."""
    from transformers import Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    if architecture == "qwen2":
        return Qwen2Config(**common)
    if architecture == "qwen3":  # Qwen3-0.6B's shape of layer: q/k RMSNorm, no attention bias, head_dim explicit
        return Qwen3Config(**common, head_dim=cfg.hidden_size // cfg.num_attention_heads, attention_bias=False)
    moe = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
               decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
    if architecture == "qwen2_moe":  # Qwen1.5-MoE's routing: top-k of the softmax, not renormalised
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, norm_topk_prob=False)
    # Qwen3-MoE (Qwen3-30B-A3B's routing: top-k renormalised), head_dim explicit as in its configs
    return Qwen3MoeConfig(**common, **moe, head_dim=cfg.hidden_size // cfg.num_attention_heads, norm_topk_prob=True)


def reward_examples(spec: ArithmeticConfig = ArithmeticConfig()) -> list[tuple[str, float]]:
    """(prompt + response text, target) pairs on the arithmetic demo: every problem with its right
    answer and two wrong ones, each boxed and bare; target 1 for the right answer, else 0."""
    from services.common.arithmetic_data import arithmetic_problems

    examples = []
    for p in arithmetic_problems(spec).all:
        right = int(p["answer"])
        for answer, target in ((right, 1.0), (right + 1, 0.0), (right - 2, 0.0)):
            examples += [(f"{p['problem']}\\boxed{{{answer}}}", target), (f"{p['problem']}{answer}", target)]
    return examples


def fit_reward_model(model_dir: str | pathlib.Path, steps: int, spec: ArithmeticConfig = ArithmeticConfig(),
                     seed: int = 0, batch_size: int = 64, lr: float = 1e-3) -> float:
    """Trains the reward model in `model_dir` in place for `steps` AdamW steps (logistic loss on
    `reward_examples`), so its score rises with correctness; returns the share of (right, wrong)
    boxed answers to one problem that it ranks right (0.5: no better than chance)."""
    import random

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    examples = reward_examples(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        texts, targets = zip(*rng.sample(examples, min(batch_size, len(examples))))
        enc = tok(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
        logits = model(**enc).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(targets))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    boxed = [text for text, _ in examples if "boxed" in text]  # per problem: right, right + 1, right - 2
    with torch.no_grad():
        enc = tok(boxed, return_tensors="pt", padding=True, add_special_tokens=False)
        scores = model(**enc).logits[:, 0].view(-1, 3)
    return float((scores[:, :1] > scores[:, 1:]).float().mean())
