"""A preprocessed prompt file with bad lines: each is left out, counted by reason and named by file and line."""
import json

import pytest

from services.common.prompt_file import read_prompt_file


def _good(index: int, tokens: int = 3) -> str:
    return json.dumps({"index": index, "prompt": f"p{index}", "prompt_ids": list(range(1, tokens + 1)), "label": "7"})


# (line text, reason, a piece of the detail): one of each kind of bad line a hand-edited file may hold
BAD = [
    ('{"index": 1, "prompt": "p1", "prompt_ids": [1, 2', "undecodable", "not JSON"),
    ("[1, 2, 3]", "not_an_object", "a JSON list"),
    (json.dumps({"index": 2, "prompt": "p2", "prompt_ids": [1, 2]}), "missing_field", "no label"),
    (json.dumps({"index": 3, "prompt": "p3", "prompt_ids": [1, 2], "label": 7}), "mistyped_field", "label has type int, expected str"),
    (json.dumps({"index": 4, "prompt": "p4", "prompt_ids": [1, "x"], "label": "7"}), "mistyped_field", "prompt_ids"),
    (json.dumps({"index": 5, "prompt": "", "prompt_ids": [], "label": "7"}), "empty_prompt", "no tokens"),
    (json.dumps({"index": 6, "prompt": "p6", "prompt_ids": list(range(1, 10)), "label": "7"}), "over_max_prompt_length",
     "9 tokens > rl_config.max_prompt_length 8"),
]


def test_every_kind_of_bad_line_is_left_out_counted_and_named_by_file_and_line(tmp_path):
    lines = [_good(0)] + [text for text, _, _ in BAD] + ["", _good(10)]
    path = tmp_path / "train.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"prompt": "\xff"}\n')
    data = read_prompt_file(tmp_path / "train", "megatron_training.data_path", max_prompt_length=8)
    assert [r.index for r in data.records] == [0, 10]
    assert data.counts() == {"undecodable": 2, "not_an_object": 1, "missing_field": 1, "mistyped_field": 2, "empty_prompt": 1,
                             "over_max_prompt_length": 1}
    named = data.named()
    for line_no, (_, reason, detail) in enumerate(BAD, start=2):
        assert any(n.startswith(f"{path}:{line_no}: {reason}: ") and detail in n for n in named), (line_no, named)
    assert named[-1].startswith(f"{path}:{len(lines) + 1}: undecodable: not UTF-8")
    assert data.report() == {"file": str(path), "kept": 2, "left_out": data.counts(), "lines": named}


def test_a_file_without_a_usable_line_is_an_error_naming_the_key_the_file_and_the_first_bad_line(tmp_path):
    (tmp_path / "eval.jsonl").write_text(BAD[2][0] + "\n" + BAD[6][0] + "\n")
    with pytest.raises(ValueError, match=rf"trainer.eval_data_path: {tmp_path}/eval.jsonl has no usable prompt \(1 missing_field, "
                                         rf"1 over_max_prompt_length\); the first: {tmp_path}/eval.jsonl:1: missing_field"):
        read_prompt_file(tmp_path / "eval", "trainer.eval_data_path", max_prompt_length=8)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no usable prompt \\(the file is empty\\)"):
        read_prompt_file(tmp_path / "empty", "trainer.eval_data_path")
    with pytest.raises(FileNotFoundError, match="trainer.test_data_path: .*nothing.jsonl does not exist"):
        read_prompt_file(tmp_path / "nothing", "trainer.test_data_path")


def test_without_a_length_limit_a_long_prompt_is_kept(tmp_path):
    (tmp_path / "d.jsonl").write_text(_good(0, tokens=5000) + "\n")
    assert len(read_prompt_file(tmp_path / "d", "megatron_training.data_path").records[0].prompt_ids) == 5000
