"""`dockrl up`'s preparation: tiny model, arithmetic data and warm start, each made once."""
import json

from services.common.config import config_from_dict
from services.common.prompt_file import read_prompt_file
from services.launch.prepare import prepare_run


def test_prepare_builds_each_piece_once(tmp_path):
    cfg = config_from_dict({
        "megatron_training": {"load": str(tmp_path / "model"), "tokenizer_name_or_path": str(tmp_path / "model"),
                              "data_path": str(tmp_path / "data/train")},
        "rl_config": {"n_samples_per_prompt": 2},
        "trainer": {"eval_data_path": str(tmp_path / "data/train"), "test_data_path": str(tmp_path / "data/test")},
        "init_model": {"warm_start_accuracy": 0.99, "warm_start_max_steps": 25, "warm_start_boxed_fraction": 0.3},
        "arithmetic": {"out_dir": str(tmp_path / "raw"), "ops": ["+", "-"]},
    })
    done = prepare_run(cfg)
    assert len(done) == 3, done
    train, test = (read_prompt_file(tmp_path / f"data/{name}", "data").records for name in ("train", "test"))
    assert (len(train), len(test)) == (160, 40)
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    marker = json.loads((tmp_path / "model/warm_start.json").read_text())
    assert 0.0 <= marker["answered"] < 0.99  # 25 steps cannot reach the target: it stopped at the limit
    assert marker["scored"] <= min(marker["answered"], marker["boxed"])
    assert prepare_run(cfg) == []


def test_prepare_builds_the_tiny_reward_model_where_reward_config_load_holds_none(tmp_path):
    # What compose's prepare service makes for the reward-model replicas (DOCKRL__REWARD_CONFIG__LOAD).
    rm = tmp_path / "reward_model"
    cfg = config_from_dict({
        "megatron_training": {"load": str(tmp_path / "model"), "tokenizer_name_or_path": str(tmp_path / "model"),
                              "data_path": str(tmp_path / "data/train")},
        "rl_config": {"n_samples_per_prompt": 2, "verifier_function": ["acc", "reward_model"], "verifier_weight": [0.5, 0.5]},
        "reward_config": {"load": str(rm), "model_replicas": 1},
        "init_model": {"reward_fit_steps": 1},
        "arithmetic": {"out_dir": str(tmp_path / "raw"), "max_operand": 2},
    })
    done = prepare_run(cfg)
    assert any(line.startswith(f"built tiny reward model in {rm} (fit 1 steps") for line in done), done
    assert json.loads((rm / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    assert prepare_run(cfg) == []
