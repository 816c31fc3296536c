"""A `dockrl up` run whose training and evaluation files hold one bad line of each kind: the run
trains and evaluates on the good lines, and names every bad one by file and line."""
import json

import pytest

pytestmark = [pytest.mark.service, pytest.mark.slow]

# One line of each kind a hand-edited or foreign file may hold (the tiny config's max_prompt_length is 32 tokens)
BAD_LINES = {
    "undecodable": '{"index": 0, "prompt": "3+4=", "prompt_ids": [18, 10',
    "not_an_object": '"3+4="',
    "missing_field": json.dumps({"index": 0, "prompt": "3+4=", "prompt_ids": [18, 10, 19, 28]}),
    "mistyped_field": json.dumps({"index": 0, "prompt": "3+4=", "prompt_ids": [18, 10, 19, 28], "label": 7}),
    "empty_prompt": json.dumps({"index": 0, "prompt": "", "prompt_ids": [], "label": "7"}),
    "over_max_prompt_length": json.dumps({"index": 0, "prompt": "1+" * 40, "prompt_ids": [18, 10] * 40, "label": "41"}),
}


def _with_bad_lines(good: list[str], every: int) -> tuple[str, dict[int, str]]:
    """The good lines with one bad line of each kind after every `every` of them; the bad lines' numbers."""
    lines, bad_at = [], {}
    kinds = iter(BAD_LINES.items())
    for i, line in enumerate(good):
        lines.append(line)
        if (i + 1) % every == 0 and (kind := next(kinds, None)):
            lines.append(kind[1])
            bad_at[len(lines)] = kind[0]
    assert len(bad_at) == len(BAD_LINES)
    return "\n".join(lines) + "\n", bad_at


def test_bad_training_and_evaluation_lines_are_left_out_named_and_the_run_finishes(run_up, warm_model, tmp_path):
    train_good = (warm_model / "data/train.jsonl").read_text().splitlines()
    eval_good = (warm_model / "data/test.jsonl").read_text().splitlines()[:8]
    train_text, train_bad = _with_bad_lines(train_good, len(train_good) // 7)
    eval_text, eval_bad = _with_bad_lines(eval_good, 1)
    (tmp_path / "train.jsonl").write_text(train_text)
    (tmp_path / "eval.jsonl").write_text(eval_text)

    metrics, summary, log_dir = run_up("megatron_training.train_iters=2", f"megatron_training.data_path={tmp_path}/train",
                                       f"trainer.eval_data_path={tmp_path}/eval", "trainer.test_data_path=", name="run")
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert summary["prompts"]["trained_from"] == len(train_good)
    assert summary["eval_prompts"] == {"accuracy": len(eval_good)} and summary["accuracy_after"] is not None
    trainer_log = (log_dir / "services" / "trainer.log").read_text()
    for name, path, bad_at, kept in (("train", tmp_path / "train.jsonl", train_bad, len(train_good)),
                                     ("accuracy", tmp_path / "eval.jsonl", eval_bad, len(eval_good))):
        report = summary["data"][name]
        assert report["file"] == str(path) and report["kept"] == kept
        assert report["left_out"] == {kind: 1 for kind in BAD_LINES}
        named = {int(line.split(":")[1]): line.split(":")[2].strip() for line in report["lines"]}
        assert named == bad_at, (named, bad_at)
        for line in report["lines"]:  # the same report at start-up, in the trainer's log
            assert line in trainer_log
