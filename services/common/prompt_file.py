"""A preprocessed prompt file read back, every line checked: a bad line is left out and named, never the end of a run.

`dockrl data preprocess` writes `{output_prefix}.jsonl`, one JSON object a line: index, prompt,
prompt_ids, label. A file edited by hand or written by another tool may hold lines that are not such
an object; each is left out, counted by reason and named by file and line in one report (logged at
start-up, kept in summary.json). A file without one usable line is an error naming the file.
"""
from __future__ import annotations

import json
import pathlib
from collections import Counter
from dataclasses import dataclass, field

from services.common.preprocess import PromptRecord

# Why a line is left out, in the order they are checked
UNDECODABLE, NOT_AN_OBJECT, MISSING_FIELD, MISTYPED_FIELD, EMPTY_PROMPT, OVER_MAX_PROMPT_LENGTH = (
    "undecodable", "not_an_object", "missing_field", "mistyped_field", "empty_prompt", "over_max_prompt_length")
REPORTED_LINES = 20  # lines named in a report; the counts cover them all


@dataclass(frozen=True)
class BadLine:
    """One line left out: where (1-based), why (one of the reasons above) and what was found."""

    line: int
    reason: str
    detail: str


@dataclass
class PromptFile:
    """The usable prompts of one file, in file order, and the lines left out."""

    path: pathlib.Path
    records: list[PromptRecord] = field(default_factory=list)
    left_out: list[BadLine] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Lines left out per reason."""
        return dict(Counter(bad.reason for bad in self.left_out))

    def named(self, limit: int = REPORTED_LINES) -> list[str]:
        """The first `limit` lines left out, each as `file:line: reason: detail`."""
        return [f"{self.path}:{bad.line}: {bad.reason}: {bad.detail}" for bad in self.left_out[:limit]]

    def report(self) -> dict:
        """What summary.json keeps of this file."""
        return {"file": str(self.path), "kept": len(self.records), "left_out": self.counts(), "lines": self.named()}


def _mistyped(row: dict) -> str | None:
    """What is wrong with a field's type, or None."""
    for name, kind in (("index", int), ("prompt", str), ("label", str)):
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            return f"{name} has type {type(row[name]).__name__}, expected {kind.__name__}"
    ids = row["prompt_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return "prompt_ids is not a list of token ids (integers >= 0)"
    return None


def _check(text: str, max_prompt_length: int) -> PromptRecord | tuple[str, str]:
    """The record on one line, or (reason, detail)."""
    try:
        row = json.loads(text)
    except ValueError as exc:
        return UNDECODABLE, f"not JSON ({exc})"
    if not isinstance(row, dict):
        return NOT_AN_OBJECT, f"a JSON {type(row).__name__}, expected an object"
    missing = [name for name in ("index", "prompt", "prompt_ids", "label") if name not in row]
    if missing:
        return MISSING_FIELD, f"no {', '.join(missing)} (has {', '.join(sorted(row)) or 'nothing'})"
    if (wrong := _mistyped(row)) is not None:
        return MISTYPED_FIELD, wrong
    if not row["prompt_ids"] or not row["prompt"].strip():
        return EMPTY_PROMPT, "the prompt has no tokens" if not row["prompt_ids"] else "the prompt text is blank"
    if max_prompt_length and len(row["prompt_ids"]) > max_prompt_length:
        return OVER_MAX_PROMPT_LENGTH, f"{len(row['prompt_ids'])} tokens > rl_config.max_prompt_length {max_prompt_length}"
    return PromptRecord(row["index"], row["prompt"], row["prompt_ids"], row["label"])


def read_prompt_file(output_prefix: str | pathlib.Path, key: str, max_prompt_length: int = 0) -> PromptFile:
    """Reads `{output_prefix}.jsonl`, leaving out each bad line (over `max_prompt_length` tokens too, when > 0).

    `key` is the config key that named the file, for the errors: FileNotFoundError when it is missing,
    ValueError when no line is usable.
    """
    path = pathlib.Path(f"{output_prefix}.jsonl")
    if not path.exists():
        raise FileNotFoundError(f"{key}: {path} does not exist; run `dockrl data preprocess` first")
    result = PromptFile(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                result.left_out.append(BadLine(number, UNDECODABLE, f"not UTF-8 ({exc.reason} at byte {exc.start})"))
                continue
            if not text.strip():
                continue
            checked = _check(text, max_prompt_length)
            if isinstance(checked, PromptRecord):
                result.records.append(checked)
            else:
                result.left_out.append(BadLine(number, *checked))
    if not result.records:
        counts = ", ".join(f"{n} {reason}" for reason, n in result.counts().items()) or "the file is empty"
        first = f"; the first: {result.named(1)[0]}" if result.left_out else ""
        raise ValueError(f"{key}: {path} has no usable prompt ({counts}){first}")
    return result
