"""The PPO critic: values from the value head, token rewards with KL-in-reward, GAE targets, critic steps, TP/PP=2, checkpoints."""
import dataclasses
import pathlib

import pytest
import torch
from critic_parallel_worker import CRITIC_BATCH, FORWARD, parity_critic_update
from trainer_helpers import random_batch, tiny_hf_model, torchrun_ranks

from services.common.config import MegatronTrainingConfig, RLConfig
from services.trainer.algorithm.advantages import gae_advantages, ppo_targets, token_level_rewards
from services.trainer.modeling.checkpoint import TrainState, latest_step
from services.trainer.modeling.checkpoint_convert import load_hf_state
from services.trainer.algorithm.critic import (CriticUpdateConfig, build_critic, build_critic_optimizer, compute_values, critic_checkpoint_root,
                                               critic_update, load_critic_checkpoint, save_critic_checkpoint)
from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch
from services.trainer.modeling.model import ModelLayout, init_parallel

WORKER = pathlib.Path(__file__).with_name("critic_parallel_worker.py")
MT = MegatronTrainingConfig(lr=2e-3, clip_grad=1.0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


def tp1_critic(hf_dir):
    torch.set_num_threads(1)
    init_parallel(1, 1)
    return build_critic(ModelLayout.from_hf_dir(hf_dir), load_hf_state(hf_dir))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_values_are_the_value_head_on_the_final_hidden_state_predicting_each_response_token(hf_dir, tmp_path, tied):
    from transformers import Qwen2Model

    model_dir = tiny_hf_model(tmp_path, tie_word_embeddings=True) if tied else hf_dir
    critic = tp1_critic(model_dir)
    batch = random_batch(1, prompt_lengths=[3, 5, 2], response_lengths=[4, 2, 6])
    values = compute_values(critic, batch, ForwardConfig(micro_batch_size=3))
    assert values.shape == (3, 6)
    with torch.no_grad():
        hidden = Qwen2Model.from_pretrained(model_dir, dtype=torch.float32).eval()(batch.tokens).last_hidden_state
        head = critic.output_layer
        for i, (p, r) in enumerate(zip(batch.prompt_lengths.tolist(), batch.response_lengths.tolist())):
            expected = hidden[i, p - 1: p - 1 + r] @ head.weight[0] + head.bias[0]
            assert torch.allclose(values[i, :r], expected, atol=1e-5), i
            assert torch.all(values[i, r:] == 0)
    assert values[batch.response_mask().bool()].std() > 1e-3  # the compared values are not all alike


def test_values_are_causal_and_independent_of_batching(hf_dir):
    critic = tp1_critic(hf_dir)
    batch = random_batch(2, prompt_lengths=[4, 2, 3, 5], response_lengths=[3, 5, 1, 4])
    padded = compute_values(critic, batch, ForwardConfig(micro_batch_size=4))
    for forward in (ForwardConfig(micro_batch_size=1), ForwardConfig(micro_batch_size=3, use_remove_padding=True),
                    ForwardConfig(use_remove_padding=True, use_dynamic_bsz=True, max_packing_token_size=12)):
        assert torch.allclose(compute_values(critic, batch, forward), padded, atol=1e-5), forward
    # The value of response token t is read before t: changing a response's last token changes none of its values,
    # changing its first token changes every value after the first.
    prompt = batch.tokens[1, :2].tolist()
    response = batch.tokens[1, 2:7].tolist()
    last_changed = ResponseBatch.from_token_ids([prompt], [response[:-1] + [(response[-1] + 1) % 256]])
    first_changed = ResponseBatch.from_token_ids([prompt], [[(response[0] + 1) % 256] + response[1:]])
    assert torch.allclose(compute_values(critic, last_changed, FORWARD)[0], padded[1], atol=1e-5)
    moved = compute_values(critic, first_changed, FORWARD)[0]
    assert moved[0] == pytest.approx(padded[1, 0].item(), abs=1e-5)
    assert (moved[1:] - padded[1, 1:]).abs().min() > 1e-5


def test_token_level_rewards_by_hand():
    scores = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert torch.equal(token_level_rewards(scores, mask), torch.tensor([[0.0, 0.0, 1.0], [-0.5, 0.0, 0.0]]))
    kl = torch.tensor([[0.2, -0.4, 1.0], [0.5, 9.0, 9.0]])  # past the response the KL is ignored
    expected = torch.tensor([[-0.02, 0.04, 1.0 - 0.1], [-0.5 - 0.05, 0.0, 0.0]])
    assert torch.allclose(token_level_rewards(scores, mask, kl, kl_coef=0.1), expected)
    with pytest.raises(ValueError, match="response_mask: every sample needs at least one response token"):
        token_level_rewards(scores, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_ppo_targets_put_the_kl_penalty_in_the_reward_then_run_gae():
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.1, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.1], [-1.0, -0.2, 0.0]])
    rl = dataclasses.replace(RLConfig(), use_kl_in_reward=True, kl_penalty="kl", init_kl_coef=0.5, gamma=1.0, lam=1.0)
    targets = ppo_targets(scores, values, mask, rl, old, ref)
    # k1 = old - ref: [[0.5, 0, -0.4], [-0.5, 0]]; reward = score on the last token - 0.5 * k1.
    assert torch.allclose(targets.token_rewards, torch.tensor([[-0.25, 0.0, 1.2], [0.25, 0.0, 0.0]]))
    # gamma = lam = 1: the return is the sum of the rewards from t on.
    assert torch.allclose(targets.returns, torch.tensor([[0.95, 1.2, 1.2], [0.25, 0.0, 0.0]]))
    advantages, returns = gae_advantages(targets.token_rewards, values, mask, 1.0, 1.0)
    assert torch.equal(targets.advantages, advantages) and torch.equal(targets.returns, returns)
    without = ppo_targets(scores, values, mask, dataclasses.replace(rl, use_kl_in_reward=False))
    assert without.kl is None and torch.equal(without.token_rewards, token_level_rewards(scores, mask))
    with pytest.raises(ValueError, match="rl_config.use_kl_in_reward"):
        ppo_targets(scores, values, mask, rl)


