"""A short supervised warm start of the tiny model, so that RL starts with signal but headroom.

The demo's model is random at birth; RL on a random model never sees a reward. This trains it to
imitate a careless teacher: every target carries the right answer, but only a share
(`boxed_fraction`) writes it as `\\boxed{answer}`, the form the rule reward accepts; the rest give
the bare number. The model learns the arithmetic and the teacher's habit together, so sampling
gives boxed answers now and then (RL's signal) while greedy decoding mostly gives bare ones.
Training stops once greedy answers are right, boxed or not, on `target_accuracy` of a probe.

With a tool teacher (`ToolTeacher`, the agent demo), a share of the targets is a whole episode as the
rollout's "tools" environment runs it: the model's turn calling the calculator on the problem, the tool's
response as the environment appends it (masked out of the loss, as the trainer masks it), and the boxed
answer copied from it; the other targets answer at once. The model learns to call and to copy, but calls
only now and then when sampled, and (with a share under one half) not when greedy: RL's room to learn when
to call. Training then stops once greedy episodes that open a call are right on `target_accuracy`.
"""
from __future__ import annotations

import logging
import pathlib
import random
import re
import time
from dataclasses import dataclass

from services.common.tool_text import observation_text, tag_call_text

logger = logging.getLogger("dockrl.warm_start")

_BOXED = re.compile(r"\\boxed\{(.*)\}")
CALCULATOR = "calculator"  # the rollout's calculator tool (services/rollout/agent/tools.py): {"expression": str}


@dataclass(frozen=True)
class ToolTeacher:
    """A teacher that calls the calculator on `share` of the targets, in rollout.multi_turn's tag format."""

    share: float  # share of targets that call the tool; the rest answer at once
    start: str = "<tool_call>"  # rollout.multi_turn.tool_call_start
    end: str = "</tool_call>"  # rollout.multi_turn.tool_call_end
    body: str = "json"  # rollout.multi_turn.tag_body


@dataclass(frozen=True)
class WarmStartSpec:
    """How long and how hard to warm start, and how careless the imitated teacher is."""

    target_accuracy: float = 0.4  # stop once this share of greedy answers is right (with a tool teacher: of calls)
    boxed_fraction: float = 1.0  # share of direct answers written as \boxed{answer}
    max_steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    eval_every: int = 25
    seed: int = 0
    threads: int = 2
    tool: ToolTeacher | None = None  # None: every target answers at once


@dataclass(frozen=True)
class ProbeResult:
    """Greedy answers on a probe: right in any form, boxed, and right and boxed (what the reward pays); with a
    tool teacher also how the model calls the tool."""

    answered: float
    boxed: float
    scored: float
    greedy_calls: float = 0.0  # share of greedy first turns that open a call
    call_probability: float = 0.0  # mean probability that a sampled (temperature 1) first turn opens a call
    call_answered: float = 0.0  # share of episodes made to call (the start tag prefilled) that end right and boxed


def format_response(answer: str, boxed: bool = True) -> str:
    """A teacher's response: the answer in a LaTeX box (what the demo's verifier scores) or bare."""
    return f"\\boxed{{{answer}}}" if boxed else answer


def _segments(tok, problem: dict, style: str, tool: ToolTeacher | None) -> list[tuple[list[int], bool]]:
    """One target as (token ids, trained) segments: `bare`, `boxed`, or `tool` (call, observation, boxed answer).
    Each segment is encoded on its own, as the rollout samples the model's turns and encodes an observation once."""
    eos = [tok.eos_token_id]
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if style != "tool":
        return [(encode(format_response(problem["answer"], style == "boxed")) + eos, True)]
    call = tag_call_text(CALCULATOR, {"expression": problem["problem"].rstrip("=")}, tool.start, tool.end, tool.body)
    return [(encode(call), True), (encode(observation_text([problem["answer"]], "tag")), False),
            (encode(format_response(problem["answer"])) + eos, True)]


