"""The update step: LR schedules, GRPO steps on a fixed batch, the skipped old-logprob pass, micro-batch exactness,
the log-probs before the update it hands back and the train/rollout agreement computed from them."""
import dataclasses

import pytest
import torch
from trainer_helpers import megatron_tp1, random_batch, scored_batch, tiny_hf_model

from services.common.config import MegatronTrainingConfig
from services.trainer.algorithm.advantages import group_norm_advantages
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs
from services.trainer.algorithm.losses import PolicyLossConfig
from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy
from services.trainer.modeling.optimizer import build_optimizer

N = 4
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


def grpo_batch() -> TrainBatch:
    samples = random_batch(5, prompt_lengths=[4] * 4 + [3] * 4, response_lengths=[3, 5, 2, 4, 6, 3, 2, 4])
    return TrainBatch(samples, group_norm_advantages(REWARDS, N, samples.response_mask()))


def lrs(model, style: str, warmup_fraction: float) -> list[float]:
    mt = MegatronTrainingConfig(lr=1.0, min_lr=0.1, lr_warmup_fraction=warmup_fraction, lr_decay_style=style)
    optimizer = build_optimizer(model, mt, total_steps=10)
    out = []
    for _ in range(11):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.scheduler.step(1)
    return out


def test_lr_schedules_by_hand(hf_dir):
    model, _ = megatron_tp1(hf_dir)
    lrs_of = lambda style, warmup: lrs(model, style, warmup)  # noqa: E731
    cosine = lrs_of("cosine", 0.2)  # 2 warmup steps of 10
    assert cosine[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert cosine[4] == pytest.approx(0.1 + 0.9 * 0.5 * (2 ** -0.5 + 1))  # decay ratio 2/8
    assert cosine[6] == pytest.approx(0.55) and cosine[10] == pytest.approx(0.1)
    linear = lrs_of("linear", 0.2)
    assert linear[4] == pytest.approx(0.775) and linear[10] == pytest.approx(0.1)
    assert lrs_of("constant", 0.0) == pytest.approx([1.0] * 11)


def test_unknown_decay_style_names_the_key(hf_dir):
    model, _ = megatron_tp1(hf_dir)
    with pytest.raises(ValueError, match="megatron_training.lr_decay_style: 'step'"):
        build_optimizer(model, MegatronTrainingConfig(lr_decay_style="step"), 10)


def test_grpo_steps_raise_logprob_of_rewarded_responses(hf_dir):
    model, _ = megatron_tp1(hf_dir)
    batch = grpo_batch()
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=2e-3, clip_grad=1.0), total_steps=4)
    cfg = UpdateConfig(mini_batch_size=8, loss=PolicyLossConfig(kl_coef=0.001))
    mask = batch.samples.response_mask()
    before = compute_logprobs(model, batch.samples, ForwardConfig(micro_batch_size=8))[0]
    batch = dataclasses.replace(batch, ref_logprobs=before)
    for step in range(4):
        metrics = update_policy(model, optimizer, batch, cfg, step).metrics
        assert not metrics.old_logprob_pass and metrics.optimizer_steps == 1
    after = compute_logprobs(model, batch.samples, ForwardConfig(micro_batch_size=8))[0]

    def mean_logp(logp, rewarded):
        rows = REWARDS == (1.0 if rewarded else 0.0)
        return ((logp * mask)[rows].sum() / mask[rows].sum()).item()

    assert mean_logp(after, True) > mean_logp(before, True) + 0.05
    assert mean_logp(after, False) < mean_logp(before, False)
    assert metrics.grad_norm > 0 and metrics.kl > 0


def _one_update(hf_dir, batch, cfg):
    model, _ = megatron_tp1(hf_dir)
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, clip_grad=0.0), total_steps=4)
    metrics = update_policy(model, optimizer, batch, cfg).metrics
    # The last mini-batch's gradient, as DDP accumulated it (Adam's first step is ~lr * sign(g): parameters would hide
    # or blow up tiny differences).
    return metrics, torch.cat([p.main_grad.flatten() for p in model.parameters()])


def test_skipped_old_logprob_pass_equals_computing_it(hf_dir):
    batch = grpo_batch()
    cfg = UpdateConfig(mini_batch_size=8)
    skipped, grads_skipped = _one_update(hf_dir, batch, cfg)
    model, _ = megatron_tp1(hf_dir)
    old = compute_logprobs(model, batch.samples, cfg.forward)[0]
    explicit, grads_explicit = _one_update(hf_dir, dataclasses.replace(batch, old_logprobs=old), cfg)
    assert not skipped.old_logprob_pass
    assert skipped.pg_loss == pytest.approx(explicit.pg_loss, abs=1e-6)
    assert torch.allclose(grads_skipped, grads_explicit, atol=1e-6)


@pytest.mark.parametrize("cfg", [UpdateConfig(mini_batch_size=8), UpdateConfig(mini_batch_size=4, epochs=2)],
                         ids=["one-step", "mini-batches"])
