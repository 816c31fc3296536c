"""Checkpoints: a resumed run continues exactly where the uninterrupted one went."""
import dataclasses

import pytest
import torch
from trainer_helpers import gather_hf_weights, megatron_tp1, random_batch, tiny_hf_model

from services.common.config import MegatronTrainingConfig
from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.modeling.checkpoint import DataCursor, TrainState, latest_step, load_checkpoint, save_checkpoint
from services.trainer.modeling.logprobs import compute_logprobs
from services.trainer.algorithm.losses import PolicyLossConfig
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy
from services.trainer.modeling.optimizer import build_optimizer

MT = MegatronTrainingConfig(lr=3e-3, lr_warmup_fraction=0.25, lr_decay_style="cosine", min_lr=1e-4)
CFG = UpdateConfig(mini_batch_size=4, shuffle_mini_batch=True, loss=PolicyLossConfig(entropy_coeff=0.01, kl_coef=0.1))
TOTAL_STEPS = 8  # 4 iterations x 2 mini-batches


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


def make_run(hf_dir):
    model, _ = megatron_tp1(hf_dir)
    optimizer = build_optimizer(model, MT, TOTAL_STEPS)
    samples = random_batch(7, prompt_lengths=[3, 4, 5, 2, 3, 4, 2, 5], response_lengths=[4, 2, 3, 5, 1, 3, 4, 2])
    adv = group_norm_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), 2, samples.response_mask())
    ref = compute_logprobs(model, samples, CFG.forward)[0]
    return model, optimizer, TrainBatch(samples, adv, ref_logprobs=ref)


def test_resume_gives_the_uninterrupted_next_steps(hf_dir, tmp_path):
    model, optimizer, batch = make_run(hf_dir)
    for step in range(2):
        update_policy(model, optimizer, batch, CFG, step)
    save_checkpoint(tmp_path, model, optimizer, TrainState(step=2, policy_version=2, data=DataCursor(0, 16), kl_coef=0.0123))
    draw_after_save = torch.rand(3)
    uninterrupted = [update_policy(model, optimizer, batch, CFG, step).metrics for step in (2, 3)]

    model, optimizer, batch = make_run(hf_dir)  # fresh weights and optimizer, as after a restart
    state = load_checkpoint(tmp_path, model, optimizer)
    assert state == TrainState(step=2, policy_version=2, data=DataCursor(0, 16), kl_coef=0.0123)  # where the adaptive KL controller was
    assert torch.equal(torch.rand(3), draw_after_save)
    resumed = [update_policy(model, optimizer, batch, CFG, step).metrics for step in (state.step, state.step + 1)]
    for a, b in zip(uninterrupted, resumed):
        assert b.loss == pytest.approx(a.loss, abs=1e-6)
        assert b.lr == pytest.approx(a.lr) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    assert uninterrupted[1].loss != pytest.approx(uninterrupted[0].loss, abs=1e-4)  # the compared losses move


def test_latest_step_tracks_the_last_complete_checkpoint(hf_dir, tmp_path):
    model, optimizer, _ = make_run(hf_dir)
    assert latest_step(tmp_path) is None
    save_checkpoint(tmp_path, model, optimizer, TrainState(step=1))
    save_checkpoint(tmp_path, model, optimizer, dataclasses.replace(TrainState(), step=3))
    assert latest_step(tmp_path) == 3
    assert (tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").exists()
    assert load_checkpoint(tmp_path, model, optimizer, step=1).step == 1


def test_resume_without_checkpoint_says_so(hf_dir, tmp_path):
    model, optimizer, _ = make_run(hf_dir)
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        load_checkpoint(tmp_path, model, optimizer)


def test_an_rl_checkpoint_exports_to_a_hugging_face_model_with_the_trained_weights(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from services.trainer.modeling.checkpoint_convert import convert_megatron_to_hf
    from services.trainer.modeling.model import ModelLayout

    model, optimizer, batch = make_run(hf_dir)
    update_policy(model, optimizer, batch, CFG, 0)
    iteration = save_checkpoint(tmp_path / "ckpt", model, optimizer, TrainState(step=1), hf_dir=hf_dir)
    exported = convert_megatron_to_hf(iteration, tmp_path / "hf")  # `dockrl trainer convert --to hf --src .../iter_0000001`
    trained = gather_hf_weights(model, ModelLayout.from_hf_dir(hf_dir))
    loaded = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).state_dict()
    assert set(trained) <= set(loaded)
    assert all(torch.equal(loaded[name], trained[name].to(torch.float32)) for name in trained)
    initial = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).state_dict()
    assert not all(torch.equal(initial[name], loaded[name]) for name in trained)  # the update is in it
