"""The reward model's parts that need no engine: config keys, plans naming `reward_model`, the tiny
reward model and its fit, and `dockrl init-model --reward`."""
import json

import pytest
import torch

from services.cli import main
from services.common.config import ArithmeticConfig, ConfigError, load_config
from services.common.errors import InvalidArgument
from services.common.tiny_model import build_tiny_model, fit_reward_model, reward_examples
from services.reward.model import MODEL_VERIFIER
from services.reward.overlong import OverlongPenalty
from services.reward.pool import InProcessRunner
from services.reward.scoring import ScoreInput, ScoringPlan, score_samples


def test_reward_model_in_verifier_function_needs_reward_config_load():
    with pytest.raises(ConfigError, match=r"rl_config.verifier_function: reward_model is listed but reward_config.load is empty"):
        load_config(None, ["rl_config.verifier_function=[math_17k_acc, reward_model]", "rl_config.verifier_weight=[0.5, 0.5]"])
    with pytest.raises(ConfigError, match=r"reward_config.seq_length"):
        load_config(None, ["reward_config.load=/m", "reward_config.seq_length=0"])
    cfg = load_config(None, ["reward_config.load=/m", "rl_config.verifier_function=[reward_model]", "rl_config.verifier_weight=[1]"])
    plan = ScoringPlan.from_rl_config(cfg.rl_config)
    assert plan.uses_model and plan.rules == ()


def test_a_plan_with_the_model_on_a_replica_without_one_is_refused_naming_the_field():
    plan = ScoringPlan.create(["math_17k_acc", MODEL_VERIFIER], [0.5, 0.5], OverlongPenalty.from_rl_config(load_config().rl_config))
    assert plan.rules == ("math_17k_acc",)
    with pytest.raises(InvalidArgument, match=r"verifier_function: reward_model is not served here \(reward_config.load is empty"):
        score_samples([ScoreInput(r"\boxed{3}", "3", prompt="1+2=")], plan, InProcessRunner())
    with pytest.raises(InvalidArgument, match=r"unknown verifier 'reward_modle'; known: .*and reward_model where reward_config.load"):
        ScoringPlan.create(["reward_modle"], [1.0], plan.overlong)


def test_tiny_reward_model_is_a_one_label_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = build_tiny_model(tmp_path / "rm", prompt_type="empty", reward=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"] and len(cfg["id2label"]) == 1
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32  # a head_dim vLLM's CPU attention takes
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out)
    logits = model(**tok(["1+2=\\boxed{3}", "1+2=4"], return_tensors="pt", padding=True)).logits
    assert logits.shape == (2, 1) and torch.isfinite(logits).all()


def test_reward_examples_pair_each_problem_with_its_right_and_wrong_answers():
    examples = reward_examples(ArithmeticConfig(max_operand=1))
    assert len(examples) == 4 * 6
    assert ("1+1=\\boxed{2}", 1.0) in examples and ("1+1=2", 1.0) in examples
    assert ("1+1=\\boxed{3}", 0.0) in examples and ("1+1=0", 0.0) in examples


def test_fit_trains_in_place_and_reports_its_ranking(tmp_path):
    from safetensors.torch import load_file

    out = build_tiny_model(tmp_path / "rm", prompt_type="empty", reward=True)
    before = load_file(out / "model.safetensors")
    ranked = fit_reward_model(out, steps=2, spec=ArithmeticConfig(max_operand=3))
    after = load_file(out / "model.safetensors")
    assert 0.0 <= ranked <= 1.0
    assert not torch.equal(before["score.weight"], after["score.weight"])


