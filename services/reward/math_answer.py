"""Reading a final answer out of a response and deciding whether it equals a label.

Extraction is string work (brace matching, the Minerva "Answer:" line, the last number);
equivalence is Hugging Face's `math-verify` (LaTeX -> sympy), with a normalised string compare
as the fallback when neither side parses. `math-verify`'s own signal-based timeouts are turned
off: the verifier pool (pool.py) is the one place that bounds a sample's time, by killing the
worker, which also stops computations stuck inside C code that a signal cannot interrupt.
"""
from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# math-verify warns on every call made with its timeouts disabled; the pool bounds the time instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_LAST_NUMBER = re.compile(r"-?\d*\.?\d+")
_MINERVA_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# The Minerva tail: the longest MATH-500 answer has 159 characters, so 300 hold any final line.
MINERVA_TAIL_CHARS = 300


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`), braces matched; None if absent or unbalanced."""
    start = max(text.rfind(cmd) for cmd in _BOXED_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    command = next(cmd for cmd in _BOXED_COMMANDS if rest.startswith(cmd))
    after = rest[len(command):]
    if after.startswith(" "):  # `\boxed 5`: the argument runs to the next `$` or whitespace
        return after.strip().split("$")[0].split()[0] if after.strip() else None
    if not after.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(after):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return after[1:i]
    return None


def extract_answer(text: str) -> str:
    """The response's final answer, normalised: the Qwen math-eval order of rules.

    1. "final answer is $X$. I hope" (the Minerva few-shot closing line), 2. the last boxed
    answer, 3. the text after the last "the answer is", 4. the last number. "" when none applies.
    """
    if "final answer is $" in text and "$. I hope" in text:
        answer = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0]
    elif "boxed" in text:
        answer = last_boxed(text) or ""
    elif "he answer is" in text:
        answer = text.split("he answer is")[-1].strip().split("\n")[0]
    else:
        numbers = _LAST_NUMBER.findall(text.replace(",", ""))
        answer = numbers[-1] if numbers else ""
    return normalise_answer(answer)


_LATEX_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\left", "\\right", "\\displaystyle")


def normalise_answer(answer: str) -> str:
    """A canonical spelling for display and string comparison: no `$`, LaTeX spacing, degree or
    percent signs, trailing period; `\\dfrac`/`\\tfrac` -> `\\frac`; `\\frac12` -> `\\frac{1}{2}`."""
    answer = answer.strip().replace("\n", "")
    for token in _LATEX_SPACING:
        answer = answer.replace(token, "")
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    answer = answer.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\%", "").replace("%", "")
    answer = answer.replace("$", "").rstrip(".").strip()
    answer = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", answer)
    answer = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", answer)
    if answer.startswith("."):
        answer = "0" + answer
    return answer.replace(" ", "")


def answers_equivalent(prediction: str, label: str) -> bool:
    """True when `prediction` and `label` denote the same value (math-verify), else their
    normalised strings are equal. Empty predictions never match."""
    if not prediction.strip():
        return False
    gold = _parse_math(label)
    guess = _parse_math(prediction)
    if gold and guess:
        return verify(gold, guess, timeout_seconds=None)
    return normalise_answer(prediction) == normalise_answer(label)


def _parse_math(text: str) -> list:
    """math-verify's parse of a bare answer (wrapped in `$...$` unless already delimited)."""
    wrapped = text if "$" in text or "\\boxed" in text else f"${text}$"
    return parse(wrapped, parsing_timeout=None)


def math_verify_score(response: str, label: str) -> bool:
    """math-verify on the whole response: the label as LaTeX in `\\boxed{}`, the response read as
    a plain expression or LaTeX (MindSpeed-RL's `math_verify` verifier)."""
    gold = parse(
        "\\boxed{" + label + "}", extraction_config=(LatexExtractionConfig(),), parsing_timeout=None
    )
    guess = parse(
        response, extraction_config=(ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=None
    )
    return bool(gold and guess) and verify(gold, guess, timeout_seconds=None)


# ---------------------------------------------------------------- Minerva (DAPO)

_MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
    "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
    "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)


def minerva_normalise(answer: str) -> str:
    """The Minerva (Lewkowycz et al. 2022) normalisation DAPO scores with: right of the last `=`,
    units and filler words dropped, `\\text{}`/`\\boxed{}` unwrapped, `\\fracab` -> `\\frac{a}{b}`."""
    answer = answer.split("=")[-1]
    for before, after in _MINERVA_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _MINERVA_REMOVED:
        answer = answer.replace(expression, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def minerva_answer(response: str) -> str | None:
    """The normalised text after the last "Answer:" in the response's last 300 characters; None if absent."""
    matches = _MINERVA_ANSWER.findall(response[-MINERVA_TAIL_CHARS:])
    return minerva_normalise(matches[-1]) if matches else None
