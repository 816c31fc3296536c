"""The advantage-estimator registry: one estimator per adv_estimator the config accepts, an unknown one refused by its key."""
import dataclasses
import typing

import pytest
import torch

from services.common.config import ConfigError, RLConfig, config_from_dict
from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.algorithm.estimators import ESTIMATORS, build_estimator
from services.trainer.algorithm.estimators.group_norm import GroupNormEstimator
from services.trainer.algorithm.estimators.interface import EstimatorBatch, EstimatorSetup, LogProbPasses
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch


def test_one_estimator_per_accepted_adv_estimator():
    accepted = typing.get_args(typing.get_type_hints(RLConfig)["adv_estimator"])
    assert sorted(ESTIMATORS) == sorted(accepted)


def test_an_unknown_adv_estimator_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="rl_config.adv_estimator: 'vtrace'"):
        config_from_dict({"rl_config": {"adv_estimator": "vtrace", "n_samples_per_prompt": 2}})
    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": 2}})
    unknown = dataclasses.replace(cfg, rl_config=dataclasses.replace(cfg.rl_config, adv_estimator="vtrace"))
    with pytest.raises(ValueError, match="rl_config.adv_estimator: 'vtrace' is not one of group_norm, gae, rloo, "
                                         "reinforce_plus_plus, reinforce_plus_plus_baseline"):
        build_estimator(EstimatorSetup(unknown, None, {}, torch.float32, 1))


def test_group_norm_estimator_gives_group_norm_advantages_and_the_reference_pass_only():
    samples = ResponseBatch.from_token_ids([[1, 2], [3]], [[4, 5, 6], [7]])
    mask = samples.response_mask()
    scores = torch.tensor([1.0, 0.0])
    # no reference model: no pass runs, so no model is needed
    estimate = GroupNormEstimator(2).estimate(EstimatorBatch(samples, mask, scores), LogProbPasses(None, None, samples, ForwardConfig()), 0.0)
    assert torch.equal(estimate.advantages, group_norm_advantages(scores, 2, mask))
    assert estimate.old_logprobs is None and estimate.ref_logprobs is None and estimate.reward_kl is None
