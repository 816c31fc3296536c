"""The rl_config keys of issue 41's algorithms: what they read into, and the values the config check refuses."""
import pytest

from services.common.config import ConfigError, config_from_dict
from services.trainer.algorithm.rollout_correction import needs_rollout_logprobs
from services.trainer.algorithm.update import UpdateConfig

N2 = {"n_samples_per_prompt": 2}


def rl(**keys):
    return {"rl_config": {**N2, **keys}}


@pytest.mark.parametrize("data, match", [
    (rl(adv_estimator="reinforce"), r"rl_config\.adv_estimator.*'reinforce'"),
    ({"rl_config": {"adv_estimator": "rloo"}}, r"rl_config\.n_samples_per_prompt: rloo advantages need at least 2 samples"),
    ({"rl_config": {"adv_estimator": "reinforce_plus_plus_baseline"}},
     r"rl_config\.n_samples_per_prompt: reinforce_plus_plus_baseline advantages need at least 2"),
    (rl(adv_estimator="rloo", norm_adv_by_std_in_grpo=False), r"rl_config\.norm_adv_by_std_in_grpo: false is Dr\. GRPO's option"),
    (rl(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, init_kl_coef=0.0),
     r"rl_config\.use_kl_in_reward: reinforce_plus_plus's KL in the reward needs a reference model"),
    (rl(policy_loss_mode="gspo_token"), r"rl_config\.policy_loss_mode.*'gspo_token'"),
    (rl(policy_loss_mode="gspo", loss_agg_mode="token-mean"),
     r"rl_config\.loss_agg_mode: policy_loss_mode gspo aggregates seq-mean-token-mean"),
    (rl(rollout_is="geometric"), r"rl_config\.rollout_is.*'geometric'"),
    (rl(rollout_rs="token"), r"rl_config\.rollout_rs.*'token'"),
    (rl(rollout_is="token", rollout_is_threshold=0.5), r"rl_config\.rollout_is_threshold: the cap on pi_old / pi_rollout must be > 1"),
    (rl(rollout_is="token", rollout_is_threshold=0), r"rl_config\.rollout_is_threshold"),
    (rl(rollout_rs="token_k1", rollout_rs_threshold=0.9), r"rl_config\.rollout_rs_threshold: the kept ratios .* must hold 1"),
    (rl(rollout_rs="token_k1", rollout_rs_threshold_lower=1.2), r"rl_config\.rollout_rs_threshold: the kept ratios .* = \[1\.2, 2\.0\]"),
    (rl(rollout_is="token", use_decoupled_loss=True), r"rl_config\.rollout_is: cannot be set with use_decoupled_loss: true"),
    (rl(rollout_rs="seq_sum_k1", use_decoupled_loss=True), r"rl_config\.rollout_rs: cannot be set with use_decoupled_loss: true"),
])
def test_bad_algorithm_keys_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


def test_defaults_leave_grpo_as_it_was():
    cfg = config_from_dict(rl())
    r = cfg.rl_config
    assert (r.adv_estimator, r.norm_adv_by_std_in_grpo, r.policy_loss_mode, r.rollout_is, r.rollout_rs) == ("group_norm", True, "vanilla", "", "")
    assert not UpdateConfig.from_config(cfg).loss.rollout.enabled


def test_gspo_and_the_correction_reach_the_loss_config():
    cfg = config_from_dict(rl(policy_loss_mode="gspo", clip_higher_enable=True, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                              rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="token_k1", rollout_rs_threshold=2.0,
                              rollout_rs_threshold_lower=0.5))
    loss = UpdateConfig.from_config(cfg).loss
    assert (loss.mode, loss.agg, loss.token_level, loss.clip_ratio_low, loss.clip_ratio_high) == ("gspo", "seq-mean-token-mean", False, 3e-4, 4e-4)
    assert (loss.rollout.is_level, loss.rollout.is_threshold, loss.rollout.rs, loss.rollout.rs_bounds) == ("sequence", 3.0, "token_k1", (0.5, 2.0))


@pytest.mark.parametrize("keys, needed", [({}, False), ({"rollout_is": "token"}, True), ({"rollout_rs": "token_k1"}, True),
                                          ({"use_decoupled_loss": True}, True)])
def test_train_step_reads_the_rollout_log_probs_when_a_key_needs_them(keys, needed):
    assert needs_rollout_logprobs(config_from_dict(rl(**keys)).rl_config) is needed  # session.train_step's condition
