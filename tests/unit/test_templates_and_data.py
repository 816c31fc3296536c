"""Chat templates, the arithmetic generator and preprocessing."""
import json
import pathlib

import pytest

from services.common.config import ArithmeticConfig
from services.common.arithmetic_data import arithmetic_problems, write_arithmetic_dataset
from services.common.preprocess import PreprocessConfig, preprocess
from services.common.prompt_file import read_prompt_file
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
    records = read_prompt_file(tmp_path / "out/train", "data").records
    assert kept == len(records) == len(rows)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert records[0].label == rows[0]["answer"]
    assert tok.decode(records[0].prompt_ids) == records[0].prompt
    assert rows[0]["problem"] in records[0].prompt and records[0].prompt.startswith("<|im_start|>user")
    limit = len(records[0].prompt_ids) - 1
    short = PreprocessConfig(input=str(train), tokenizer_name_or_path=str(tiny_model_dir), output_prefix=str(tmp_path / "short"), seq_length=limit)
    assert preprocess(short, progress=False) < kept


@pytest.mark.parametrize("prompt", ["", "   ", None, [{"role": "user", "content": " "}]], ids=["empty", "blank", "null", "blank-chat"])
def test_preprocess_refuses_an_empty_prompt_naming_its_row(tmp_path, tiny_model_dir, prompt):
    rows = [{"problem": "1+1=", "answer": "2"}, {"problem": prompt, "answer": "3"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PreprocessConfig(input=str(tmp_path / "in.jsonl"), tokenizer_name_or_path=str(tiny_model_dir), output_prefix=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"input row 1: map_keys.prompt field 'problem' is empty"):
        preprocess(cfg, progress=False)


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
    assert read_prompt_file(tmp_path / "o", "data").records[0].prompt == "1+1="
    with pytest.raises(FileNotFoundError, match="megatron_training.data_path"):
        read_prompt_file(tmp_path / "nothing", "megatron_training.data_path")


DATASETS = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "datasets"


def _dapo_math_parquet(tmp_path) -> pathlib.Path:
    """DAPO-Math-17k's rows as the parquet it ships as (nested columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (DATASETS / "dapo_math_17k.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo-math-17k.parquet")
    return tmp_path / "dapo-math-17k.parquet"


@pytest.mark.parametrize("how", ["mindspeed_math_17k_handler", "dotted_map_keys"])
def test_dapo_math_17k_chat_prompts_and_nested_labels(tmp_path, tiny_model_dir, how):
    from services.common.preprocess import MapKeys

    # MindSpeed-RL's configs/datasets/math_17k.yaml (its handler, response: reward_model), or a dotted key.
    keys = {} if how == "mindspeed_math_17k_handler" else {"map_keys": MapKeys(prompt="prompt", response="reward_model.ground_truth")}
    cfg = PreprocessConfig(input=str(_dapo_math_parquet(tmp_path)), tokenizer_name_or_path=str(tiny_model_dir),
                           output_prefix=str(tmp_path / "dapo"), handler_name="Math17kAlpacaStyleInstructionHandler",
                           prompt_type="tokenizer", **keys)
    assert preprocess(cfg, progress=False) == 2
    records = read_prompt_file(tmp_path / "dapo", "data").records
    assert [r.label for r in records] == ["7", "6"]
    from transformers import AutoTokenizer

    # The conversation went through the tokenizer's own chat template, not str() of the list.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = json.loads((DATASETS / "dapo_math_17k.jsonl").read_text().splitlines()[0])
    assert records[0].prompt == tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert "What is 3 + 4?" in records[0].prompt and "'role'" not in records[0].prompt


def test_deepscaler_json_array_with_its_handler(tmp_path, tiny_model_dir):
    cfg = PreprocessConfig(input=str(DATASETS / "deepscaler.json"), tokenizer_name_or_path=str(tiny_model_dir),
                           output_prefix=str(tmp_path / "ds"), handler_name="R1AlpacaStyleInstructionHandler", prompt_type="qwen_r1")
    assert preprocess(cfg, progress=False) == 2
    records = read_prompt_file(tmp_path / "ds", "data").records
    assert [r.label for r in records] == ["8", "6"] and "Let $x = 2$" in records[0].prompt


@pytest.mark.parametrize("field, value, message", [
    ("map_keys", "reward_model.answer", r"map_keys.response field 'reward_model.answer' is missing"),
    ("tokenizer_type", "SentencePieceTokenizer", r"tokenizer_type: 'SentencePieceTokenizer' is not one of"),
    ("dataset_additional_keys", ("labels", "data_source"), r"dataset_additional_keys: \['labels', 'data_source'\]"),
])
def test_preprocessing_keys_that_cannot_work_are_named(tmp_path, tiny_model_dir, field, value, message):
    from services.common.preprocess import MapKeys

    given = {field: MapKeys(prompt="prompt", response=value) if field == "map_keys" else value}
    cfg = PreprocessConfig(input=str(_dapo_math_parquet(tmp_path)), tokenizer_name_or_path=str(tiny_model_dir),
                           output_prefix=str(tmp_path / "x"), prompt_type="empty", **given)
    with pytest.raises(ValueError, match=message):
        preprocess(cfg, progress=False)