def _generate(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    import torch

    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def probe(model, tokenizer, problems: list[dict], max_new_tokens: int = 12, tool: ToolTeacher | None = None) -> ProbeResult:
    """Greedy-decodes `problems` and says how many answers are right, boxed, and both; with `tool`, also how
    often the model calls it and how often an episode that calls it ends right."""
    prompts = [p["problem"] for p in problems]
    if tool is None:
        return _scored(_generate(model, tokenizer, prompts, max_new_tokens), problems)
    call_len = max(len(tag_call_text(CALCULATOR, {"expression": p[:-1]}, tool.start, tool.end, tool.body)) for p in prompts)
    first = _generate(model, tokenizer, prompts, call_len + max_new_tokens)
    calls = [t.startswith(tool.start) for t in first]
    # greedy episodes: a first turn that calls is cut where its call closes and answered as the calculator would
    answers = _episode_answers(model, tokenizer, problems, [t if c else "" for t, c in zip(first, calls)], tool, max_new_tokens)
    answers = [a if c else t for a, t, c in zip(answers, first, calls)]
    # episodes made to call: the start tag prefilled, the model writes the rest of the call
    forced = _generate(model, tokenizer, [q + tool.start for q in prompts], call_len)
    forced_answers = _episode_answers(model, tokenizer, problems, [tool.start + t for t in forced], tool, max_new_tokens)
    return _scored(answers, problems, greedy_calls=sum(calls) / len(problems),
                   call_probability=_call_probability(model, tokenizer, prompts, tool.start),
                   call_answered=_scored(forced_answers, problems).scored)


def _scored(answers: list[str], problems: list[dict], **tool_figures: float) -> ProbeResult:
    """How many final `answers` are right (boxed or bare), boxed, and both."""
    texts = [t.strip() for t in answers]
    boxed = [_BOXED.fullmatch(t) for t in texts]
    right = [(m.group(1) if m else t) == p["answer"] for m, t, p in zip(boxed, texts, problems)]
    n = len(problems)
    return ProbeResult(answered=sum(right) / n, boxed=sum(m is not None for m in boxed) / n,
                       scored=sum(r and m is not None for r, m in zip(right, boxed)) / n, **tool_figures)


def _episode_answers(model, tok, problems: list[dict], turns: list[str], tool: ToolTeacher, max_new_tokens: int) -> list[str]:
    """The final answer after each turn that opened a call ("" for a turn that did not, or never closed its call):
    the call cut at its end tag, the calculator's response appended (the answer when the call asks the problem's own
    expression, else an error), then one greedy turn."""
    contexts, at = [], []
    for i, (problem, turn) in enumerate(zip(problems, turns)):
        close = turn.find(tool.end) if turn.startswith(tool.start) else -1
        if close < 0:
            continue
        call = turn[:close + len(tool.end)]
        asked = tag_call_text(CALCULATOR, {"expression": problem["problem"].rstrip("=")}, tool.start, tool.end, tool.body)
        response = problem["answer"] if call == asked else "error: not the problem's expression"
        contexts.append(problem["problem"] + call + observation_text([response], "tag"))
        at.append(i)
    answers = [""] * len(problems)
    for i, text in zip(at, _generate(model, tok, contexts, max_new_tokens) if contexts else []):
        answers[i] = text
    return answers


def _call_probability(model, tok, prompts: list[str], start: str) -> float:
    """Mean over `prompts` of the probability that a temperature-1 sample begins with `start`."""
    import torch

    start_ids = tok(start, add_special_tokens=False)["input_ids"]
    total = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([ids + start_ids[:-1]])).logits[0, len(ids) - 1:]
            logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(start_ids)[:, None]).sum()
            total += float(logp.exp())
    return total / len(prompts)


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
    prompt_ids = [tok(p["problem"], add_special_tokens=False)["input_ids"] for p in problems]
    result, start = ProbeResult(0.0, 0.0, 0.0), time.monotonic()
    for step in range(1, spec.max_steps + 1):
        batch = []
        for _ in range(spec.batch_size):
            i = rng.randrange(len(problems))
            draw = rng.random()
            style = "tool" if spec.tool and draw < spec.tool.share else "boxed" if rng.random() < spec.boxed_fraction else "bare"
            batch.append((prompt_ids[i], _segments(tok, problems[i], style, spec.tool)))
        width = max(len(p) + sum(len(ids) for ids, _ in segs) for p, segs in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, segs) in enumerate(batch):
            seq, at = list(p), len(p)
            for seg, trained in segs:
                if trained:  # an observation is the environment's: no loss on it, as in RL
                    labels[i, at: at + len(seg)] = torch.tensor(seg)
                seq += seg
                at += len(seg)
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % spec.eval_every == 0:
            model.eval()
            result = probe(model, tok, probe_set, tool=spec.tool)
            logger.info("warm start step %d loss %.3f greedy answers right %.2f boxed %.2f calls %.2f, call probability "
                        "%.2f, made to call right %.2f (%.1f steps/s)", step, loss.item(), result.answered, result.boxed,
                        result.greedy_calls, result.call_probability, result.call_answered, step / (time.monotonic() - start))
            if (result.call_answered if spec.tool else result.answered) >= spec.target_accuracy:
                break
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return result
