"""Chat templates, the arithmetic generator and preprocessing."""
import json

import pytest

from services.common.config import ArithmeticConfig
from services.common.arithmetic_data import arithmetic_problems, write_arithmetic_dataset
from services.common.preprocess import PreprocessConfig, load_prompts, preprocess
from services.common.templates import load_templates, render_prompt


def test_every_template_renders_the_user_text():
    assert set(load_templates()) >= {"qwen", "qwen_r1", "qwen_math_r1", "llama3", "empty"}
    for name in load_templates():
        text = render_prompt(name, [{"role": "user", "content": "What is 2+3?"}])
        assert "What is 2+3?" in text


def test_qwen_template_matches_qwen_chat_format():
    text = render_prompt("qwen", [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("empty", [{"role": "user", "content": "1+2="}]) == "1+2="
    assert "\\boxed{}" in render_prompt("qwen_math_r1", [{"role": "user", "content": "U"}])


def test_unknown_prompt_type_is_named():
    with pytest.raises(ValueError, match="prompt_type: 'qwen9' is not one of"):
        render_prompt("qwen9", [])


def test_arithmetic_split_is_disjoint_and_deterministic():
    spec = ArithmeticConfig(max_operand=9, ops=("+", "-"), seed=3)
    splits = arithmetic_problems(spec)
    train, test = splits.train, splits.test
    assert len(train) + len(test) == 200
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    assert len(test) == 40 and splits.all == train + test
    assert arithmetic_problems(spec) == splits
    assert all(str(eval(p["problem"][:-1])) == p["answer"] for p in train + test)


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_tokenizes_and_filters(tmp_path, tiny_model_dir, workers):
    train = write_arithmetic_dataset(tmp_path / "raw", ArithmeticConfig(max_operand=4))["train"]
    cfg = PreprocessConfig(input=str(train), tokenizer_name_or_path=str(tiny_model_dir), output_prefix=str(tmp_path / "out/train"),
                           prompt_type="qwen", workers=workers, seq_length=0)
    kept = preprocess(cfg, progress=False)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    records = load_prompts(tmp_path / "out/train")
    assert kept == len(records) == len(rows)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert records[0].label == rows[0]["answer"]
    assert tok.decode(records[0].prompt_ids) == records[0].prompt
    assert rows[0]["problem"] in records[0].prompt and records[0].prompt.startswith("<|im_start|>user")
    limit = len(records[0].prompt_ids) - 1
    short = PreprocessConfig(input=str(train), tokenizer_name_or_path=str(tiny_model_dir), output_prefix=str(tmp_path / "short"), seq_length=limit)
    assert preprocess(short, progress=False) < kept


def test_preprocess_reads_parquet_and_names_missing_fields(tmp_path, tiny_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "1+1=", "answer": "2"}]), tmp_path / "in.parquet")
    cfg = PreprocessConfig(input=str(tmp_path / "in.parquet"), tokenizer_name_or_path=str(tiny_model_dir), output_prefix=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"map_keys.prompt field 'problem' is missing"):
        preprocess(cfg, progress=False)
    from services.common.preprocess import MapKeys

    ok = PreprocessConfig(input=str(tmp_path / "in.parquet"), tokenizer_name_or_path=str(tiny_model_dir),
                          output_prefix=str(tmp_path / "o"), map_keys=MapKeys(prompt="question", response="answer"), prompt_type="empty")
    assert preprocess(ok, progress=False) == 1
    assert load_prompts(tmp_path / "o")[0].prompt == "1+1="
    with pytest.raises(FileNotFoundError, match="megatron_training.data_path"):
        load_prompts(tmp_path / "nothing")
