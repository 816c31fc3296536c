"""Issue 41's loss keys at the level of the policy update (update_policy on the tiny megatron model, the set-up of
test_trainer_update.py): GSPO and the rollout-mismatch correction change the loss when the log-probs differ, leave it
as it was when they agree, and report verl's rollout_corr metrics."""
import dataclasses

import pytest
import torch
from trainer_helpers import megatron_tp1, random_batch, tiny_hf_model

from services.common.config import DEFAULT_CONFIG, MegatronTrainingConfig, load_config
from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs
from services.trainer.modeling.optimizer import build_optimizer

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def batch(hf_dir):
    samples = random_batch(5, prompt_lengths=[4] * 4 + [3] * 4, response_lengths=[3, 5, 2, 4, 6, 3, 2, 4])
    mask = samples.response_mask()
    model, _ = megatron_tp1(hf_dir)
    old = compute_logprobs(model, samples, UpdateConfig(mini_batch_size=8).forward)[0].float().cpu()
    gen = torch.Generator().manual_seed(0)
    # the rollout engine's log-probs off the trainer's by up to ~0.7 per token (a bf16 engine's mismatch, exaggerated)
    rollout = (old + 0.7 * (torch.rand(old.shape, generator=gen) * 2 - 1)) * mask
    return TrainBatch(samples, group_norm_advantages(REWARDS, 4, mask), old_logprobs=old, behaviour_logprobs=rollout)


def _metrics(hf_dir, batch, *overrides):
    run_cfg = load_config(DEFAULT_CONFIG, ["rl_config.n_samples_per_prompt=4", *overrides])
    cfg = dataclasses.replace(UpdateConfig.from_config(run_cfg), mini_batch_size=4, forward=ForwardConfig())
    model, _ = megatron_tp1(hf_dir)
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, clip_grad=0.0), total_steps=4)
    return update_policy(model, optimizer, batch, cfg).metrics  # two mini-batches: the second step's ratio is off 1


def test_each_loss_key_changes_the_loss_and_the_correction_reports_its_metrics(hf_dir, batch):
    base = _metrics(hf_dir, batch)
    assert base.rollout_is_mean is None and "rollout_corr_k3_kl" not in base.as_dict()  # off: not logged
    gspo = _metrics(hf_dir, batch, "rl_config.policy_loss_mode=gspo")
    tis = _metrics(hf_dir, batch, "rl_config.rollout_is=token")
    mis = _metrics(hf_dir, batch, "rl_config.rollout_rs=seq_mean_k1", "rl_config.rollout_rs_threshold=1.1")
    for other in (gspo, tis, mis):
        assert other.pg_loss != pytest.approx(base.pg_loss, abs=1e-6)
    mask = batch.samples.response_mask()
    rho = (batch.old_logprobs - batch.behaviour_logprobs).exp()
    assert tis.rollout_is_mean == pytest.approx(float(rho[mask > 0].mean()), rel=1e-5)
    assert tis.rollout_is_max == pytest.approx(float(rho[mask > 0].max()), rel=1e-5)
    log_rho = (batch.old_logprobs - batch.behaviour_logprobs)[mask > 0]
    assert tis.rollout_corr_k3_kl == pytest.approx(float((log_rho.exp() - log_rho - 1).mean()), rel=1e-4)
    assert 0 < mis.rollout_rs_masked_fraction < 1 and mis.rollout_is_mean is None


def test_the_correction_is_a_no_op_when_the_engine_and_trainer_agree(hf_dir, batch):
    agreeing = dataclasses.replace(batch, behaviour_logprobs=batch.old_logprobs)
    base = _metrics(hf_dir, agreeing)
    corrected = _metrics(hf_dir, agreeing, "rl_config.rollout_is=sequence", "rl_config.rollout_rs=token_k1")
    assert corrected.pg_loss == pytest.approx(base.pg_loss, abs=1e-6)
    assert (corrected.rollout_is_mean, corrected.rollout_rs_masked_fraction, corrected.rollout_corr_k3_kl) == (1.0, 0.0, 0.0)
