"""GSPO's sequence-level loss (verl's compute_policy_loss_gspo) and the rollout-mismatch correction (verl's
rollout_corr_helper.py: compute_rollout_correction_weights, compute_rollout_rejection_mask, compute_offpolicy_metrics),
against values worked by hand on small batches with padding."""
import math

import pytest
import torch

from services.trainer.algorithm.losses import PolicyLossConfig, policy_loss
from services.trainer.algorithm.rollout_correction import (RolloutCorrection, rollout_correction_factor,
                                                           rollout_correction_metrics)

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.5, 0.0]])


def gspo(low=0.2, high=0.2):
    return PolicyLossConfig(low, high, mode="gspo")


def test_gspo_ratio_is_the_geometric_mean_of_token_ratios_and_its_gradient_the_papers():
    # verl compute_policy_loss_gspo: s_i = exp(mean_t log(pi / pi_old)); s_i,t = sg[s_i] pi_t / sg[pi_t];
    # loss = seq-mean-token-mean of max(-A s, -A clip(s)); by hand with no clip reached
    delta = torch.tensor([[0.03, -0.06, 0.06], [0.02, 0.04, 5.0]])  # 5.0 on padding: never counts
    logp = (OLD + delta).requires_grad_(True)
    out = policy_loss(logp, OLD, ADV, MASK, gspo())
    s1, s2 = math.exp(0.03 / 3), math.exp(0.06 / 2)
    assert out.loss.item() == pytest.approx((-s1 + s2) / 2, abs=1e-6)
    out.loss.backward()
    # d/dlogp_t of -A_i s_i,t / (|y_i| B): -A_i s_i / (|y_i| * 2) on each response token, 0 on padding
    by_hand = torch.tensor([[-s1 / 6] * 3, [s2 / 4, s2 / 4, 0.0]])
    assert torch.allclose(logp.grad, by_hand, atol=1e-6)
    assert out.pg_clipfrac.item() == 0.0 and out.pg_clipfrac_lower.item() == 0.0


def test_gspo_clips_the_whole_sequence_with_verls_recommended_bounds():
    # clip_ratio_low 3e-4, clip_ratio_high 4e-4 (verl's GSPO recipe): s_1 = exp(0.01) > 1 + 4e-4 with A > 0 -> clipped,
    # the term is then the constant -A (1 + 4e-4) and its gradient 0; sample 2 (A < 0, s_2 = exp(0.03)) is not clipped
    delta = torch.tensor([[0.03, -0.06, 0.06], [0.02, 0.04, 0.0]])
    logp = (OLD + delta).requires_grad_(True)
    out = policy_loss(logp, OLD, ADV, MASK, gspo(3e-4, 4e-4))
    s2 = math.exp(0.03)
    assert out.loss.item() == pytest.approx((-(1 + 4e-4) + s2) / 2, abs=1e-6)
    out.loss.backward()
    assert torch.allclose(logp.grad[0], torch.zeros(3)) and logp.grad[1, 0].item() == pytest.approx(s2 / 4, rel=1e-6)
    assert out.pg_clipfrac.item() == pytest.approx(3 / 5)  # the clipped sequence's tokens


def test_gspo_ignores_token_mean_aggregation_and_padding_minus_infinity():
    logp = OLD.clone()
    logp[1, 2] = -math.inf  # a padding position's log-prob: no NaN may come of it
    out = policy_loss(logp, OLD, ADV, MASK, PolicyLossConfig(mode="gspo", agg="token-mean"))
    assert out.loss.item() == pytest.approx((-1.0 + 1.0) / 2)  # seq-mean-token-mean of -A at ratio 1
    assert not PolicyLossConfig(mode="gspo", agg="token-mean").token_level  # micro-batches weigh by sequences


ROLLOUT = torch.log(torch.tensor([[2.0, 1.0, 5.0], [1.0, 4.0, 1.0]]))
# pi_old / pi_rollout per token: [[1.5, 3.0, 0.4], [0.3, 0.5, pad]]
OLD_C = ROLLOUT + torch.log(torch.tensor([[1.5, 3.0, 0.4], [0.3, 0.5, 1.0]]))
OLD_C[1, 2] = 3.0  # padding: garbage that must not count


