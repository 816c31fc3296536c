"""Config loading: good configs load, each class of bad config fails naming the key path."""
import pathlib

import pytest
import yaml

from services.common.config import ConfigError, config_from_dict, load_config

CONFIGS = sorted(pathlib.Path(__file__).resolve().parents[2].glob("configs/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.rl_config.actor_rollout_dispatch_size % cfg.rl_config.n_samples_per_prompt == 0
    assert cfg.rl_config.rollout_max_tokens == cfg.generate_config.sampling_config.max_tokens


def test_mindspeed_defaults():
    cfg = config_from_dict({"rl_config": {"adv_estimator": "gae"}})
    rl = cfg.rl_config
    assert (rl.n_samples_per_prompt, rl.clip_ratio, rl.entropy_coeff) == (1, 0.2, 0.0)
    assert (rl.guarantee_order, rl.shuffle_mini_batch, rl.partial_rollout_max_split) == (False, False, 1)
    assert (rl.overlong_buffer_enable, rl.rollout_max_tokens) == (False, 2048)


def test_dispatch_sizes_derived_from_gbs_n_and_dp():
    cfg = config_from_dict({
        "megatron_training": {"global_batch_size": 8, "tensor_model_parallel_size": 2},
        "rl_config": {"n_samples_per_prompt": 4, "actor_resource": {"num_npus": 4}},
        "rollout": {"replicas": 2},
    })
    rl = cfg.rl_config
    assert rl.actor_rollout_dispatch_size == 16  # 8 * 4 / 2 rollout replicas
    assert rl.reward_dispatch_size == 32
    assert rl.mini_batch_size == 32


def test_context_parallel_ranks_share_samples_so_the_data_parallel_size_leaves_them_out():
    cfg = config_from_dict({
        "megatron_training": {"global_batch_size": 4, "context_parallel_size": 2, "context_parallel_algo": "ulysses_cp_algo"},
        "rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 4}},
    })
    assert cfg.actor_data_parallel_size == 2


def test_hybrid_context_parallel_loads_with_a_ulysses_degree_dividing_it():
    cfg = config_from_dict({
        "megatron_training": {"global_batch_size": 2, "context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo",
                              "ulysses_degree_in_cp": 2},
        "rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 8}},
    })
    assert (cfg.megatron_training.ulysses_degree_in_cp, cfg.actor_data_parallel_size) == (2, 2)



def test_token_budget_micro_batches_come_in_a_multiple_of_pp_under_the_interleaved_schedule():
    from services.trainer.modeling.logprobs import ForwardConfig

    cfg = config_from_dict({
        "megatron_training": {"global_batch_size": 2, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        "rl_config": {"n_samples_per_prompt": 2, "use_dynamic_bsz": True, "use_remove_padding": True, "actor_resource": {"num_npus": 2}},
    })
    assert ForwardConfig.from_config(cfg).count_multiple_of == 2
    plain = config_from_dict({"rl_config": {"n_samples_per_prompt": 2, "use_dynamic_bsz": True,
                                            "actor_resource": {"num_npus": 2}},
                              "megatron_training": {"pipeline_model_parallel_size": 2}})
    assert ForwardConfig.from_config(plain).count_multiple_of == 1

def test_explicit_dispatch_size_kept():
    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": 2, "actor_rollout_dispatch_size": 4},
                            "megatron_training": {"global_batch_size": 4}})
    assert cfg.rl_config.actor_rollout_dispatch_size == 4


def test_scientific_notation_read_as_number():
    assert config_from_dict(yaml.safe_load("megatron_training: {lr: 1e-6}\nrl_config: {adv_estimator: gae}")).megatron_training.lr == 1e-6


@pytest.mark.parametrize("key, value, message", [
    ("megatron_training.global_batch_size", "2", "expected an integer, got str '2'"),
    ("megatron_training.global_batch_size", True, "expected an integer, got bool True"),
    ("rl_config.use_remove_padding", 1, "expected true or false, got 1"),
    ("rl_config.clip_ratio", True, "expected a number, got bool True"),
    ("rl_config.kl_penalty", "k9", "'k9' is not one of kl, k1, abs, mse, k2, low_var_kl, k3"),
    ("profiler_config.trainer.profile_ranks", {"a": 1}, "expected list of int or str, got dict {'a': 1}"),
])
def test_values_are_read_as_a_yaml_author_means_them(key, value, message):
    """YAML's own types are kept: no quietly turning '2', true or 1 into another type's value."""
    section, _, name = key.rpartition(".")
    data = {"rl_config": {"n_samples_per_prompt": 2}}
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[name] = value
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.errors == [f"{key}: {message}"]


def test_one_item_stands_for_a_list_and_integers_for_numbers():
    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": 2, "clip_ratio": 0},
                            "generate_config": {"sampling_config": {"stop": "</s>"}}})
    assert cfg.generate_config.sampling_config.stop == ("</s>",)
    assert cfg.rl_config.clip_ratio == 0.0 and isinstance(cfg.rl_config.clip_ratio, float)


