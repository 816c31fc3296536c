"""A short supervised warm start of the tiny model, so that RL starts with signal but headroom.

The demo's model is random at birth; RL on a random model never sees a reward. This trains it to
imitate a careless teacher: every target carries the right answer, but only a share
(`boxed_fraction`) writes it as `\\boxed{answer}`, the form the rule reward accepts; the rest give
the bare number. The model learns the arithmetic and the teacher's habit together, so sampling
gives boxed answers now and then (RL's signal) while greedy decoding mostly gives bare ones.
Training stops once greedy answers are right, boxed or not, on `target_accuracy` of a probe.
"""
from __future__ import annotations

import logging
import pathlib
import random
import re
import time
from dataclasses import dataclass

logger = logging.getLogger("dockrl.warm_start")

_BOXED = re.compile(r"\\boxed\{(.*)\}")


@dataclass(frozen=True)
class WarmStartSpec:
    """How long and how hard to warm start, and how careless the imitated teacher is."""

    target_accuracy: float = 0.4  # stop once this share of greedy answers is right, boxed or not
    boxed_fraction: float = 1.0  # share of targets written as \boxed{answer}
    max_steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    eval_every: int = 25
    seed: int = 0
    threads: int = 2


@dataclass(frozen=True)
class ProbeResult:
    """Greedy answers on a probe: right in any form, boxed, and right and boxed (what the reward pays)."""

    answered: float
    boxed: float
    scored: float


def format_response(answer: str, boxed: bool = True) -> str:
    """A teacher's response: the answer in a LaTeX box (what the demo's verifier scores) or bare."""
    return f"\\boxed{{{answer}}}" if boxed else answer


def probe(model, tokenizer, problems: list[dict], max_new_tokens: int = 12) -> ProbeResult:
    """Greedy-decodes `problems` and says how many answers are right, boxed, and both."""
    import torch

    tokenizer.padding_side = "left"
    prompts = [p["problem"] for p in problems]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    texts = [t.strip() for t in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]
    boxed = [_BOXED.fullmatch(t) for t in texts]
    stated = [m.group(1) if m else t for m, t in zip(boxed, texts)]
    right = [s == p["answer"] for s, p in zip(stated, problems)]
    n = len(problems)
    return ProbeResult(answered=sum(right) / n, boxed=sum(m is not None for m in boxed) / n,
                       scored=sum(r and m is not None for r, m in zip(right, boxed)) / n)


def warm_start(model_dir: str | pathlib.Path, problems: list[dict], spec: WarmStartSpec = WarmStartSpec()) -> ProbeResult:
    """Fine-tunes the checkpoint in `model_dir` in place on `problems`; returns the last probe."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    probe_set = rng.sample(problems, min(64, len(problems)))
    examples = []
    for p in problems:
        prompt_ids = tok(p["problem"], add_special_tokens=False)["input_ids"]
        styles = [tok(format_response(p["answer"], boxed), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                  for boxed in (False, True)]
        examples.append((prompt_ids, styles))
    result, start = ProbeResult(0.0, 0.0, 0.0), time.monotonic()
    for step in range(1, spec.max_steps + 1):
        batch = []
        for _ in range(spec.batch_size):
            prompt_ids, styles = examples[rng.randrange(len(examples))]
            batch.append((prompt_ids, styles[rng.random() < spec.boxed_fraction]))
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
            result = probe(model, tok, probe_set)
            logger.info("warm start step %d loss %.3f greedy answers right %.2f boxed %.2f (%.1f steps/s)", step,
                        loss.item(), result.answered, result.boxed, step / (time.monotonic() - start))
            if result.answered >= spec.target_accuracy:
                break
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return result
