"""The rule verifiers, by MindSpeed-RL's names, with its scores; the one registry of them.

A verifier maps (response text, label) to a float. Each has a `timeout_score`, given when it runs
past `verifier_timeout` or raises: it is the verifier's score for a wrong or malformed answer, so
a policy gains nothing by writing answers that stall the verifier (MindSpeed-RL gives 0.0, which
is more than `acc`'s -0.5 for a wrong answer).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.reward.code_tests import score_sandbox_fusion
from services.reward.math_answer import (
    answers_equivalent,
    extract_answer,
    math_verify_score,
    minerva_answer,
    minerva_normalise,
)


@dataclass(frozen=True)
class Verifier:
    """One named rule: `score(response, label) -> float`."""

    name: str
    description: str
    timeout_score: float
    score: Callable[[str, str], float]


_THINK_ANSWER = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL | re.MULTILINE)
_BOXED_ANY = re.compile(r"\\boxed\{.*?\}")
_STEP_MARKERS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")
_PROMPT_ECHO = re.compile(r"^.*?<\|im_start\|>assistant", re.DOTALL)
_STOP_WORDS = ("</s>", "<|im_end|>", "<|endoftext|>")


def has_strict_structure(response: str) -> bool:
    """`<think>...</think><answer>...\\boxed{...}...</answer>`: each tag and one `\\boxed{}` exactly
    once, in that order, the response starting with `<think>` and ending with `</answer>`."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(response.count(tag) != 1 for tag in tags) or len(_BOXED_ANY.findall(response)) != 1:
        return False
    think, think_end, answer, answer_end = (response.find(tag) for tag in tags)
    boxed = _BOXED_ANY.search(response).start()
    in_order = think < think_end < answer < boxed < answer_end
    return in_order and response.startswith("<think>") and response.endswith("</answer>")


def _format(response: str, label: str) -> float:
    return 1.0 if _THINK_ANSWER.match(response) else 0.0


def _strict_format(response: str, label: str) -> float:
    return 1.0 if has_strict_structure(response) else -0.5


def _base_acc(response: str, label: str) -> float:
    correct = has_strict_structure(response) and answers_equivalent(extract_answer(response), label)
    return 1.0 if correct else 0.0


def _assistant_turn(response: str) -> str:
    """The response from the assistant's turn on, cut at the first stop word (a raw decode may hold both)."""
    text = _PROMPT_ECHO.sub("<|im_start|>assistant", response, count=1)
    for stop in _STOP_WORDS:
        if stop in text:
            text = text.split(stop)[0].strip()
    return text


def _acc(response: str, label: str) -> float:
    text = _assistant_turn(response)
    answer = extract_answer(text)
    if not answer or "boxed" not in text:
        return -1.0
    return 1.0 if answers_equivalent(answer, label) else -0.5


def _mathruler_acc(response: str, label: str) -> float:
    # MindSpeed-RL's math_17k_accuracy_reward and ppo_accuracy_reward, to the letter: mathruler's last
    # `\boxed{...}` (no other box command) graded by its grade_answer (a list's order counts).
    from mathruler.grader import extract_boxed_content, grade_answer

    return 1.0 if grade_answer(extract_boxed_content(response), label) else 0.0


def _math_verify(response: str, label: str) -> float:
    return 1.0 if math_verify_score(response, label) else 0.0


def _math_verify_reward(response: str, label: str) -> float:
    # the `format` verifier's shape first: an answer outside <think>...</think><answer>...</answer>
    # earns nothing however right it is, so the policy cannot drop the reasoning to score
    return 1.0 if _THINK_ANSWER.match(response) and math_verify_score(response, label) else 0.0


def _acc_for_dapo(response: str, label: str) -> float:
    answer = minerva_answer(response)
    return 1.0 if answer is not None and answer == minerva_normalise(label) else -1.0


def _step(response: str, label: str) -> float:
    return min(1.0, len(_STEP_MARKERS.findall(response)) / 3)


_VERIFIERS = (
    Verifier("format", "1 if the response is <think>...</think> <answer>...</answer>, else 0", 0.0, _format),
    Verifier(
        "strict_format",
        "1 if <think>, </think>, <answer>, one \\boxed{}, </answer> appear once each in order, else -0.5",
        -0.5,
        _strict_format,
    ),
    Verifier(
        "base_acc",
        "1 if strict_format holds and the extracted answer equals the label (math-verify), else 0",
        0.0,
        _base_acc,
    ),
    Verifier(
        "acc",
        "assistant turn's boxed answer: 1 equal to the label, -0.5 different, -1 no \\boxed{} answer",
        -0.5,
        _acc,
    ),
    Verifier("math_17k_acc", "1 if the last \\boxed{} equals the label (mathruler's grade_answer, as MindSpeed-RL), else 0",
             0.0, _mathruler_acc),
    Verifier("acc_for_ppo", "MindSpeed-RL's PPO accuracy: the same rule as math_17k_acc", 0.0, _mathruler_acc),
    Verifier(
        "math_verify",
        "1 if math-verify finds the label (as \\boxed{label}) in the response, else 0",
        0.0,
        _math_verify,
    ),
    Verifier(
        "math_verify_reward",
        "math_verify behind the format gate: 1 if the response is <think>...</think> <answer>...</answer> and "
        "math-verify finds the label in it, else 0",
        0.0,
        _math_verify_reward,
    ),
    Verifier(
        "acc_for_dapo",
        "Minerva: the last 'Answer: X' in the final 300 characters, normalised, 1 if it equals the label, else -1",
        -1.0,
        _acc_for_dapo,
    ),
    Verifier("step", "step-by-step markers (Step n:, 1., bullets, First/Next/Finally): min(1, count/3)", 0.0, _step),
    Verifier("sandbox_fusion", "the last code block run on the label's APPS/TACO stdin/stdout tests in the sandbox service "
             "(reward.sandbox_address): 1 if every test passes, else 0; reward.code_continuous: the fraction of the "
             "first 10 passed (verl's continuous)", 0.0, score_sandbox_fusion),
)

REGISTRY: dict[str, Verifier] = {v.name: v for v in _VERIFIERS}


def get_verifier(name: str, field: str = "verifier_function") -> Verifier:
    """The verifier called `name`; InvalidArgument naming `field` and the known names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(REGISTRY)
        raise InvalidArgument(field, f"unknown verifier {name!r}; known: {known}, and reward_model where reward_config.load is set") from None


def run_verifier(name: str, response: str, label: str) -> float:
    """Runs one verifier in this process; an exception scores as the verifier's timeout score."""
    verifier = REGISTRY[name]
    try:
        return float(verifier.score(response, label))
    except Exception:  # noqa: BLE001 - a rule must never fail a batch; the failing score says enough
        return verifier.timeout_score
