"""Advantages, KL estimators, policy/value losses and dynamic sampling against hand-computed values."""
import math

import pytest
import torch

from services.trainer.algorithm.advantages import gae_advantages, group_norm_advantages
from services.trainer.algorithm.dynamic_sampling import DynamicSampler, informative_groups
from services.trainer.algorithm.kl import KLController, kl_penalty
from services.trainer.algorithm.losses import PolicyLossConfig, policy_loss, value_loss


def test_group_norm_matches_mindspeed_rl_value():
    adv = group_norm_advantages(torch.tensor([1.0, 2.0]), 2, torch.ones(2, 3))
    assert torch.allclose(adv, torch.tensor([[-0.7071] * 3, [0.7071] * 3]), atol=1e-4)


def test_group_norm_is_per_group_and_masked():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    adv = group_norm_advantages(torch.tensor([0.0, 1.0, 5.0, 5.0]), 2, mask)
    assert torch.allclose(adv[0], torch.tensor([-0.7071, -0.7071, 0.0]), atol=1e-4)
    assert torch.allclose(adv[1], torch.tensor([0.7071, 0.0, 0.0]), atol=1e-4)
    assert torch.equal(adv[2:], torch.zeros(2, 3))  # equal scores: no advantage


def test_group_norm_rejects_partial_groups():
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        group_norm_advantages(torch.ones(3), 2, torch.ones(3, 1))


def test_gae_by_hand():
    # gamma .9, lam .5, values .5, reward 1 at the end:
    # A2 = 1 - .5 = .5; A1 = (.45 - .5) + .45 * .5 = .175; A0 = -.05 + .45 * .175 = .02875
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3), 0.9, 0.5)
    assert torch.allclose(ret, torch.tensor([[0.52875, 0.675, 1.0]]), atol=1e-6)
    raw = torch.tensor([0.02875, 0.175, 0.5])
    std = math.sqrt(((raw - raw.mean()) ** 2).sum().item() / 2)
    assert torch.allclose(adv, ((raw - raw.mean()) / std).unsqueeze(0), atol=1e-5)
    assert torch.allclose(adv, torch.tensor([[-0.85334, -0.24702, 1.10036]]), atol=1e-4)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3), 1.0, 1.0)
    assert torch.allclose(ret, torch.ones(1, 3))
    assert torch.allclose(adv, torch.zeros(1, 3), atol=1e-3)  # all three advantages equal .5: whitened to 0


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([0.5, 1.0]), torch.tensor([1.0, 0.5])
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([0.14872, 0.10653]), atol=1e-5)
    assert torch.allclose(kl_penalty(logp, ref, "kl"), torch.tensor([-0.5, 0.5]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([0.5, 0.5]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), torch.tensor([0.125, 0.125]))


def test_low_var_kl_is_clamped():
    out = kl_penalty(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([300.0, -300.0, 2.0]), "low_var_kl")
    assert out[:2].tolist() == [10.0, 10.0]  # log-ratio clamped to +-20 (no inf), result to 10
    assert out[2].item() == pytest.approx(math.exp(2) - 3, rel=1e-6)


def test_kl_unknown_kind_names_the_key():
    with pytest.raises(ValueError, match="rl_config.kl_penalty"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")


def _one_token(adv: float, ratio: float, cfg: PolicyLossConfig):
    old = torch.zeros(1, 1)
    return policy_loss(torch.full((1, 1), math.log(ratio)), old, torch.full((1, 1), adv), torch.ones(1, 1), cfg)


def test_ppo_clip_and_clip_higher():
    out = _one_token(1.0, 1.5, PolicyLossConfig(0.2, 0.2))
    assert out.loss.item() == pytest.approx(-1.2) and out.pg_clipfrac.item() == 1.0
    assert _one_token(1.0, 1.5, PolicyLossConfig(0.2, 0.28)).loss.item() == pytest.approx(-1.28)
    inside = _one_token(1.0, 1.1, PolicyLossConfig(0.2, 0.2))
    assert inside.loss.item() == pytest.approx(-1.1) and inside.pg_clipfrac.item() == 0.0
    low = _one_token(-1.0, 0.5, PolicyLossConfig(0.2, 0.2))
    assert low.loss.item() == pytest.approx(0.8) and low.pg_clipfrac.item() == 1.0


def test_dual_clip_bounds_negative_advantage_loss():
    out = _one_token(-1.0, 5.0, PolicyLossConfig(0.2, 0.2, clip_ratio_c=3.0))
    assert out.loss.item() == pytest.approx(3.0)  # unclipped 5, bounded by -A * 3
    assert out.pg_clipfrac_lower.item() == 1.0
    assert _one_token(1.0, 5.0, PolicyLossConfig(0.2, 0.2, clip_ratio_c=3.0)).pg_clipfrac_lower.item() == 0.0


def test_token_level_vs_sequence_mean_aggregation():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[-1.0, -3.0, 0.0], [-5.0, 0.0, 0.0]])  # ratio 1: per-token loss = -A
    zeros = torch.zeros(2, 3)
    token = policy_loss(zeros, zeros, adv, mask, PolicyLossConfig(agg="token-mean"))
    seq = policy_loss(zeros, zeros, adv, mask, PolicyLossConfig(agg="seq-mean-token-mean"))
    seq_sum = policy_loss(zeros, zeros, adv, mask, PolicyLossConfig(agg="seq-mean-token-sum"))
    assert token.loss.item() == pytest.approx(3.0)  # (1 + 3 + 5) / 3
    assert seq.loss.item() == pytest.approx(3.5)  # (2 + 5) / 2
    assert seq_sum.loss.item() == pytest.approx(4.5)  # ((1 + 3) + 5) / 2: a longer answer weighs more (Dr. GRPO)