@pytest.mark.parametrize("cfg, by_hand", [
    # verl compute_rollout_correction_weights: token weights exp(log rho) clamped at the threshold (TIS)
    (RolloutCorrection(is_level="token", is_threshold=2.0), [[1.5, 2.0, 0.4], [0.3, 0.5, 0.0]]),
    # sequence: the product of the token ratios, 1.8 and 0.15
    (RolloutCorrection(is_level="sequence", is_threshold=2.0), [[1.8] * 3, [0.15, 0.15, 0.0]]),
    (RolloutCorrection(is_level="sequence", is_threshold=1.5), [[1.5] * 3, [0.15, 0.15, 0.0]]),
    # verl compute_rollout_rejection_mask token_k1 (IcePop's [0.5, 2]): tokens outside left out
    (RolloutCorrection(rs="token_k1", rs_threshold=2.0, rs_threshold_lower=0.45), [[1, 0, 0], [0, 1, 0]]),
    # seq_sum_k1: the sequence's product 1.8 kept, 0.15 out; seq_mean_k1: geometric means 1.8^(1/3), 0.15^(1/2) = 0.387
    (RolloutCorrection(rs="seq_sum_k1", rs_threshold=2.0), [[1, 1, 1], [0, 0, 0]]),
    (RolloutCorrection(rs="seq_mean_k1", rs_threshold=2.0, rs_threshold_lower=0.35), [[1, 1, 1], [1, 1, 0]]),
    (RolloutCorrection(rs="seq_mean_k1", rs_threshold=2.0), [[1, 1, 1], [0, 0, 0]]),  # lower 1 / 2
    # both: the truncated weight times the mask
    (RolloutCorrection(is_level="token", is_threshold=2.0, rs="token_k1", rs_threshold=2.2), [[1.5, 0.0, 0.0], [0.0, 0.5, 0.0]]),
], ids=["tis-token", "tis-seq", "tis-seq-capped", "icepop", "mis-seq-sum", "mis-seq-mean", "mis-seq-mean-default", "tis+mis"])
def test_rollout_correction_factor_by_hand(cfg, by_hand):
    factor = rollout_correction_factor(OLD_C, ROLLOUT, MASK, cfg) * MASK
    assert torch.allclose(factor, torch.tensor(by_hand, dtype=torch.float32), atol=1e-5)


def test_rollout_correction_metrics_by_hand():
    rhos = [1.5, 3.0, 0.4, 0.3, 0.5]
    cfg = RolloutCorrection(is_level="token", is_threshold=2.0, rs="token_k1", rs_threshold=2.0, rs_threshold_lower=0.45)
    metrics = rollout_correction_metrics(OLD_C, ROLLOUT, MASK, cfg)
    assert metrics["rollout_is_mean"] == pytest.approx(sum(rhos) / 5, rel=1e-5)  # before truncation, as verl's
    assert metrics["rollout_is_max"] == pytest.approx(3.0, rel=1e-5)
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    # verl compute_offpolicy_metrics k3_kl: mean of rho - log rho - 1 over the response tokens
    assert metrics["rollout_corr_k3_kl"] == pytest.approx(sum(r - math.log(r) - 1 for r in rhos) / 5, rel=1e-5)


def test_rollout_correction_weights_each_tokens_term_and_keeps_the_denominator():
    logp = OLD_C.clone().requires_grad_(True)  # ratio 1: each term is -A
    cfg = PolicyLossConfig(rollout=RolloutCorrection(is_level="token", is_threshold=2.0))
    out = policy_loss(logp, OLD_C, ADV, MASK, cfg, behaviour_logprob=ROLLOUT)
    assert out.loss.item() == pytest.approx((-1.5 - 2.0 - 0.4 + 0.3 + 0.5) / 5, rel=1e-5)  # token-mean over all 5 tokens
    plain = policy_loss(logp, OLD_C, ADV, MASK, PolicyLossConfig(), behaviour_logprob=ROLLOUT)
    assert plain.loss.item() == pytest.approx((-3 + 2) / 5)
    with pytest.raises(ValueError, match="rollout_is / rollout_rs: the batch has no rollout log-probs"):
        policy_loss(logp, OLD_C, ADV, MASK, cfg)


def test_matching_log_probs_leave_the_loss_unchanged():
    # CPU fp32: the engine's and the trainer's log-probs agree, every weight is 1 and nothing is masked
    cfg = PolicyLossConfig(rollout=RolloutCorrection(is_level="sequence", rs="token_k1"))
    logp = OLD + 0.01
    assert policy_loss(logp, OLD, ADV, MASK, cfg, behaviour_logprob=OLD).loss.item() == pytest.approx(
        policy_loss(logp, OLD, ADV, MASK, PolicyLossConfig()).loss.item())
    assert rollout_correction_metrics(OLD, OLD, MASK, cfg.rollout)["rollout_corr_k3_kl"] == 0.0
