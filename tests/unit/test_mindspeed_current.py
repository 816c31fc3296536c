"""MindSpeed-RL's current example configs (tests/fixtures/mindspeed/current, copied unchanged): each loads, or every key
it is refused on belongs to a capability not built yet, the one docs/config.md names for it."""
import pathlib
import subprocess
import sys

import pytest
import torch
import yaml

from trainer_helpers import megatron_tp1, random_batch, tiny_hf_model

from services.common.config import ConfigError, config_from_dict, config_from_translation, config_to_dict, load_config, read_config_file
from services.trainer.algorithm.estimators.interface import LogProbPasses
from services.trainer.modeling.logprobs import ForwardConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "mindspeed" / "current" / "configs"

LOADS = ["dapo_qwen25_32b_A2_20k", "dapo_qwen25_32b_A3", "dapo_qwen25_32b_A3_32k", "dapo_qwen3_32b_A3", "grpo_qwen25_32b_A2",
         "grpo_qwen25_7b_A3", "grpo_qwen3_8b_A3", "ppo_qwen25_32b_A3"]

# What is not built yet, by the key paths it refuses (docs/config.md, "MindSpeed-RL's example configs").
_DPO = ["megatron_training.stage", "megatron_training.no_save_optim", "megatron_training.no_save_rng",
        "megatron_training.is_pairwise_dataset", "megatron_training.dpo_loss_type", "megatron_training.norm_epsilon",
        "megatron_training.min-lr", "megatron_training.qk_layernorm", "megatron_training.ref_model",
        "megatron_training.refer_model_iter", "megatron_training.eval_interval", "megatron_training.eval_iters"]
_EP_INFERENCE = ["generate_config.infer_expert_parallel_size", "generate_config.enable_expert_parallel"]
_DEEPSEEK = ["model.deepseekv3_671b.multi_latent_attention", "megatron_training.num_layer_list", *_EP_INFERENCE]
REFUSED = {
    # its code tool maps to code_interpreter, which runs in the run's sandbox replicas
    "dapo_qwen25_7b_A2_multi_turn": ["rl_config.tool_response_truncate_side", "rl_config.max_parallel_calls",
                                     "rl_config.verifier_function"],
    "dapo_qwen3_30b_a3b_A3": _EP_INFERENCE,
    "dpo_qwen3_30b_a3b_A3": _DPO,
    # its own numbers disagree: max_model_len 10240 < 4 prompt + 10240 response tokens
    "grpo_deepseek_r1_671b_A2": [*_DEEPSEEK, "generate_config.max_model_len"],
    "grpo_deepseek_r1_671b_A3": _DEEPSEEK,
    # an expert map with vLLM's compiled model, which skips the router hook that counts tokens per expert
    "grpo_deepseek_r1_671b_A3_eplb": [*_DEEPSEEK, "generate_config.expert_map_path"],
    "grpo_lora_qwen25_32b_A2": ["megatron_training.lora_ckpt_filter", "megatron_training.lora_r", "megatron_training.lora_alpha",
                                "megatron_training.lora_fusion", "megatron_training.lora_target_modules", "rl_config.share_backbone"],
    "grpo_qwen25_32b_A3": ["megatron_training.num_layer_list"],
    "grpo_qwen3_235b_a22b_A2": ["megatron_training.noop_layers", "megatron_training.num_layers", *_EP_INFERENCE],
}


def test_every_example_is_listed_once():
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert sorted(LOADS + list(REFUSED)) == names and len(names) == 17


@pytest.mark.parametrize("name", LOADS)
def test_the_example_loads_and_says_why_each_key_it_drops_needs_none(name):
    translation = read_config_file(CONFIGS / f"{name}.yaml")
    config_from_translation(translation)
    for change in translation.changes:
        if " dropped" in change:
            key, _, reason = change.partition(" dropped")
            assert key and len(reason) > len(": ") + 10, change  # names the key and says why


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_example_is_refused_only_on_what_is_not_built(name):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / f"{name}.yaml")
    refused = sorted(e.split(":")[0] for e in err.value.errors)
    assert refused == sorted(REFUSED[name]), err.value.errors


