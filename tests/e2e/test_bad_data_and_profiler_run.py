"""One `dockrl up` run, two checks that do not touch each other (one run instead of two: each `dockrl up`
costs about 40 s of service start-up on CI's 2 cores):

- its training and evaluation files hold one bad line of each kind: the run trains and evaluates on
  the good lines, and names every bad one by file and line;
- profiler_config: the trainer, the rollout replica and the reward worker each trace the configured
  step (one Chrome trace per trainer step and rank; vLLM's traces of the replica; the reward worker's),
  and nothing else.
"""
import json
import pathlib
from dataclasses import dataclass

import pytest

from tests.e2e.conftest import run_dockrl_up

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



@dataclass
class Run:
    summary: dict
    log_dir: pathlib.Path
    files: dict[str, tuple[pathlib.Path, dict[int, str], int]]  # report name -> (file, its bad lines' numbers, good lines)
    traces: pathlib.Path


@pytest.fixture(scope="module")
def run(warm_model, tmp_path_factory) -> Run:
    base = tmp_path_factory.mktemp("bad-data-profiled")
    train_good = (warm_model / "data/train.jsonl").read_text().splitlines()
    eval_good = (warm_model / "data/test.jsonl").read_text().splitlines()[:8]
    train_text, train_bad = _with_bad_lines(train_good, len(train_good) // 7)
    eval_text, eval_bad = _with_bad_lines(eval_good, 1)
    (base / "train.jsonl").write_text(train_text)
    (base / "eval.jsonl").write_text(eval_text)
    save = base / "traces"
    roles = [f"profiler_config.{role}.{key}={value}" for role in ("trainer", "rollout", "reward")
             for key, value in (("profile", "true"), ("profile_step_start", 2), ("profile_step_end", 3),
                                ("profile_save_path", save))]
    metrics, summary, log_dir = run_dockrl_up(warm_model, base / "run", (
        "megatron_training.train_iters=3", f"megatron_training.data_path={base}/train",
        f"trainer.eval_data_path={base}/eval", "trainer.test_data_path=",
        "profiler_config.trainer.profile_with_memory=true", *roles))
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2, 3]
    return Run(summary, log_dir, {"train": (base / "train.jsonl", train_bad, len(train_good)),
                                  "accuracy": (base / "eval.jsonl", eval_bad, len(eval_good))}, save)


def test_bad_training_and_evaluation_lines_are_left_out_named_and_the_run_finishes(run):
    summary = run.summary
    assert summary["prompts"]["trained_from"] == run.files["train"][2]
    assert summary["eval_prompts"] == {"accuracy": run.files["accuracy"][2]} and summary["accuracy_after"] is not None
    trainer_log = (run.log_dir / "services" / "trainer.log").read_text()
    for name, (path, bad_at, kept) in run.files.items():
        report = summary["data"][name]
        assert report["file"] == str(path) and report["kept"] == kept
        assert report["left_out"] == {kind: 1 for kind in BAD_LINES}
        named = {int(line.split(":")[1]): line.split(":")[2].strip() for line in report["lines"]}
        assert named == bad_at, (named, bad_at)
        for line in report["lines"]:  # the same report at start-up, in the trainer's log
            assert line in trainer_log


def test_each_role_traces_only_the_configured_steps(run):
    save = run.traces
    traces = sorted((save / "rank0").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0_step2"], traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # The iteration and its stages are named ranges; memory records come with profile_with_memory.
    assert {"iteration 2", "collect_scored_groups", "actor_update", "weight_gather", "weight_push"} <= names, sorted(n for n in names if n)[:50]
    assert any(e.get("name") == "[memory]" for e in events)

    # The rollout replica: vLLM's profiler, started for step 2's generation (its files carry the step).
    rollout = sorted((save / "rollout").glob("*/*.json"))
    assert rollout and all(t.name.startswith("step2") for t in rollout), rollout
    forward = {e.get("name") for t in rollout for e in json.loads(t.read_text())["traceEvents"]}
    assert any("aten::" in str(n) for n in forward), sorted(str(n) for n in forward)[:40]

    # The reward worker: one trace over step 2's claims and scoring.
    reward = sorted((save / "reward").glob("*/*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in reward] == ["reward_step2"], reward
    scored = {e.get("name") for e in json.loads(reward[0].read_text())["traceEvents"]}
    assert {"dock_claim", "score_samples", "dock_put"} <= scored, sorted(str(n) for n in scored)[:40]