def test_update_hands_back_the_log_probs_before_its_first_step(hf_dir, cfg):
    # One step: they come from the step's own forward pass (no pass of their own); several: from the old-policy pass.
    model, _ = megatron_tp1(hf_dir)
    batch = grpo_batch()
    before = compute_logprobs(model, batch.samples, cfg.forward)[0]
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3), total_steps=4)
    result = update_policy(model, optimizer, batch, cfg)
    assert torch.allclose(result.start_logprobs, before, atol=1e-6)
    after = compute_logprobs(model, batch.samples, cfg.forward)[0]
    assert not torch.allclose(after, before, atol=1e-4)  # the policy moved: they are not the updated policy's


def test_rollout_agreement_compares_only_samples_the_current_weights_generated_whole():
    from services.trainer.loop.session import rollout_agreement

    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    # sample 0: two tokens of version 3 (current), one of version 2 (a partial rollout's older round); sample 1: two tokens
    batch = scored_batch([[1], [1]], [[5, 6, 7], [5, 6]], [1.0, 0.0], [[-1.5, -2.5, -9.0], [-1.0, -1.25]],
                         [[2, 3, 3], [3, 3]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    metrics = rollout_agreement(trainer, batch, mask, version=3)
    # sample 0 began on older weights (its later tokens may sit on their KV cache): only sample 1 is compared
    assert metrics["train_rollout_logprob_diff"] == pytest.approx((0.0 + 0.25) / 2)
    assert metrics["rollout/off_policy_token_fraction"] == pytest.approx(1 / 5)
    assert "train_rollout_logprob_diff" not in rollout_agreement(trainer, batch, mask, version=4)


def test_mini_batches_and_epochs_compute_the_old_policy_once(hf_dir):
    metrics, _ = _one_update(hf_dir, grpo_batch(), UpdateConfig(mini_batch_size=4, epochs=2, shuffle_mini_batch=True))
    assert metrics.old_logprob_pass and metrics.optimizer_steps == 4
    assert metrics.ppo_kl != 0.0  # later steps see a policy that moved away from the old one


@pytest.mark.parametrize("forward", [ForwardConfig(micro_batch_size=1), ForwardConfig(micro_batch_size=3, use_remove_padding=True)],
                         ids=["mbs1", "packed-mbs3"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_gives_the_whole_mini_batch_step(hf_dir, forward, agg):
    loss = PolicyLossConfig(agg=agg)
    whole, grads_whole = _one_update(hf_dir, grpo_batch(), UpdateConfig(8, loss=loss, forward=ForwardConfig(micro_batch_size=8)))
    split, grads_split = _one_update(hf_dir, grpo_batch(), UpdateConfig(8, loss=loss, forward=forward))
    assert split.pg_loss == pytest.approx(whole.pg_loss, abs=1e-6)
    assert split.grad_norm == pytest.approx(whole.grad_norm, rel=1e-4)
    assert torch.allclose(grads_split, grads_whole, atol=1e-6, rtol=1e-4)


def test_clipping_scales_the_gradient_to_the_limit_and_reports_the_norm_before(hf_dir):
    batch = grpo_batch()
    free, grads_free = _one_update(hf_dir, batch, UpdateConfig(8))
    model, _ = megatron_tp1(hf_dir)
    limit = free.grad_norm / 4
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, clip_grad=limit), total_steps=4)
    clipped = update_policy(model, optimizer, batch, UpdateConfig(8)).metrics
    assert clipped.grad_norm == pytest.approx(free.grad_norm, rel=1e-5)  # the norm before clipping, over every tensor
    assert free.grad_norm == pytest.approx(grads_free.double().norm().item(), rel=1e-6)
    main_grads = torch.cat([p.main_grad.flatten() for p in model.parameters()])
    assert main_grads.double().norm().item() == pytest.approx(limit, rel=1e-5)


def test_update_config_reads_the_run_config():
    from services.common.config import DEFAULT_CONFIG, load_config

    cfg = load_config(DEFAULT_CONFIG, ["rl_config.clip_higher_enable=true", "rl_config.use_remove_padding=true"])
    update = UpdateConfig.from_config(cfg)
    assert update.mini_batch_size == cfg.samples_per_iteration  # derived at load: GBS * n
    assert (update.loss.clip_ratio_low, update.loss.clip_ratio_high) == (0.2, 0.28)
    assert update.forward.use_remove_padding and update.forward.micro_batch_size == 16


def test_bf16_training_keeps_fp32_main_weights_and_matches_fp32(hf_dir):
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.model import ModelLayout, build_model

    fp32, _ = _one_update(hf_dir, grpo_batch(), UpdateConfig(8))
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout, torch.bfloat16)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    optimizer = build_optimizer(model, MegatronTrainingConfig(lr=1e-3, clip_grad=0.0, bf16=True), total_steps=4)
    bf16 = update_policy(model, optimizer, grpo_batch(), UpdateConfig(8)).metrics
    inner = optimizer.optimizer.chained_optimizers[0].optimizer
    assert {p.dtype for group in inner.param_groups for p in group["params"]} == {torch.float32}  # Adam steps fp32 copies
    assert next(model.parameters()).dtype == torch.bfloat16
    assert bf16.grad_norm == pytest.approx(fp32.grad_norm, rel=0.05) and bf16.pg_loss == pytest.approx(fp32.pg_loss, abs=0.02)