def test_config_reference_shows_each_keys_range_and_choices():
    reference = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert "| `global_batch_size` | int > 0 | `1` |" in reference
    assert "| `top_p` | float in (0, 1] | `1.0` |" in reference
    assert "| `adv_estimator` | group_norm \\| gae \\| rloo \\| reinforce_plus_plus \\| reinforce_plus_plus_baseline | `'group_norm'` |" in reference
    assert "| `grpc_port` | TCP port | `50051` |" in reference


def test_config_is_frozen():
    cfg = config_from_dict({"rl_config": {"adv_estimator": "gae"}})
    with pytest.raises(Exception):
        cfg.rl_config.clip_ratio = 0.3


@pytest.mark.parametrize("data, match", [
    ({"rl_config": {"n_samples_per_promt": 4}}, r"rl_config\.n_samples_per_promt: unknown key \(did you mean 'n_samples_per_prompt'\?\)"),
    ({"rollout_config": {}}, r"rollout_config: unknown key"),
    ({"rl_config": {"clip_ratio": "wide"}}, r"rl_config\.clip_ratio: expected a number, got str 'wide'"),
    ({"rl_config": {"guarantee_order": "yes"}}, r"rl_config\.guarantee_order: expected true or false"),
    ({"megatron_training": {"global_batch_size": 2.5}}, r"megatron_training\.global_batch_size: expected an integer"),
    ({"generate_config": {"sampling_config": {"stop": 5}}}, r"generate_config\.sampling_config\.stop\[0\]: expected a string"),
    ({"generate_config": "fast"}, r"generate_config: expected a mapping"),
    ({"rl_config": {"n_samples_per_prompt": 2, "filter_groups_train_batch_size": 4}},
     r"rl_config\.filter_groups_train_batch_size: 4 has no effect without filter_groups_enable"),
    ({"rl_config": {"n_samples_per_prompt": 2, "filter_groups_enable": True, "filter_groups_train_batch_size": 3, "mini_batch_size": 4}},
     r"rl_config\.mini_batch_size: 4 must divide filter_groups_train_batch_size \* n_samples_per_prompt = 6"),
    ({"generate_config": {"sampling_config": {"max_tokens": 1024}}},
     r"rl_config\.rollout_max_tokens: 2048 != generate_config\.sampling_config\.max_tokens 1024"),
    ({"rl_config": {"guarantee_order": True, "partial_rollout_max_split": 2, "n_samples_per_prompt": 2}},
     r"rl_config\.guarantee_order: cannot be true with partial_rollout_max_split > 1"),
    ({"rl_config": {"verifier_function": ["acc", "format"], "verifier_weight": [1.0], "n_samples_per_prompt": 2}},
     r"rl_config\.verifier_weight: 1 weights for 2 verifier_function entries"),
    ({"rl_config": {"n_samples_per_prompt": 1}}, r"rl_config\.n_samples_per_prompt: group_norm advantages need at least 2"),
    ({"rl_config": {"n_samples_per_prompt": 3, "actor_rollout_dispatch_size": 4}, "megatron_training": {"global_batch_size": 4}},
     r"rl_config\.actor_rollout_dispatch_size: 4 is not a multiple of n_samples_per_prompt=3"),
    ({"rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 3}, "megatron_training": {"global_batch_size": 4}},
     r"rl_config\.mini_batch_size: 3 must divide global_batch_size \* n_samples_per_prompt = 8"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "generate_config": {"sampling_config": {"top_p": 0}}},
     r"generate_config\.sampling_config\.top_p: must be in \(0, 1\], got 0"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "megatron_training": {"tensor_model_parallel_size": 3}},
     r"rl_config\.actor_resource\.num_npus: 1 is not a multiple of tensor_model_parallel_size"),
    ({"rl_config": {"n_samples_per_prompt": 2, "kl_penalty": "k9"}}, r"rl_config\.kl_penalty: 'k9' is not one of"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 2}}, "megatron_training": {"context_parallel_size": 4}},
     r"rl_config\.actor_resource\.num_npus: 2 is not a multiple of tensor_model_parallel_size \* pipeline_model_parallel_size \* "
     r"context_parallel_size = 4"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 4}},
      "megatron_training": {"context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo"}},
     r"megatron_training\.ulysses_degree_in_cp: hybrid_cp_algo needs it"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 4}},
      "megatron_training": {"context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 1}},
     r"megatron_training\.ulysses_degree_in_cp: 1; hybrid_cp_algo needs Ulysses groups of at least 2 ranks"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 4}},
      "megatron_training": {"context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 3}},
     r"megatron_training\.ulysses_degree_in_cp: 3 does not divide context_parallel_size 4"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 4}},
      "megatron_training": {"context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 4}},
     r"megatron_training\.ulysses_degree_in_cp: 4 leaves a ring of 1 group\(s\) out of context_parallel_size 4"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 4}},
      "megatron_training": {"context_parallel_size": 4, "context_parallel_algo": "ulysses_cp_algo", "ulysses_degree_in_cp": 2}},
     r"megatron_training\.ulysses_degree_in_cp: 2 is read by context_parallel_algo hybrid_cp_algo only"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "megatron_training": {"context_parallel_algo": "ring"}},
     r"megatron_training\.context_parallel_algo: 'ring' is not one of ulysses_cp_algo, megatron_cp_algo, hybrid_cp_algo"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 2}},
      "megatron_training": {"context_parallel_size": 2, "seq_length": 4098}},
     r"megatron_training\.seq_length: 4098 is not a multiple of 2 \* context_parallel_size = 4"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "megatron_training": {"virtual_pipeline_model_parallel_size": 2}},
     r"megatron_training\.virtual_pipeline_model_parallel_size: the interleaved schedule needs pipeline_model_parallel_size >= 2, got 1"),
    ({"rl_config": {"n_samples_per_prompt": 3, "actor_resource": {"num_npus": 2}},
      "megatron_training": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}},
     r"megatron_training\.virtual_pipeline_model_parallel_size: the interleaved schedule needs the micro-batches of a mini-batch "
     r"a multiple of pipeline_model_parallel_size 2; rl_config\.mini_batch_size 3 / \(micro_batch_size 1 x data-parallel size 1\) = 3"),
    ({"rl_config": {"n_samples_per_prompt": 2, "use_dynamic_bsz": True, "actor_resource": {"num_npus": 2}},
      "megatron_training": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}},
     r"megatron_training\.virtual_pipeline_model_parallel_size: with rl_config\.use_dynamic_bsz the interleaved schedule pads "
     r"every micro-batch .* set rl_config\.use_remove_padding true"),
    ({"rl_config": {"n_samples_per_prompt": 3, "use_dynamic_bsz": True, "use_remove_padding": True, "actor_resource": {"num_npus": 2}},
      "megatron_training": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}},
     r"megatron_training\.virtual_pipeline_model_parallel_size: with rl_config\.use_dynamic_bsz each rank's rows of a mini-batch "
     r"must be a multiple of pipeline_model_parallel_size 2; rl_config\.mini_batch_size 3 / data-parallel size 1 = 3"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "megatron_training": {"context_parallel_size": 0}},
     r"megatron_training\.context_parallel_size: must be > 0, got 0"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "rollout": {"grpc_port": 70000}}, r"rollout\.grpc_port: 70000 is not a TCP port"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "trainer": {"weight_transport": "nccl"}},
     r"trainer\.weight_transport: 'nccl' is not one of grpc, collective"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "init_model": {"warm_start_boxed_fraction": 1.5}},
     r"init_model\.warm_start_boxed_fraction: must be in \[0, 1\], got 1\.5"),
    ({"rl_config": {"n_samples_per_prompt": 2, "use_decoupled_loss": True, "behav_imp_weight_cap": 0.5}},
     r"rl_config\.behav_imp_weight_cap: must be 0 \(no cap\) or > 1, got 0\.5"),
    ({"rl_config": {"n_samples_per_prompt": 2, "behav_imp_weight_cap": 5.0}},
     r"rl_config\.behav_imp_weight_cap: caps the decoupled loss's behaviour weight; set rl_config\.use_decoupled_loss"),
    ({"rl_config": {"n_samples_per_prompt": 2, "max_staleness": -1}}, r"rl_config\.max_staleness: must be >= 0, got -1"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"redis_sentinels": ["127.0.0.1:26379"]}},
     r"dock\.redis_sentinel_master: empty; give the master name"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"redis_sentinel_master": "m"}},
     r"dock\.redis_sentinel_master: set without dock\.redis_sentinels"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"redis_sentinels": ["sentinel-a"], "redis_sentinel_master": "m"}},
     r"dock\.redis_sentinels\[0\]: 'sentinel-a' is not host:port"),
    ({"rl_config": {"n_samples_per_prompt": 2},
      "dock": {"redis_sentinels": ["s:26379"], "redis_sentinel_master": "m", "redis_url": "redis://r:6379/0"}},
     r"dock\.redis_url: 'redis://r:6379/0' set together with dock\.redis_sentinels"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"redis_sentinels": ["s:26379"], "redis_sentinel_master": "m", "redis_cluster": True}},
     r"dock\.redis_cluster: cannot be true with dock\.redis_sentinels"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"redis_sentinels": ["s:26379"], "redis_sentinel_master": "m", "redis_tls": True}},
     r"dock\.redis_tls: not supported with dock\.redis_sentinels"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"min_replicas_acked": -1}}, r"dock\.min_replicas_acked: must be >= 0, got -1"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"min_replicas_acked": 1, "redis_cluster": True}},
     r"dock\.min_replicas_acked: not supported with dock\.redis_cluster"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"min_replicas_acked": 1, "replica_ack_timeout_s": 30}},
     r"dock\.replica_ack_timeout_s: 30\.0 must be below dock\.socket_timeout_s 30\.0"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "dock": {"replica_ack_timeout_s": 0}}, r"dock\.replica_ack_timeout_s: must be > 0, got 0"),
    ({"rl_config": {"n_samples_per_prompt": 2, "kl_ctrl_type": "pid"}}, r"rl_config\.kl_ctrl_type: 'pid' is not one of"),
    ({"rl_config": {"n_samples_per_prompt": 2, "filter_groups_metric": "pass_rate"}}, r"rl_config\.filter_groups_metric: 'pass_rate' is not one of acc"),
    ({"rl_config": {"n_samples_per_prompt": 2, "verifier_function": ["base_acc", "acc_for_grpo"], "verifier_weight": [1.0, 1.0]}},
     r"rl_config\.verifier_function: 'acc_for_grpo' is not a verifier; the verifiers: format, strict_format, base_acc, "),
    ({"rl_config": {"n_samples_per_prompt": 2, "use_kl_in_reward": True}},
     r"rl_config\.use_kl_in_reward: group_norm advantages normalise each group's rewards"),
    ({"rl_config": {"n_samples_per_prompt": 2, "loss_agg_mode": "seq-sum"}}, r"rl_config\.loss_agg_mode: 'seq-sum' is not one of token-mean, "),
    ({"rl_config": {"n_samples_per_prompt": 2, "loss_agg_mode": "token-mean", "token_level_loss": False}},
     r"rl_config\.loss_agg_mode: token-mean contradicts token_level_loss: false"),
    ({"rl_config": {"n_samples_per_prompt": 2, "kl_ctrl_type": "adaptive", "init_kl_coef": 0.0}},
     r"rl_config\.init_kl_coef: the adaptive KL controller scales the coefficient, so it needs one > 0"),
    ({"rl_config": {"n_samples_per_prompt": 2, "kl_ctrl_type": "adaptive", "kl_target": 0}}, r"rl_config\.kl_target: must be > 0"),
    ({"rl_config": {"n_samples_per_prompt": 2, "kl_ctrl_type": "adaptive", "kl_horizon": 0}}, r"rl_config\.kl_horizon: must be >= 1"),
    ({"rl_config": {"n_samples_per_prompt": 2, "actor_resource": {"num_npus": 2}}, "megatron_training": {"expert_model_parallel_size": 4}},
     r"megatron_training\.expert_model_parallel_size: 4 expert-parallel ranks x tensor_model_parallel_size x "
     r"pipeline_model_parallel_size = 4 does not divide rl_config\.actor_resource\.num_npus 2"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "megatron_training": {"expert_model_parallel_size": 0}},
     r"megatron_training\.expert_model_parallel_size: must be > 0, got 0"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "generate_config": {"expert_map_path": "map.json", "enforce_eager": False}},
     r"generate_config\.expert_map_path: needs generate_config\.enforce_eager: true"),
    ({"rl_config": {"n_samples_per_prompt": 2, "routing_replay": True}, "generate_config": {"enforce_eager": False}},
     r"rl_config\.routing_replay: needs generate_config\.enforce_eager: true"),
    ({"rl_config": {"n_samples_per_prompt": 2, "routing_replay": True}, "generate_config": {"enable_prefix_caching": True}},
     r"rl_config\.routing_replay: needs generate_config\.enable_prefix_caching: false"),
    ({"rl_config": {"n_samples_per_prompt": 2, "routing_replay": True, "actor_resource": {"num_npus": 2}},
      "megatron_training": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}},
     r"rl_config\.routing_replay: not built with megatron_training\.virtual_pipeline_model_parallel_size"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "init_model": {"architecture": "mixtral"}},
     r"init_model\.architecture: 'mixtral' is not one of qwen2, qwen3, qwen2_moe, qwen3_moe"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "init_model": {"num_experts": 8}},
     r"init_model\.num_experts: 8 has no effect on architecture 'qwen2'; remove it"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "init_model": {"architecture": "qwen3_moe", "shared_expert_intermediate_size": 64}},
     r"init_model\.shared_expert_intermediate_size: 64 has no effect on architecture 'qwen3_moe'"),
    ({"rl_config": {"n_samples_per_prompt": 2}, "init_model": {"architecture": "qwen2_moe", "num_experts_per_tok": 5}},
     r"init_model\.num_experts_per_tok: 5 is more than num_experts 4"),
])
def test_bad_config_names_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"rl_config": {"clip_ratio": "x", "epochs": "y"}, "dock": {"prefx": "a"}})
    assert len(info.value.errors) == 3


