"""A short supervised warm start of the tiny model, so that RL starts with signal but headroom.

The demo's model is random at birth; RL on a random model never sees a reward. This trains it
on the train split (prompt -> `\\boxed{answer}`) and stops as soon as greedy accuracy on a probe
of the train split reaches `target_accuracy`, leaving the rest for RL to earn.
"""
from __future__ import annotations

import logging
import pathlib
import random
import time
from dataclasses import dataclass

logger = logging.getLogger("dockrl.warm_start")


@dataclass(frozen=True)
class WarmStartSpec:
    """How long and how hard to warm start."""

    target_accuracy: float = 0.4  # stop once greedy train-probe accuracy reaches this
    max_steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    eval_every: int = 25
    seed: int = 0
    threads: int = 2


def format_response(answer: str) -> str:
    """The response the demo's verifier scores: the answer in a LaTeX box."""
    return f"\\boxed{{{answer}}}"


def greedy_accuracy(model, tokenizer, problems: list[dict], max_new_tokens: int = 12) -> float:
    """Share of `problems` whose greedy response, boxed answer included, equals the expected one."""
    import torch

    tokenizer.padding_side = "left"
    prompts = [p["problem"] for p in problems]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == format_response(p["answer"]) for t, p in zip(texts, problems)) / len(problems)


def warm_start(model_dir: str | pathlib.Path, train: list[dict], spec: WarmStartSpec = WarmStartSpec()) -> float:
    """Fine-tunes the checkpoint in `model_dir` in place; returns the final train-probe accuracy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    probe = rng.sample(train, min(64, len(train)))
    examples = []
    for p in train:
        prompt_ids = tok(p["problem"], add_special_tokens=False)["input_ids"]
        resp_ids = tok(format_response(p["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append((prompt_ids, resp_ids))
    acc, start = 0.0, time.monotonic()
    for step in range(1, spec.max_steps + 1):
        batch = [examples[rng.randrange(len(examples))] for _ in range(spec.batch_size)]
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, r) in enumerate(batch):
            seq = p + r
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p): len(seq)] = torch.tensor(r)
            mask[i, : len(seq)] = 1
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % spec.eval_every == 0:
            model.eval()
            acc = greedy_accuracy(model, tok, probe)
            logger.info("warm start step %d loss %.3f probe accuracy %.2f (%.1f steps/s)", step, loss.item(), acc,
                        step / (time.monotonic() - start))
            if acc >= spec.target_accuracy:
                break
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return acc
