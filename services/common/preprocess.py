"""Data preprocessing: jsonl/parquet -> a tokenized prompt dataset (`dockrl data preprocess`).

Keys follow MindSpeed-RL's preprocessing YAML (input, tokenizer_name_or_path, output_prefix,
handler_name, prompt_type, map_keys, seq_length, workers, log_interval). The output is
`{output_prefix}.jsonl` (one prompt per line: index, prompt text, prompt_ids, label) and
`{output_prefix}.meta.json`; `load_prompts(output_prefix)` reads it back.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import pathlib
import time
from dataclasses import dataclass, field

from services.common.templates import render_prompt

logger = logging.getLogger("dockrl.data")


@dataclass(frozen=True)
class MapKeys:
    """Which input fields hold the prompt parts and the label."""

    prompt: str = "problem"
    query: str = ""
    response: str = "answer"
    system: str = ""


@dataclass(frozen=True)
class PreprocessConfig:
    """One preprocessing job."""

    input: str = ""
    tokenizer_name_or_path: str = ""
    output_prefix: str = ""
    handler_name: str = "R1AlpacaStyleInstructionHandler"
    prompt_type: str = "qwen"
    map_keys: MapKeys = field(default_factory=MapKeys)
    seq_length: int = 0  # drop prompts longer than this many tokens; 0 keeps all
    workers: int = 1
    log_interval: int = 1000
    tokenizer_type: str = "HuggingFaceTokenizer"
    tokenizer_not_use_fast: bool = False
    dataset_additional_keys: tuple[str, ...] = ("labels",)


@dataclass(frozen=True)
class PromptRecord:
    """One tokenized prompt and its reference answer."""

    index: int
    prompt: str
    prompt_ids: list[int]
    label: str


# handler_name -> default map_keys, as MindSpeed-RL's handlers read their inputs.
HANDLERS: dict[str, MapKeys] = {
    "R1AlpacaStyleInstructionHandler": MapKeys(prompt="problem", response="answer"),
    "Math17kAlpacaStyleInstructionHandler": MapKeys(prompt="prompt", response="solution"),
    "AlpacaStyleInstructionHandler": MapKeys(prompt="instruction", query="input", response="output"),
}


def _read_rows(path: pathlib.Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    raise ValueError(f"input: {path} must be .jsonl, .json or .parquet")


def _messages(row: dict, keys: MapKeys, row_no: int) -> tuple[list[dict], str]:
    if keys.prompt not in row:
        raise ValueError(f"input row {row_no}: map_keys.prompt field {keys.prompt!r} is missing (row keys: {sorted(row)})")
    if keys.response not in row:
        raise ValueError(f"input row {row_no}: map_keys.response field {keys.response!r} is missing (row keys: {sorted(row)})")
    user = str(row[keys.prompt])
    if keys.query and row.get(keys.query):
        user = f"{user}\n{row[keys.query]}"
    messages = []
    if keys.system and row.get(keys.system):
        messages.append({"role": "system", "content": str(row[keys.system])})
    messages.append({"role": "user", "content": user})
    return messages, str(row[keys.response])


_worker_tokenizer = None


def _init_worker(tokenizer_path: str, use_fast: bool) -> None:
    global _worker_tokenizer
    from transformers import AutoTokenizer

    _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, use_fast=use_fast)


def _tokenize(text: str) -> list[int]:
    return _worker_tokenizer(text, add_special_tokens=False)["input_ids"]


def preprocess(cfg: PreprocessConfig, progress: bool = True) -> int:
    """Tokenizes `cfg.input` into `cfg.output_prefix`.jsonl; returns the number of prompts kept."""
    from tqdm import tqdm

    if cfg.handler_name not in HANDLERS:
        raise ValueError(f"handler_name: {cfg.handler_name!r} is not one of {', '.join(HANDLERS)}")
    for key in ("input", "tokenizer_name_or_path", "output_prefix"):
        if not getattr(cfg, key):
            raise ValueError(f"{key}: required")
    if cfg.workers < 1:
        raise ValueError(f"workers: must be >= 1, got {cfg.workers}")
    keys = cfg.map_keys if cfg.map_keys != MapKeys() else HANDLERS[cfg.handler_name]
    rows = _read_rows(pathlib.Path(cfg.input))
    pairs = [_messages(row, keys, i) for i, row in enumerate(rows)]
    prompts = [render_prompt(cfg.prompt_type, messages) for messages, _ in pairs]
    start = time.monotonic()
    use_fast = not cfg.tokenizer_not_use_fast
    if cfg.workers == 1:
        _init_worker(cfg.tokenizer_name_or_path, use_fast)
        ids_iter = map(_tokenize, prompts)
        pool = None
    else:
        pool = multiprocessing.get_context("spawn").Pool(cfg.workers, _init_worker, (cfg.tokenizer_name_or_path, use_fast))
        ids_iter = pool.imap(_tokenize, prompts, chunksize=64)
    out = pathlib.Path(f"{cfg.output_prefix}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = dropped = 0
    try:
        with out.open("w") as f:
            for i, ids in enumerate(tqdm(ids_iter, total=len(prompts), desc="preprocess", disable=not progress)):
                if cfg.seq_length and len(ids) > cfg.seq_length:
                    dropped += 1
                    continue
                f.write(json.dumps({"index": kept, "prompt": prompts[i], "prompt_ids": ids, "label": pairs[i][1]}) + "\n")
                kept += 1
                if cfg.log_interval and (i + 1) % cfg.log_interval == 0:
                    rate = (i + 1) / max(time.monotonic() - start, 1e-9)
                    logger.info("preprocessed %d/%d prompts (%.0f/s)", i + 1, len(prompts), rate)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    meta = {"count": kept, "dropped_over_seq_length": dropped, "input": cfg.input, "prompt_type": cfg.prompt_type,
            "handler_name": cfg.handler_name, "tokenizer_name_or_path": cfg.tokenizer_name_or_path}
    pathlib.Path(f"{cfg.output_prefix}.meta.json").write_text(json.dumps(meta, indent=1))
    return kept


def load_prompts(output_prefix: str | pathlib.Path) -> list[PromptRecord]:
    """Reads a preprocessed dataset back, in index order."""
    path = pathlib.Path(f"{output_prefix}.jsonl")
    if not path.exists():
        raise FileNotFoundError(f"megatron_training.data_path: {path} does not exist; run `dockrl data preprocess` first")
    return [PromptRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