def test_init_model_reward_flag(tmp_path, capsys):
    assert main(["init-model", "--reward", "--out", str(tmp_path / "rm"), "--fit-steps", "1",
                 "--set", "arithmetic.max_operand=2"]) == 0
    out = capsys.readouterr().out
    assert "reward model fit for 1 steps" in out and "tiny reward model written to" in out
    assert json.loads((tmp_path / "rm" / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    assert main(["init-model", "--out", str(tmp_path / "m"), "--fit-steps", "3"]) == 2
    assert "--fit-steps trains a reward model; give --reward too" in capsys.readouterr().err


def test_a_replica_refuses_a_model_it_cannot_serve_before_starting_an_engine(tmp_path):
    from services.common.errors import FailedPrecondition
    from services.reward.model import RewardModelScorer

    rm = build_tiny_model(tmp_path / "rm", prompt_type="empty", reward=True)
    policy = build_tiny_model(tmp_path / "policy", prompt_type="empty")
    cases = [
        ([f"reward_config.load={tmp_path / 'missing'}"], r"reward_config.load: cannot load '.*missing'"),
        ([f"reward_config.load={policy}"], r"reward_config.load: '.*policy' has 2 labels; a reward model has 1"),
        ([f"reward_config.load={rm}", "reward_config.seq_length=1024"],
         r"reward_config.seq_length: 1024 exceeds the model's max_position_embeddings 512"),
    ]
    for overrides, message in cases:
        with pytest.raises(FailedPrecondition, match=message):
            RewardModelScorer.start(load_config(None, overrides))


MIX = ["reward_config.load=/m", "rl_config.verifier_function=[math_17k_acc, reward_model]", "rl_config.verifier_weight=[0.5, 0.5]"]


def test_reward_model_replicas_must_have_a_model_part_and_a_rule_part_to_split():
    assert load_config(None, [*MIX, "reward_config.model_replicas=2"]).reward_config.model_replicas == 2
    with pytest.raises(ConfigError, match=r"reward_config.model_replicas: must be >= 0, got -1"):
        load_config(None, [*MIX, "reward_config.model_replicas=-1"])
    with pytest.raises(ConfigError, match=r"reward_config.model_replicas: 1 reward-model replicas would have nothing to score: "
                                          r"rl_config.verifier_function does not list reward_model"):
        load_config(None, ["reward_config.load=/m", "reward_config.model_replicas=1"])
    with pytest.raises(ConfigError, match=r"reward_config.model_replicas: rl_config.verifier_function lists only reward_model"):
        load_config(None, ["reward_config.load=/m", "rl_config.verifier_function=[reward_model]", "rl_config.verifier_weight=[1]",
                           "reward_config.model_replicas=1"])


def test_a_model_score_from_another_replica_is_the_model_part_without_a_model_here():
    plan = ScoringPlan.from_rl_config(load_config(None, MIX).rl_config)
    right, wrong = score_samples([ScoreInput(r"\boxed{3}", "3", prompt="1+2=", model_score=0.25),
                                  ScoreInput(r"\boxed{4}", "3", prompt="1+2=", model_score=-1.0)], plan, InProcessRunner())
    assert [(p.name, p.score) for p in right.parts] == [("math_17k_acc", 1.0), (MODEL_VERIFIER, 0.25)]
    assert right.total == pytest.approx(0.5 * 1.0 + 0.5 * 0.25) and wrong.total == pytest.approx(0.5 * -1.0)
    with pytest.raises(InvalidArgument, match=r"reward_model is not served here"):  # one sample without it: the model is needed
        score_samples([ScoreInput("a", "3", model_score=0.25), ScoreInput("b", "3")], plan, InProcessRunner())


def test_a_model_kind_replica_is_refused_unless_the_model_runs_apart(capsys):
    from services.common.errors import FailedPrecondition
    from services.reward.worker import RewardWorker

    plan = ScoringPlan.from_rl_config(load_config(None, MIX).rl_config)
    with pytest.raises(FailedPrecondition, match=r"a reward-model replica needs .*reward_config.model_replicas > 0"):
        RewardWorker(None, plan, InProcessRunner(), None, model=None, kind="model", split=False)
    with pytest.raises(InvalidArgument, match=r"kind: 'both' is not one of rule, model"):
        RewardWorker(None, plan, InProcessRunner(), None, kind="both")
    # The command line refuses it before starting a pool or an engine.
    assert main(["reward", "serve", "--kind", "model", "--port", "0", *[a for o in MIX for a in ("--set", o)]]) == 2
    assert "--kind model: reward_config.model_replicas is 0" in capsys.readouterr().err
