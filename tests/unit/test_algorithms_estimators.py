"""The outcome estimators of issue 41 (rloo, reinforce_plus_plus, reinforce_plus_plus_baseline) and Dr. GRPO's
norm_adv_by_std_in_grpo, each against values worked by hand from verl's published formula
(verl/trainer/ppo/core_algos.py), on small batches with padding, and the config keys that pick them."""
import math

import pytest
import torch

from services.common.config import DEFAULT_CONFIG, load_config
from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.algorithm.estimators import ESTIMATORS, build_estimator
from services.trainer.algorithm.estimators.group_norm import group_mean_advantages
from services.trainer.algorithm.estimators.interface import EstimatorBatch, EstimatorSetup
from services.trainer.algorithm.estimators.reinforce_plus_plus import reinforce_plus_plus_advantages
from services.trainer.algorithm.estimators.reinforce_plus_plus_baseline import reinforce_plus_plus_baseline_advantages
from services.trainer.algorithm.estimators.rloo import rloo_advantages

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
LENGTHS = [3, 1, 2, 3, 2, 3, 1, 2]
MASK = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in LENGTHS])


def unbiased_whiten(values: list[float]) -> list[float]:
    """verl_F.masked_whiten over the listed (masked-in) values: (x - mean) / sqrt(unbiased var + 1e-8)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def per_token(advantage_per_sample: list[float]) -> torch.Tensor:
    return torch.tensor([[a] * n + [0.0] * (3 - n) for a, n in zip(advantage_per_sample, LENGTHS)])


def test_rloo_is_the_score_minus_the_mean_of_the_others():
    # verl compute_rloo_outcome_advantage: r * n / (n - 1) - mean * n / (n - 1); by hand, r_i - mean_{j != i} r_j
    by_hand = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0 - 1 / 3, 1 - 0, 0 - 1 / 3, 0 - 1 / 3]
    assert torch.allclose(rloo_advantages(SCORES, 4, MASK), per_token(by_hand), atol=1e-6)


def test_rloo_refuses_groups_of_one():
    with pytest.raises(ValueError, match="rloo: needs groups of n_samples_per_prompt >= 2"):
        rloo_advantages(SCORES, 1, MASK)


def test_dr_grpo_drops_the_std_division():
    # verl compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False): r - mean(group), no std
    by_hand = [0.5, -0.5, -0.5, 0.5, -0.25, 0.75, -0.25, -0.25]
    assert torch.allclose(group_mean_advantages(SCORES, 4, MASK), per_token(by_hand), atol=1e-6)
    # with the std (the default): the same numerators over std + 1e-6 (unbiased std of the group)
    std1 = math.sqrt(sum((x - 0.5) ** 2 for x in (1, 0, 0, 1)) / 3)
    assert group_norm_advantages(SCORES, 4, MASK)[0, 0].item() == pytest.approx(0.5 / (std1 + 1e-6), rel=1e-6)


def test_reinforce_plus_plus_baseline_whitens_the_group_centred_scores_over_response_tokens():
    # verl compute_reinforce_plus_plus_baseline_outcome_advantage: r - mean(group), tiled over the response, masked_whiten
    centred = [0.5, -0.5, -0.5, 0.5, -0.25, 0.75, -0.25, -0.25]
    tokens = [a for a, n in zip(centred, LENGTHS) for _ in range(n)]  # padding never counts in the whitening
    whitened = iter(unbiased_whiten(tokens))
    by_hand = torch.tensor([[next(whitened) if t < n else 0.0 for t in range(3)] for n in LENGTHS])
    assert torch.allclose(reinforce_plus_plus_baseline_advantages(SCORES, 4, MASK), by_hand, atol=1e-5)


def test_reinforce_plus_plus_discounts_returns_and_whitens_over_the_batch():
    # verl compute_reinforce_plus_plus_outcome_advantage: G_t = r_t + gamma G_{t+1}, cut at padding, masked_whiten
    rewards = torch.tensor([[0.1, 0.2, 1.0], [0.3, 0.5, 7.0]])  # 7.0 sits on padding: it must not reach the response
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    returns = [0.1 + 0.5 * (0.2 + 0.5 * 1.0), 0.2 + 0.5 * 1.0, 1.0, 0.3 + 0.5 * 0.5, 0.5]
    w = unbiased_whiten(returns)
    by_hand = torch.tensor([[w[0], w[1], w[2]], [w[3], w[4], 0.0]])
    assert torch.allclose(reinforce_plus_plus_advantages(rewards, mask, gamma=0.5), by_hand, atol=1e-5)


class FakePasses:
    """The log-prob passes an estimator may ask for, as fixed tensors."""

    def __init__(self, old, ref):
        self.old, self.ref = old, ref

    def old_logprobs(self):
        return self.old

    def reference_logprobs(self):
        return self.ref


def _estimate(overrides, scores, mask, passes, kl_coef=0.1):
    cfg = load_config(DEFAULT_CONFIG, overrides)
    estimator = build_estimator(EstimatorSetup(cfg, None, {}, torch.float32, 1))
    return estimator.estimate(EstimatorBatch(None, mask, scores), passes, kl_coef)


def test_reinforce_plus_plus_puts_the_kl_in_the_token_rewards_as_verl():
    # verl apply_kl_penalty: token_level_rewards = scores on the last token - kl_coef * kl(old, ref); kl_penalty kl is k1
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -9.0]])
    out = _estimate(["rl_config.adv_estimator=reinforce_plus_plus", "rl_config.use_kl_in_reward=true", "rl_config.init_kl_coef=0.1", "rl_config.kl_penalty=kl",
                     "rl_config.gamma=1.0"], torch.tensor([1.0, 0.0]), mask, FakePasses(old, ref))
    rewards = [[-0.1 * 0.5, 1.0 - 0.1 * -1.0], [0.0]]
    returns = [rewards[0][0] + rewards[0][1], rewards[0][1], rewards[1][0]]
    w = unbiased_whiten(returns)
    assert torch.allclose(out.advantages, torch.tensor([[w[0], w[1]], [w[2], 0.0]]), atol=1e-5)
    assert out.ref_logprobs is None and out.old_logprobs is old  # the KL is in the reward, not in the loss too
    assert torch.allclose(out.reward_kl, torch.tensor([[0.5, -1.0], [0.0, 0.0]]))


def test_rloo_sums_the_token_rewards_with_their_kl():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -9.0]])
    out = _estimate(["rl_config.adv_estimator=rloo", "rl_config.n_samples_per_prompt=2", "rl_config.use_kl_in_reward=true",
                     "rl_config.init_kl_coef=0.1", "rl_config.kl_penalty=kl"], torch.tensor([1.0, 0.0]), mask, FakePasses(old, ref))
    scores = [1.0 - 0.1 * (0.5 - 1.0), 0.0]  # each sample's sum of token rewards
    assert torch.allclose(out.advantages, torch.tensor([[scores[0] - scores[1]] * 2, [scores[1] - scores[0], 0.0]]), atol=1e-6)


@pytest.mark.parametrize("overrides", [
    ["rl_config.adv_estimator=rloo"], ["rl_config.adv_estimator=reinforce_plus_plus"],
    ["rl_config.adv_estimator=reinforce_plus_plus_baseline"], ["rl_config.norm_adv_by_std_in_grpo=false"],
], ids=lambda o: o[0].split(".")[1])
def test_each_key_changes_the_advantages(overrides):
    passes = FakePasses(None, torch.zeros(8, 3))
    grpo = _estimate(["rl_config.n_samples_per_prompt=4"], SCORES, MASK, passes)
    other = _estimate(["rl_config.n_samples_per_prompt=4"] + overrides, SCORES, MASK, passes)
    assert not torch.allclose(grpo.advantages, other.advantages)
    assert (other.advantages[MASK == 0] == 0).all()  # padding never carries an advantage
    assert other.ref_logprobs is passes.ref  # without use_kl_in_reward the reference feeds the loss's KL


def test_every_adv_estimator_name_has_an_estimator():
    from typing import get_args

    from services.common.config import RLConfig

    assert set(get_args(RLConfig.__annotations__["adv_estimator"])) == set(ESTIMATORS)