def test_the_log_prob_passes_and_the_update_keep_mindspeed_rls_sizes():
    cfg = load_config(CONFIGS / "grpo_qwen25_32b_A2.yaml")
    assert cfg.megatron_training.micro_batch_size == 2
    sizes = {role: ForwardConfig.from_config(cfg, role).micro_batch_size for role in ("actor", "ref", "update")}
    assert sizes == {"actor": 64, "ref": 32, "update": 2}
    packed = load_config(CONFIGS / "dapo_qwen25_32b_A3_32k.yaml")
    budgets = {role: ForwardConfig.from_config(packed, role).max_packing_token_size for role in ("actor", "ref", "update")}
    assert budgets == {"actor": 65536, "ref": packed.rl_config.max_packing_token_size, "update": 32768}


def test_acc_for_dapo_names_the_verifier_dynamic_sampling_looks_at(tmp_path):
    translation = read_config_file(CONFIGS / "dapo_qwen25_32b_A3.yaml")
    cfg = config_from_translation(translation)
    assert cfg.rl_config.filter_groups_enable and cfg.rl_config.verifier_function == ("acc_for_dapo",)
    assert cfg.rl_config.filter_groups_metric == "acc"
    assert "rl_config.filter_groups_metric: 'acc_for_dapo' -> 'acc'" in "\n".join(translation.changes)


def test_the_import_command_writes_a_config_that_loads_to_the_same_run(tmp_path):
    out = tmp_path / "imported.yaml"
    source = CONFIGS / "grpo_qwen3_8b_A3.yaml"
    done = subprocess.run([sys.executable, "-m", "services", "config", "import", str(source), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "rl_config.rollout_max_tokens: unset -> 8192, generate_config.sampling_config.max_tokens" in done.stdout
    assert config_to_dict(load_config(out)) == config_to_dict(load_config(source))
    assert yaml.safe_load(out.read_text())["rl_config"]["actor_forward_micro_batch_size"] == 4


def test_a_forward_micro_batch_that_breaks_the_interleaved_schedule_is_refused():
    base = {"megatron_training": {"global_batch_size": 4, "micro_batch_size": 1, "pipeline_model_parallel_size": 2,
                                  "virtual_pipeline_model_parallel_size": 2},
            "rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 2}}}
    config_from_dict({**base, "rl_config": {**base["rl_config"], "actor_forward_micro_batch_size": 4}})  # 8 rows: 2 x 4
    with pytest.raises(ConfigError, match=r"rl_config.ref_forward_micro_batch_size: 8; the interleaved schedule needs each "
                                          r"rank's 8 rows of a log-prob pass cut into a multiple of pipeline_model_parallel_size 2"):
        config_from_dict({**base, "rl_config": {**base["rl_config"], "ref_forward_micro_batch_size": 8}})


def test_the_policy_and_reference_passes_run_in_their_own_micro_batches_with_the_same_log_probs(tmp_path):
    model, _ = megatron_tp1(tiny_hf_model(tmp_path / "hf"))
    batch = random_batch(0, [3, 5, 2, 4, 6, 3], [4, 2, 5, 3, 1, 4], vocab=64)
    calls = []
    hook = model.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        passes = LogProbPasses(model, model, batch, ForwardConfig(micro_batch_size=1), ForwardConfig(micro_batch_size=6),
                               ForwardConfig(micro_batch_size=3))
        old = passes.old_logprobs()
        assert len(calls) == 1  # one micro-batch of 6
        ref = passes.reference_logprobs()
        assert len(calls) == 3  # two of 3
        one_by_one = LogProbPasses(model, None, batch, ForwardConfig(micro_batch_size=1)).old_logprobs()
        assert len(calls) == 9
    finally:
        hook.remove()
    mask = batch.response_mask().bool()
    torch.testing.assert_close(old[mask], one_by_one[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ref[mask], one_by_one[mask], atol=1e-5, rtol=0)


def test_the_translations_own_lists_match_what_they_name():
    """The translation cannot import the rollout service (the import rule), so it names the tools it maps; and the
    filter metrics are rl_config's own."""
    import typing

    from services.common import mindspeed_layout
    from services.common.config import RLConfig
    from services.rollout.agent.tools import TOOLS

    assert sorted(mindspeed_layout._TOOLS_BUILT) == sorted(TOOLS)
    assert mindspeed_layout.SAMPLE_METRICS == typing.get_args(typing.get_type_hints(RLConfig)["filter_groups_metric"])