def test_critic_steps_move_values_toward_fixed_returns(hf_dir):
    critic = tp1_critic(hf_dir)
    batch = random_batch(4, prompt_lengths=[3, 4, 2, 5, 3, 2], response_lengths=[4, 3, 5, 2, 3, 4])
    mask = batch.response_mask()
    returns = torch.tensor([1.0, -1.0, 0.5, 1.0, -0.5, 0.0]).unsqueeze(1) * mask
    optimizer = build_critic_optimizer(critic, MT, total_steps=12)
    cfg = CriticUpdateConfig(mini_batch_size=3, epochs=2, shuffle_mini_batch=True, cliprange_value=0.2,
                             forward=ForwardConfig(micro_batch_size=2))

    def error(values):
        return ((values - returns).abs() * mask).sum().item() / mask.sum().item()

    values = compute_values(critic, batch, cfg.forward)
    start = error(values)
    losses = []
    for step in range(3):  # each PPO iteration's old values are the critic's before its update
        metrics = critic_update(critic, optimizer, batch, values, returns, cfg, step)
        assert metrics.optimizer_steps == 4 and metrics.grad_norm > 0
        losses.append(metrics.vf_loss)
        values = compute_values(critic, batch, cfg.forward)
    assert losses[-1] < 0.5 * losses[0]
    assert error(values) < 0.5 * start
    assert 0 < metrics.vf_clipfrac < 1  # the second epoch's steps move some values past old +- 0.2


def test_one_ppo_iteration_raises_the_rewarded_responses(hf_dir):
    from trainer_helpers import megatron_tp1

    from services.trainer.modeling.logprobs import compute_logprobs
    from services.trainer.algorithm.update import TrainBatch, UpdateConfig, update_policy
    from services.trainer.modeling.optimizer import build_optimizer

    actor, _ = megatron_tp1(hf_dir)
    critic = tp1_critic(hf_dir)
    samples = random_batch(8, prompt_lengths=[3, 4, 2, 5], response_lengths=[4, 3, 5, 3])
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    rl = dataclasses.replace(RLConfig(), use_kl_in_reward=True, kl_penalty="kl", init_kl_coef=0.01)
    fwd = ForwardConfig(micro_batch_size=2)
    ref = compute_logprobs(actor, samples, fwd)[0]
    actor_opt = build_optimizer(actor, MT, total_steps=4)
    critic_opt = build_critic_optimizer(critic, MT, total_steps=4)
    mask = samples.response_mask()
    for step in range(2):
        old = compute_logprobs(actor, samples, fwd)[0]
        values = compute_values(critic, samples, fwd)
        targets = ppo_targets(scores, values, mask, rl, old, ref)
        update_policy(actor, actor_opt, TrainBatch(samples, targets.advantages, old),
                      UpdateConfig(mini_batch_size=2, forward=fwd), step)
        metrics = critic_update(critic, critic_opt, samples, values, targets.returns,
                                CriticUpdateConfig(mini_batch_size=2, forward=fwd), step)
        assert metrics.optimizer_steps == 2 and metrics.vf_loss > 0
    after = compute_logprobs(actor, samples, fwd)[0]
    gain = ((after - ref) * mask).sum(1) / mask.sum(1)
    assert gain[scores == 1].min() > gain[scores == 0].max()


