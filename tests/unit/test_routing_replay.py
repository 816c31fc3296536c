"""Routing replay in the trainer (rl_config.routing_replay): given each token's experts, megatron's routers pick exactly
those in the padded and the packed forward, where without replay they pick their own; the loss and its gradients still
reach the router and the experts; a model without replay, or a dense model, is refused by key."""
import pytest
import torch
from trainer_helpers import chosen_experts, random_batch, tiny_hf_model

from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
from services.trainer.modeling.logprobs import ResponseBatch, forward_micro_batch, run_micro_batches
from services.trainer.modeling.model import ModelLayout, build_model, init_parallel

PROMPTS, RESPONSES = [5, 3, 7], [4, 6, 2]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("qwen2_moe"), architecture="qwen2_moe")


@pytest.fixture(scope="module")
def replay_model(moe_dir):
    torch.set_num_threads(1)
    init_parallel(1, 1)
    layout = ModelLayout.from_hf_dir(moe_dir)
    model = build_model(layout, routing_replay=True)
    load_hf_into_model(model, load_hf_state(moe_dir), layout)
    return model, layout


def other_experts(natural: list[torch.Tensor], num_experts: int) -> list[torch.Tensor]:
    """Per sample, the experts the router did not pick (top-2 of 4: the complement is another top-2), without the
    last position (the rollout never routes it)."""
    out = []
    for sample in natural:
        picked = torch.zeros(*sample.shape[:2], num_experts, dtype=torch.bool).scatter(-1, sample, True)
        out.append((~picked).nonzero()[:, -1].view(sample.shape)[:-1].to(torch.uint8))
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_makes_the_routers_pick_the_given_experts(replay_model, packed):
    model, layout = replay_model
    model.eval()
    plain = random_batch(0, PROMPTS, RESPONSES)
    natural_logp, natural = chosen_experts(model, plain, packed)
    given = other_experts(natural, layout.num_experts)
    replayed = ResponseBatch(plain.tokens, plain.prompt_lengths, plain.response_lengths, given)
    logp, chosen = chosen_experts(model, replayed, packed)
    for i, (want, got, own) in enumerate(zip(given, chosen, natural)):
        assert torch.equal(got[:-1], want.long()), f"sample {i}: the routers did not follow the given routing"
        assert not torch.equal(own[:-1], want.long())
    assert not torch.allclose(logp, natural_logp)  # other experts: other log-probs
    # without replay again: the routers' own choice, unchanged by the replay before
    assert all(torch.equal(a, b) for a, b in zip(chosen_experts(model, plain, packed)[1], natural))


def test_replayed_loss_reaches_the_router_and_the_experts(replay_model):
    model, layout = replay_model
    model.train()
    plain = random_batch(1, PROMPTS, RESPONSES)
    _, natural = chosen_experts(model, plain, packed=False)
    given = other_experts(natural, layout.num_experts)
    batch = ResponseBatch(plain.tokens, plain.prompt_lengths, plain.response_lengths, given)
    model.zero_grad()
    run_micro_batches(model, [batch], packed=False, loss_fn=lambda _i, logp, _e: -(logp * batch.response_mask()).sum())
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    router = [g for name, g in grads.items() if name.endswith("mlp.router.weight")]
    experts = [g for name, g in grads.items() if "local_experts" in name]
    assert len(router) == layout.num_layers and all(g.abs().sum() > 0 and torch.isfinite(g).all() for g in router)
    assert experts and all(torch.isfinite(g).all() for g in experts) and sum(g.abs().sum() for g in experts) > 0
    model.zero_grad()


def test_routing_needs_a_model_built_for_replay_and_an_moe_model(moe_dir, replay_model, tmp_path):
    _, layout = replay_model
    plain_model = build_model(layout)  # no RouterReplay in its routers
    batch = random_batch(2, [3], [2])
    routed = ResponseBatch(batch.tokens, batch.prompt_lengths, batch.response_lengths,
                           [torch.zeros(4, layout.num_layers, 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="rl_config.routing_replay: the model's routers were built without replay"):
        forward_micro_batch(plain_model, routed, packed=False)
    with pytest.raises(ValueError, match="rl_config.routing_replay: the model has no MoE layers"):
        build_model(ModelLayout.from_hf_dir(tiny_hf_model(tmp_path / "dense")), routing_replay=True)
    too_long = ResponseBatch(batch.tokens, batch.prompt_lengths, batch.response_lengths,
                             [torch.zeros(9, layout.num_layers, 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="routed_experts: sample 0's routing"):
        forward_micro_batch(replay_model[0], too_long, packed=True)


def test_replay_follows_each_sample_into_dynamic_micro_batches(replay_model):
    """use_dynamic_bsz splits the batch by a token budget: each micro-batch replays its own samples' routing."""
    from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs

    model, layout = replay_model
    plain = random_batch(3, PROMPTS, RESPONSES)
    _, natural = chosen_experts(model, plain, packed=True)
    batch = ResponseBatch(plain.tokens, plain.prompt_lengths, plain.response_lengths, other_experts(natural, layout.num_experts))
    whole, _ = forward_micro_batch(model.eval(), batch, packed=True)
    for packed in (True, False):
        split = ForwardConfig(use_remove_padding=packed, use_dynamic_bsz=True, max_packing_token_size=10)
        assert torch.allclose(compute_logprobs(model, batch, split)[0], whole.detach(), atol=1e-5)
    assert not torch.allclose(compute_logprobs(model, plain, split)[0], whole.detach(), atol=1e-3)
