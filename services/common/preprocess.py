"""Data preprocessing: jsonl/parquet -> a tokenized prompt dataset (`dockrl data preprocess`).

Keys follow MindSpeed-RL's preprocessing YAML (input, tokenizer_name_or_path, output_prefix,
handler_name, prompt_type, map_keys, seq_length, workers, log_interval). The output is
`{output_prefix}.jsonl` (one prompt per line: index, prompt text, prompt_ids, label) and
`{output_prefix}.meta.json`; `services.common.prompt_file.read_prompt_file` reads it back.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import pathlib
import time
from dataclasses import dataclass, field

from services.common.config.types import config_section
from services.common.templates import render_prompt

logger = logging.getLogger("dockrl.data")


@config_section
class MapKeys:
    """Which input fields hold the prompt parts and the label; a dotted name reads a nested field
    (DAPO-Math-17k's label is `reward_model.ground_truth`)."""

    prompt: str = "problem"
    query: str = ""
    response: str = "answer"
    system: str = ""


@config_section
class PreprocessConfig:
    """One preprocessing job."""

    input: str = ""
    tokenizer_name_or_path: str = ""
    output_prefix: str = ""
    handler_name: str = "R1AlpacaStyleInstructionHandler"
    prompt_type: str = "qwen"  # a template of configs/model/templates.json, or `tokenizer`: the tokenizer's own chat template
    map_keys: MapKeys = field(default_factory=MapKeys)
    seq_length: int = 0  # drop prompts longer than this many tokens; 0 keeps all
    workers: int = 1
    log_interval: int = 1000
    tokenizer_type: str = "HuggingFaceTokenizer"  # the tokenizer is always Hugging Face's (AutoTokenizer)
    tokenizer_not_use_fast: bool = False
    dataset_additional_keys: tuple[str, ...] = ("labels",)  # kept beside each prompt: the label (map_keys.response)


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
    # MindSpeed-RL's math_17k dataset config: DAPO-Math-17k's chat prompt and reward_model.ground_truth
    "Math17kAlpacaStyleInstructionHandler": MapKeys(prompt="prompt", response="reward_model"),
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


TOKENIZER_TEMPLATE = "tokenizer"  # prompt_type that renders with the tokenizer's own chat template
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "PretrainedFromHF")  # MindSpeed-RL's names for a Hugging Face tokenizer


def _field(row: dict, dotted: str, role: str, row_no: int, required: bool = True):
    """The value at `dotted` (a.b.c walks nested mappings); None when absent and not `required`."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            if not required:
                return None
            raise ValueError(f"input row {row_no}: map_keys.{role} field {dotted!r} is missing (row keys: {sorted(row)})")
        value = value[part]
    return value


def _is_chat(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


def _messages(row: dict, keys: MapKeys, row_no: int) -> tuple[list[dict], str]:
    prompt = _field(row, keys.prompt, "prompt", row_no)
    # an empty prompt would still render (the template's own text) and fail in the rollout replica, a run later
    texts = [m["content"] for m in prompt] if _is_chat(prompt) else [prompt]
    if not any(str(text).strip() for text in texts if text is not None):
        raise ValueError(f"input row {row_no}: map_keys.prompt field {keys.prompt!r} is empty")
    label = _field(row, keys.response, "response", row_no)
    system = _field(row, keys.system, "system", row_no, required=False) if keys.system else None
    if _is_chat(prompt):  # already a conversation (DAPO-Math-17k's prompt): its turns as they are
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    else:
        user = str(prompt)
        query = _field(row, keys.query, "query", row_no, required=False) if keys.query else None
        if query:
            user = f"{user}\n{query}"
        messages = [{"role": "user", "content": user}]
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": str(system)})
    if isinstance(label, dict) and "ground_truth" in label:  # a verl-style reward_model field, as MindSpeed-RL's Math17k handler reads it
        label = label["ground_truth"]
    return messages, str(label)


def _render(prompt_type: str, tokenizer_path: str, all_messages: list[list[dict]]) -> list[str]:
    """Each conversation as prompt text: with a template of templates.json, or the tokenizer's chat template."""
    if prompt_type != TOKENIZER_TEMPLATE:
        return [render_prompt(prompt_type, messages) for messages in all_messages]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if not tokenizer.chat_template:
        raise ValueError(f"prompt_type: {TOKENIZER_TEMPLATE!r}, but the tokenizer in {tokenizer_path} has no chat template")
    return [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) for messages in all_messages]


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
    if cfg.tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"tokenizer_type: {cfg.tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)} (the tokenizer is "
                         "loaded with transformers' AutoTokenizer)")
    if tuple(cfg.dataset_additional_keys) != ("labels",):
        raise ValueError(f"dataset_additional_keys: {list(cfg.dataset_additional_keys)}: each prompt keeps its label "
                         "(map_keys.response) as `labels`, and nothing else reaches the verifiers; set ['labels']")
    keys = cfg.map_keys if cfg.map_keys != MapKeys() else HANDLERS[cfg.handler_name]
    rows = _read_rows(pathlib.Path(cfg.input))
    pairs = [_messages(row, keys, i) for i, row in enumerate(rows)]
    prompts = _render(cfg.prompt_type, cfg.tokenizer_name_or_path, [messages for messages, _ in pairs])
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
