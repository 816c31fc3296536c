"""A small arithmetic dataset for the demo and the tests, generated deterministically."""
from __future__ import annotations

import json
import pathlib
import random

from services.common.config import ArithmeticConfig


def _answer(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"ops: {op!r} is not one of +, -, *")


def arithmetic_problems(spec: ArithmeticConfig) -> tuple[list[dict], list[dict]]:
    """Every problem of `spec`, split into (train, held-out test) with disjoint operand pairs."""
    problems = [
        {"problem": f"{a}{op}{b}=", "answer": str(_answer(a, op, b))}
        for op in spec.ops
        for a in range(spec.max_operand + 1)
        for b in range(spec.max_operand + 1)
    ]
    random.Random(spec.seed).shuffle(problems)
    n_test = max(1, round(len(problems) * spec.test_fraction))
    return problems[n_test:], problems[:n_test]


def write_arithmetic_dataset(out_dir: str | pathlib.Path, spec: ArithmeticConfig = ArithmeticConfig()) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes train.jsonl and test.jsonl under `out_dir`; returns their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = arithmetic_problems(spec)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, rows in zip(paths, (train, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