@pytest.mark.parametrize("tp,pp,cp", [(2, 1, ()), (1, 2, ()), (1, 1, (2, "megatron_cp_algo")), (1, 1, (2, "ulysses_cp_algo")),
                                      (1, 2, (2, "megatron_cp_algo"))],
                         ids=["tp2", "pp2", "cp2-ring", "cp2-ulysses", "pp2-cp2"])
def test_parallel_ranks_give_one_rank_values_and_step(hf_dir, tmp_path, tp, pp, cp):
    critic = tp1_critic(hf_dir)
    batch = random_batch(**CRITIC_BATCH)
    values = compute_values(critic, batch, FORWARD)
    metrics, after = parity_critic_update(critic, batch)
    for rank in torchrun_ranks(WORKER, tp * pp * (cp[0] if cp else 1), hf_dir, tmp_path, tp, pp, *cp):
        assert torch.allclose(rank["values"], values, atol=1e-5)
        assert torch.allclose(rank["values_after"], after, atol=1e-5)
        for name in ("vf_loss", "vf_clipfrac", "values_mean", "grad_norm"):  # grad_norm spans TP shards / PP stages
            assert rank["metrics"][name] == pytest.approx(metrics[name], abs=1e-5), name
    assert (after - values).abs().max() > 1e-3  # the compared step moved the values


def test_critic_checkpoint_round_trip(hf_dir, tmp_path):
    batch = random_batch(6, prompt_lengths=[3, 4, 2, 5], response_lengths=[2, 3, 4, 2])
    returns = torch.ones(batch.size, batch.max_response_length) * batch.response_mask()
    cfg = CriticUpdateConfig(mini_batch_size=2, forward=FORWARD)

    def run():
        critic = tp1_critic(hf_dir)
        return critic, build_critic_optimizer(critic, dataclasses.replace(MT, lr_warmup_fraction=0.5), total_steps=8)

    critic, optimizer = run()
    critic_update(critic, optimizer, batch, compute_values(critic, batch, FORWARD), returns, cfg)
    save_critic_checkpoint(tmp_path, critic, optimizer, TrainState(step=1))
    saved_values = compute_values(critic, batch, FORWARD)
    uninterrupted = critic_update(critic, optimizer, batch, saved_values, returns, cfg, step=1)

    critic, optimizer = run()
    assert load_critic_checkpoint(tmp_path, critic, optimizer, step=1) == TrainState(step=1)
    assert latest_step(critic_checkpoint_root(tmp_path)) == 1 and latest_step(tmp_path) is None  # apart from the actor's
    assert torch.equal(compute_values(critic, batch, FORWARD), saved_values)
    resumed = critic_update(critic, optimizer, batch, saved_values, returns, cfg, step=1)
    assert resumed.vf_loss == pytest.approx(uninterrupted.vf_loss, abs=1e-6)
    assert resumed.lr == pytest.approx(uninterrupted.lr) and resumed.grad_norm == pytest.approx(uninterrupted.grad_norm, rel=1e-5)


def test_critic_update_config_reads_the_ppo_config():
    from services.common.config import load_config

    cfg = load_config(pathlib.Path(__file__).parents[2] / "configs" / "ppo_qwen25_7b.yaml")
    critic = CriticUpdateConfig.from_config(cfg)
    assert (critic.mini_batch_size, critic.epochs, critic.shuffle_mini_batch) == (32, 2, True)
    assert critic.cliprange_value == 0.5 and critic.forward.micro_batch_size == 2


def test_critic_learning_rate_defaults_to_the_actors(hf_dir):
    from services.common.config import ConfigError, DEFAULT_CONFIG, load_config

    critic = tp1_critic(hf_dir)
    mt = MegatronTrainingConfig(lr=1e-6)
    assert build_critic_optimizer(critic, mt, 4).param_groups[0]["lr"] == 1e-6
    assert build_critic_optimizer(critic, dataclasses.replace(mt, critic_lr=1e-5), 4).param_groups[0]["lr"] == 1e-5
    with pytest.raises(ConfigError, match="megatron_training.critic_lr: 1e-07 is below megatron_training.min_lr 1e-06"):
        load_config(DEFAULT_CONFIG, ["megatron_training.critic_lr=1e-7", "megatron_training.min_lr=1e-6"])