def test_the_loss_aggregation_comes_from_loss_agg_mode_or_else_token_level_loss():
    from services.common.config import config_from_dict

    def agg(**rl):
        return PolicyLossConfig.from_rl_config(config_from_dict({"rl_config": {"n_samples_per_prompt": 2, **rl}}).rl_config, 0.0).agg

    assert agg() == "token-mean" and agg(token_level_loss=False) == "seq-mean-token-mean"
    assert agg(loss_agg_mode="seq-mean-token-sum") == "seq-mean-token-sum"
    assert agg(token_level_loss=False, loss_agg_mode="seq-mean-token-sum") == "seq-mean-token-sum"


def test_entropy_bonus_and_kl_term():
    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2)
    out = policy_loss(zeros, zeros, torch.ones(1, 2), mask, PolicyLossConfig(entropy_coeff=0.1, kl_coef=0.5),
                      entropy=torch.full((1, 2), 2.0), kl=torch.full((1, 2), 0.4))
    assert out.loss.item() == pytest.approx(-1.0 - 0.2 + 0.2)
    assert out.entropy.item() == pytest.approx(2.0) and out.kl.item() == pytest.approx(0.4)


def test_policy_loss_gradient_flows_to_logprob():
    logp = torch.zeros(1, 2, requires_grad=True)
    policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), PolicyLossConfig()).loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -0.5))  # d(-mean(ratio))/dlogp at ratio 1


def test_value_loss_clips_around_old_values():
    loss, frac = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1), 0.5)
    assert loss.item() == pytest.approx(1.125) and frac.item() == 1.0  # 0.5 * (0.5 - 2)^2
    loss, frac = value_loss(torch.tensor([[0.2]]), torch.tensor([[0.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), 0.5)
    assert loss.item() == pytest.approx(0.02) and frac.item() == 0.0


def test_informative_groups_drop_zero_std():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert informative_groups(metric, 2).tolist() == [1, 3]


def test_dynamic_sampler_refills_up_to_target():
    sampler = DynamicSampler(target_groups=3, n_samples_per_prompt=2, max_batches=5)
    assert sampler.add(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])) == [1, 3]
    assert not sampler.done
    assert sampler.add(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0])) == [1]
    assert sampler.done and sampler.kept == [(0, 1), (0, 3), (1, 1)]
    with pytest.raises(RuntimeError, match="already"):
        sampler.add(torch.tensor([0.0, 1.0]))


def test_dynamic_sampler_stops_at_max_batches():
    sampler = DynamicSampler(target_groups=4, n_samples_per_prompt=2, max_batches=2)
    sampler.add(torch.tensor([1.0, 1.0]))
    sampler.add(torch.tensor([0.0, 1.0]))
    assert sampler.done and len(sampler.kept) == 1


