"""A small arithmetic dataset for the demo and the tests, generated deterministically."""
from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass

from services.common.config import ArithmeticConfig


def _answer(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"ops: {op!r} is not one of +, -, *")


@dataclass(frozen=True)
class ArithmeticSplits:
    """Disjoint problem sets: RL trains on `train`; `test` is held out from RL.

    The warm start imitates a teacher on every problem (`all`), the way a pretrained model has
    seen the arithmetic RL later asks about; what RL adds is then measured on prompts it never
    trained on.
    """

    train: list[dict]  # every RL prompt
    test: list[dict]  # held out from RL

    @property
    def all(self) -> list[dict]:
        """Every problem, train first."""
        return self.train + self.test


def arithmetic_problems(spec: ArithmeticConfig) -> ArithmeticSplits:
    """Every problem of `spec`, shuffled with its seed and split as ArithmeticSplits says."""
    problems = [
        {"problem": f"{a}{op}{b}=", "answer": str(_answer(a, op, b))}
        for op in spec.ops
        for a in range(spec.min_operand, spec.max_operand + 1)
        for b in range(spec.min_operand, spec.max_operand + 1)
    ]
    random.Random(spec.seed).shuffle(problems)
    n_test = max(1, round(len(problems) * spec.test_fraction))
    return ArithmeticSplits(train=problems[n_test:], test=problems[:n_test])


def write_arithmetic_dataset(out_dir: str | pathlib.Path, spec: ArithmeticConfig = ArithmeticConfig()) -> dict[str, pathlib.Path]:
    """Writes train.jsonl and test.jsonl under `out_dir`."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = arithmetic_problems(spec)
    paths = {}
    for name in ("train", "test"):
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in getattr(splits, name)))
    return paths