def test_overrides_and_file_errors(tmp_path):
    cfg = load_config(None, ["rollout.grpc_port=50099", "rl_config.entropy_coeff=0.01", "trainer.eval_data_path="])
    assert cfg.rollout.grpc_port == 50099 and cfg.rl_config.entropy_coeff == 0.01 and cfg.trainer.eval_data_path == ""
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["rollout.grpc_port"])
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl_config: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("DOCKRL__DOCK__REDIS_URL", "redis://redis:6379/0")
    monkeypatch.setenv("DOCKRL__GENERATE_CONFIG__SAMPLING_CONFIG__TOP_K", "5")
    cfg = load_config(None, ["generate_config.sampling_config.top_k=7"])
    assert cfg.dock.redis_url == "redis://redis:6379/0"
    assert cfg.generate_config.sampling_config.top_k == 7  # --set wins over the environment
    monkeypatch.setenv("DOCKRL__DOCK__LEASE_SECOND", "3")
    with pytest.raises(ConfigError, match=r"dock\.lease_second: unknown key \(did you mean 'lease_seconds'\?\)"):
        load_config(None)


def _profiler(**keys) -> dict:
    return {"rl_config": {"n_samples_per_prompt": 2}, "profiler_config": {"trainer": keys}}


@pytest.mark.parametrize("keys, match", [
    ({"mstx": True}, r"profiler_config\.trainer\.mstx: Ascend's mstx marks are not built"),
    ({"profile_analysis": True}, r"profiler_config\.trainer\.profile_analysis: torch_npu's analysis is not built"),
    ({"stage": "actor_update"}, r"profiler_config\.trainer\.stage: 'actor_update' is not one of all"),
    ({"profile_export_type": "db"}, r"profiler_config\.trainer\.profile_export_type: 'db' is not one of text"),
    ({"profile_level": "level1"}, r"profiler_config\.trainer\.profile_level: 'level1': the levels are torch_npu's"),
    ({"profile_step_start": 3, "profile_step_end": 3}, r"profiler_config\.trainer\.profile_step_end: steps 3 \.\. 3 .* profile nothing"),
    ({"profile_ranks": "some"}, r"profiler_config\.trainer\.profile_ranks: 'some' is not 'all' or a list of ranks"),
    ({"profile_ranks": ["0"]}, r"profiler_config\.trainer\.profile_ranks\[0\]: expected an integer"),
    ({"profile": True, "profile_with_cpu": False, "profile_with_npu": False}, r"profiler_config\.trainer\.profile_with_cpu: with profile_with_npu false too"),
])
def test_profiler_config_refuses_torch_npu_only_values(keys, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(_profiler(**keys))


def test_profiler_ranks_take_all_or_a_list():
    # MindSpeed-RL's colocated role is the trainer's here (a file in its layout is translated); the services profile apart.
    with pytest.raises(ConfigError, match=r"profiler_config\.integrated: unknown key \(known keys: reward, rollout, trainer\)"):
        config_from_dict({"profiler_config": {"integrated": {}}})
    assert config_from_dict(_profiler(profile_ranks="all")).profiler_config.trainer.profile_ranks == "all"
    assert config_from_dict(_profiler(profile_ranks=[0, 2])).profiler_config.trainer.profile_ranks == (0, 2)
    with pytest.raises(ConfigError, match=r"profiler_config\.rollout\.profile_ranks: rollout replicas have no rank; set all"):
        config_from_dict({"profiler_config": {"rollout": {"profile": True, "profile_ranks": [0]}}})


def test_wandb_needs_its_project():
    with pytest.raises(ConfigError, match="rl_config.wandb_project: required with rl_config.use_wandb"):
        load_config(None, ["rl_config.use_wandb=true"])


@pytest.mark.parametrize("value", [0, -2])
def test_filter_groups_max_batches_is_a_limit_or_minus_one(value):
    with pytest.raises(ConfigError, match=r"rl_config.filter_groups_max_batches: must be -1 \(no limit\) or >= 1"):
        load_config(None, [f"rl_config.filter_groups_max_batches={value}"])
    assert load_config(None, ["rl_config.filter_groups_max_batches=-1"]).rl_config.filter_groups_max_batches == -1