def test_dynamic_sampler_without_a_batch_limit_draws_until_it_has_its_groups():
    sampler = DynamicSampler(target_groups=2, n_samples_per_prompt=2, max_batches=-1)  # MindSpeed-RL's -1
    for _ in range(50):  # batches with no informative group do not end it
        sampler.add(torch.tensor([1.0, 1.0, 0.0, 0.0]))
        assert not sampler.done
    sampler.add(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert sampler.done and sampler.kept == [(50, 0), (50, 1)]


DECOUPLED = PolicyLossConfig(0.2, 0.2, decoupled=True)


def test_decoupled_loss_on_policy_is_the_ppo_loss_with_its_gradient():
    """Behaviour = proximal policy (a synchronous batch): weight 1, the loss and gradient of plain PPO."""
    torch.manual_seed(0)
    old, adv, mask = torch.randn(2, 4), torch.randn(2, 4), torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    grads = []
    for cfg, behaviour in ((PolicyLossConfig(0.2, 0.2), None), (DECOUPLED, old.clone())):
        logp = (old + 0.3 * torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).requires_grad_()
        out = policy_loss(logp, old, adv, mask, cfg, behaviour_logprob=behaviour)
        out.loss.backward()
        grads.append((out.loss.item(), logp.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-7) and torch.allclose(grads[0][1], grads[1][1], atol=1e-7)


def test_decoupled_loss_weights_each_token_by_prox_over_behaviour():
    """One token generated by a policy that gave it log-prob -1 where the proximal policy gives 0:
    the term is clipped against the proximal policy, then scaled by exp(0 - (-1)) = e."""
    logp, old, behaviour = torch.full((1, 1), math.log(1.5)), torch.zeros(1, 1), torch.full((1, 1), -1.0)
    out = policy_loss(logp, old, torch.ones(1, 1), torch.ones(1, 1), DECOUPLED, behaviour_logprob=behaviour)
    assert out.loss.item() == pytest.approx(-1.2 * math.e, rel=1e-6)  # ratio 1.5 clipped to 1.2 (proximal), times e
    assert out.behav_imp_weight.item() == pytest.approx(math.e, rel=1e-6) and out.behav_clipfrac.item() == 0.0


def test_behaviour_weight_cap_leaves_tokens_out_and_counts_them():
    """Weights e^2 (over the cap 5) and 1: the first token gives nothing, the mean keeps both tokens' places."""
    cfg = PolicyLossConfig(0.2, 0.2, decoupled=True, behav_imp_weight_cap=5.0)
    zeros = torch.zeros(1, 2)
    out = policy_loss(zeros, zeros, torch.ones(1, 2), torch.ones(1, 2), cfg, behaviour_logprob=torch.tensor([[-2.0, 0.0]]))
    assert out.loss.item() == pytest.approx(-0.5)  # (0 + -1) / 2
    assert out.behav_clipfrac.item() == 0.5 and out.behav_imp_weight.item() == pytest.approx(1.0)


def test_decoupled_loss_ignores_padding_log_probs():
    """Garbage past a response (inf log-probs on padding) must not reach the loss."""
    mask = torch.tensor([[1.0, 0.0]])
    behaviour = torch.tensor([[0.0, -float("inf")]])
    out = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mask, DECOUPLED, behaviour_logprob=behaviour)
    assert math.isfinite(out.loss.item()) and out.loss.item() == pytest.approx(-1.0)


def test_decoupled_loss_without_behaviour_log_probs_names_the_key():
    with pytest.raises(ValueError, match="rl_config.use_decoupled_loss"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), DECOUPLED)


def test_a_far_out_log_ratio_with_a_zero_advantage_gives_a_finite_loss():
    """A log-ratio of 100 (a garbage log-prob) would make exp overflow, and inf * 0 a NaN loss."""
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    out = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), PolicyLossConfig())
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and out.loss.item() == pytest.approx(-0.5)
    assert torch.isfinite(logp.grad).all()


def test_the_adaptive_kl_coefficient_moves_toward_the_target_by_at_most_a_fifth_per_horizon():
    fixed = KLController(0.05)
    fixed.update(kl=3.0, samples=128)
    assert fixed.value == 0.05
    ctrl = KLController(0.1, target=0.02, horizon=1000)
    ctrl.update(kl=0.025, samples=128)  # 25% over the target: error clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 128 / 1000))
    ctrl.update(kl=0.019, samples=128)  # 5% under: error -0.05
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 128 / 1000) * (1 - 0.05 * 128 / 1000))
    ctrl.update(kl=0.0, samples=500)  # no KL at all: the largest step down, scaled by the samples
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 0.128) * (1 - 0.05 * 0.128) * (1 - 0.2 * 0.5))
