"""Configs in MindSpeed-RL's layout load as they are, `dockrl config import` writes the same run in dockrl's layout,
and what cannot run here is refused by key with the reason."""
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from services.common.config import ConfigError, config_to_dict, load_config, read_config_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "mindspeed"
EXAMPLES = ["grpo_qwen25_7b", "dapo_qwen25_32b", "ppo_qwen25_7b", "tiny_dapo", "tiny_ppo"]


def _copy_fixture(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    shutil.copytree(FIXTURES / "model", tmp_path / "model")
    return pathlib.Path(shutil.copy(FIXTURES / f"{name}.yaml", tmp_path / f"{name}.yaml"))


def _edit(path: pathlib.Path, edit) -> pathlib.Path:
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_loads_and_imports_to_the_same_run(name, tmp_path):
    cfg = load_config(FIXTURES / f"{name}.yaml")
    out = tmp_path / "imported.yaml"
    done = subprocess.run([sys.executable, "-m", "services", "config", "import", str(FIXTURES / f"{name}.yaml"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "actor_config.tensor_model_parallel_size -> megatron_training.tensor_model_parallel_size" in done.stdout
    imported = yaml.safe_load(out.read_text())
    assert not {"defaults", "actor_config", "critic_config", "ref_config"} & set(imported)
    assert config_to_dict(load_config(out)) == config_to_dict(cfg)


def test_role_sections_merge_over_megatron_training_as_mindspeed_merges_them():
    cfg = load_config(FIXTURES / "dapo_qwen25_32b.yaml")
    mt, rl = cfg.megatron_training, cfg.rl_config
    assert (mt.tensor_model_parallel_size, mt.lr, mt.weight_decay, mt.save) == (8, 1e-6, 0.01, "./ckpt")
    # actor_config's load is the Megatron checkpoint; dockrl starts from the HF directory it was made from.
    assert mt.load == "./Qwen2.5-32B"
    assert mt.no_shuffle and rl.filter_groups_max_batches == -1 and rl.filter_groups_metric == "acc"
    ppo = load_config(FIXTURES / "ppo_qwen25_7b.yaml").megatron_training
    assert (ppo.lr, ppo.critic_lr) == (1e-6, 5e-6)


def test_every_change_is_listed():
    changes = read_config_file(FIXTURES / "grpo_qwen25_7b.yaml").changes
    said = "\n".join(changes)
    for key in ("megatron_training.use_flash_attn", "megatron_training.sequence_parallel", "rl_config.use_integrated_worker",
                "generate_config.offload_train_param", "rl_config.shuffle_minibatch -> rl_config.shuffle_mini_batch",
                "defaults.model qwen25_7b"):
        assert key in said, key


def test_mindspeed_rls_hybrid_context_parallel_keys_import(tmp_path):
    """MindSpeed-RL's hybrid_cp_algo with its ulysses_degree_in_cp (actor_config or megatron_training): the same keys here."""
    def hybrid(data):
        data["actor_config"].update(context_parallel_size=4, context_parallel_algo="hybrid_cp_algo", ulysses_degree_in_cp=2)
        data["rl_config"]["actor_resource"]["num_npus"] = 4

    mt = load_config(_edit(_copy_fixture(tmp_path, "tiny_dapo"), hybrid)).megatron_training
    assert (mt.context_parallel_size, mt.context_parallel_algo, mt.ulysses_degree_in_cp) == (4, "hybrid_cp_algo", 2)


def test_mindspeed_rls_eplb_keys_import(tmp_path):
    """MindSpeed-RL's EPLB example (configs/grpo_deepseek_r1_671b_A3_eplb.yaml): generate_config.expert_map_path is the
    same key here; its token-collection switches have no key, a replica always counts."""
    path = _edit(_copy_fixture(tmp_path, "grpo_qwen25_7b"), lambda d: d["generate_config"].update(
        eplb_token_collects=True, eplb_token_save_path="./json_file", expert_map_path="expert_map.json"))
    translation = read_config_file(path)
    assert translation.data["generate_config"]["expert_map_path"] == "expert_map.json"
    dropped = [c for c in translation.changes if c.startswith("generate_config.eplb_token_")]
    assert len(dropped) == 2 and all("GET /v1/expert_load" in c for c in dropped)
    assert load_config(path).generate_config.expert_map_path == "expert_map.json"


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d.setdefault("ref_config", {}).update(tensor_model_parallel_size=2),
     "ref_config.tensor_model_parallel_size: 2 differs from the actor's 4"),
    (lambda d: d["megatron_training"].update(hidden_dropout=0.1), "megatron_training.hidden_dropout: 0.1 cannot run here"),
    (lambda d: d["generate_config"].update(infer_expert_parallel_size=4), "generate_config.infer_expert_parallel_size: 4"),
    (lambda d: d.update(msprobe_config={"msprobe": True}), "msprobe_config.msprobe: true"),
    (lambda d: d["actor_config"].update(num_layer_list="16,12"), "megatron_training.num_layer_list: '16,12' cannot run here"),
    (lambda d: d["actor_config"].update(model="qwen25_72b"), "megatron_training.model: 'qwen25_72b' is not among"),
    (lambda d: d.update(defaults=[{"model": ["missing"]}]), "defaults.model: 'missing' has no model file"),
    (lambda d: d["rl_config"].update(filter_groups_enable=True, filter_groups_metric="grpo/acc_for_dapo_rewards/mean"),
     "rl_config.filter_groups_metric: 'grpo/acc_for_dapo_rewards/mean' names the verifier 'acc_for_dapo', which "
     "rl_config.verifier_function ['base_acc'] does not list"),
    (lambda d: d["actor_config"].update(lr_decay_stlye="cosine"), "megatron_training.lr_decay_stlye: unknown key (did you mean 'lr_decay_style'?)"),
])
def test_what_cannot_run_here_is_refused_by_key(edit, expected, tmp_path):
    path = _edit(_copy_fixture(tmp_path, "grpo_qwen25_7b"), edit)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert any(expected in e for e in err.value.errors), err.value.errors


def test_the_model_file_is_checked_against_the_checkpoints_config_json(tmp_path):
    hf = tmp_path / "Qwen2.5-7B"
    hf.mkdir()
    hf_config = {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    (hf / "config.json").write_text(json.dumps(hf_config))
    path = _edit(_copy_fixture(tmp_path, "grpo_qwen25_7b"), lambda d: d["megatron_training"].update(tokenizer_name_or_path=str(hf)))
    assert "the model file agrees with it" in "\n".join(read_config_file(path).changes)
    (hf / "config.json").write_text(json.dumps({**hf_config, "num_hidden_layers": 24}))
    with pytest.raises(ConfigError, match="model.qwen25_7b.num_layers: 28 but .* has num_hidden_layers 24"):
        load_config(path)
