"""The trainer on one GPU: the model on the device against transformers, packed input through the SDPA core attention,
megatron-core's DDP and distributed optimizer stepping and resuming, bf16 with fp32 main weights, and the 1F1B
schedule's single-stage path (get_forward_backward_func at PP 1 is no-pipelining)."""
import dataclasses

import pytest
import torch
from trainer_helpers import megatron_tp1, random_batch, tiny_hf_model

from services.common.config import MegatronTrainingConfig
from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.algorithm.losses import PolicyLossConfig
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy
from services.trainer.modeling.checkpoint import TrainState, load_checkpoint, save_checkpoint
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs
from services.trainer.modeling.optimizer import build_optimizer

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


def grpo_batch(ref=None) -> TrainBatch:
    samples = random_batch(5, prompt_lengths=[4] * 4 + [3] * 4, response_lengths=[3, 5, 2, 4, 6, 3, 2, 4])
    return TrainBatch(samples, group_norm_advantages(REWARDS, 4, samples.response_mask()), ref_logprobs=ref)


def test_the_model_runs_on_the_gpu_and_matches_transformers(hf_dir):
    from transformers import AutoModelForCausalLM

    model, _ = megatron_tp1(hf_dir)
    assert next(model.parameters()).is_cuda  # placed on the device, not left on the CPU
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).cuda().eval()
    ids = torch.randint(0, 256, (2, 13), device="cuda")
    with torch.no_grad():
        ours = model(ids, torch.arange(13, device="cuda").unsqueeze(0).expand(2, -1), None)
        theirs = reference(ids).logits
    assert torch.allclose(ours.float(), theirs.float(), atol=1e-3, rtol=0)


def test_packed_sequences_give_the_padded_log_probs_on_the_gpu(hf_dir):
    model, _ = megatron_tp1(hf_dir)
    batch = grpo_batch().samples
    padded = compute_logprobs(model, batch, ForwardConfig(micro_batch_size=4))[0]
    packed = compute_logprobs(model, batch, ForwardConfig(micro_batch_size=4, use_remove_padding=True))[0]
    assert torch.allclose(packed, padded, atol=1e-4)


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed-optimizer", "replicated-optimizer"])
def test_updates_raise_the_rewarded_responses_and_resume_from_a_checkpoint(hf_dir, tmp_path, distributed):
    mt = MegatronTrainingConfig(lr=2e-3, use_distributed_optimizer=distributed)
    cfg = UpdateConfig(mini_batch_size=4, shuffle_mini_batch=True, loss=PolicyLossConfig(kl_coef=0.001))

    def run():
        model, _ = megatron_tp1(hf_dir)
        batch = grpo_batch()
        ref = compute_logprobs(model, batch.samples, cfg.forward)[0]
        return model, build_optimizer(model, mt, total_steps=8), dataclasses.replace(batch, ref_logprobs=ref), ref

    model, optimizer, batch, before = run()
    for step in range(2):
        update_policy(model, optimizer, batch, cfg, step)
    save_checkpoint(tmp_path, model, optimizer, TrainState(step=2))
    uninterrupted = update_policy(model, optimizer, batch, cfg, 2).metrics
    after = compute_logprobs(model, batch.samples, cfg.forward)[0]
    mask = batch.samples.response_mask()
    gain = ((after - before) * mask).sum(1) / mask.sum(1)
    assert gain[REWARDS == 1].mean() > gain[REWARDS == 0].mean()

    model, optimizer, batch, _ = run()
    load_checkpoint(tmp_path, model, optimizer)
    resumed = update_policy(model, optimizer, batch, cfg, 2).metrics
    assert resumed.loss == pytest.approx(uninterrupted.loss, abs=1e-5)
    assert resumed.grad_norm == pytest.approx(uninterrupted.grad_norm, rel=1e-4)


def test_bf16_training_keeps_fp32_main_weights(hf_dir):
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.model import ModelLayout, build_model

    megatron_tp1(hf_dir)  # parallel state
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout, torch.bfloat16)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, bf16=True), total_steps=2)
    metrics = update_policy(model, optimizer, grpo_batch(), UpdateConfig(mini_batch_size=8)).metrics
    assert torch.isfinite(torch.tensor(metrics.grad_norm)) and metrics.grad_norm > 0
    inner = optimizer.optimizer.chained_optimizers[0].optimizer
    assert all(p.dtype == torch.float32 for group in inner.param_groups for p in group["params"])
