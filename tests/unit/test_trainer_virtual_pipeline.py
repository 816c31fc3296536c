"""Virtual pipeline (megatron's interleaved 1F1B schedule): PP 2 x VPP 2 on 2 ranks, a 4-layer model in 4 chunks, against
one rank: loss, gradients, log-probs, update metrics and weights; the streamed weight gather against the HF checkpoint bit
for bit; its checkpoint (model0/model1 per file) resumed to the same next step and converted to HF as the weights; the
PPO critic's values and update; an update with token-budget micro-batches (use_dynamic_bsz), cut to a multiple of PP."""
import dataclasses
import pathlib

import pytest
import torch
from critic_parallel_worker import CRITIC_BATCH, FORWARD, parity_critic_update
from trainer_helpers import gather_hf_weights, megatron_tp1, random_batch, tiny_hf_model, torchrun_ranks
from virtual_pipeline_worker import DYNAMIC, VPP_BATCH, vpp_optimizer, vpp_update

from services.trainer.algorithm.critic import build_critic, compute_values
from services.trainer.modeling.checkpoint_convert import (MEGATRON_FILE, convert_megatron_to_hf, hf_conversions, load_hf_state,
                                                          megatron_to_hf)
from services.trainer.modeling.logprobs import ForwardConfig, compute_logprobs, run_micro_batches
from services.trainer.modeling.model import ModelLayout

WORKER = pathlib.Path(__file__).with_name("virtual_pipeline_worker.py")


def test_chunks_hold_megatron_layer_numbering(tmp_path):
    """Chunk v of stage p holds global layers of virtual stage v x PP + p (get_transformer_layer_offset)."""
    layout = ModelLayout.from_hf_dir(tiny_hf_model(tmp_path, num_layers=4))
    layers = {(c.pp_rank, c.name.split(".")[0], c.name.split(".")[3]): c.to_hf
              for c in hf_conversions(layout, pp=2, vpp=2) if ".input_layernorm." in c.name}
    names = {key: next(iter(to_hf([torch.empty(0)]))) for key, to_hf in layers.items()}
    assert names == {(0, "0", "0"): "model.layers.0.input_layernorm.weight", (1, "0", "0"): "model.layers.1.input_layernorm.weight",
                     (0, "1", "0"): "model.layers.2.input_layernorm.weight", (1, "1", "0"): "model.layers.3.input_layernorm.weight"}
    with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size: 2 chunks on each of 2 stages do not divide "
                                         r"num_hidden_layers 2"):
        ModelLayout.from_hf_dir(tiny_hf_model(tmp_path / "two", num_layers=2)).check_parallel(1, 2, vpp=2)


def test_pp2_vpp2_trains_as_one_rank_streams_checkpoints_and_converts(tmp_path):
    hf_dir = tiny_hf_model(tmp_path / "hf", num_layers=4)
    model, layout = megatron_tp1(hf_dir)
    batch = random_batch(**VPP_BATCH)
    parts = [batch.select(torch.tensor([i])) for i in range(batch.size)]
    tokens = float(batch.response_lengths.sum())
    results = run_micro_batches(model, parts, packed=False, loss_fn=lambda i, logp, entropy: -logp.sum() / tokens)
    loss = sum(-lp.sum().item() for lp, _ in results) / tokens
    grads = megatron_to_hf({(0, 0): {n: p.grad for n, p in model.named_parameters()}}, layout)
    model.zero_grad()
    logp = compute_logprobs(model, batch, ForwardConfig(micro_batch_size=2, use_remove_padding=True))[0]
    optimizer = vpp_optimizer(model)
    update1 = vpp_update(model, optimizer, batch, 0)
    weights1 = {name: t.clone() for name, t in gather_hf_weights(model, layout).items()}  # some are views of the live weights
    update2 = vpp_update(model, optimizer, batch, 1)
    critic = build_critic(layout, load_hf_state(hf_dir))
    critic_batch = random_batch(**CRITIC_BATCH)
    values = compute_values(critic, critic_batch, FORWARD)
    critic_metrics, values_after = parity_critic_update(critic, critic_batch)
    fresh, _ = megatron_tp1(hf_dir)
    dynamic_update = vpp_update(fresh, vpp_optimizer(fresh), batch, 0, dataclasses.replace(DYNAMIC, count_multiple_of=1))
    dynamic_weights = gather_hf_weights(fresh, layout)

    ranks = torchrun_ranks(WORKER, 2, hf_dir, tmp_path / "out")
    original = load_hf_state(hf_dir)
    vpp_grads = megatron_to_hf({(r["pp_rank"], 0): r["grads"] for r in ranks}, layout)
    assert vpp_grads.keys() == grads.keys()
    for name in grads:
        assert torch.allclose(vpp_grads[name], grads[name], atol=1e-5, rtol=0), name
    for r in ranks:
        assert r["chunks"] == 2
        assert r["loss"] == pytest.approx(loss, abs=1e-5)
        assert torch.allclose(r["packed_logp"], logp, atol=1e-5)
        assert r["streamed"].keys() == original.keys()  # the push's stream, global layer numbers included
        assert all(torch.equal(r["streamed"][k], original[k]) for k in original)
        for step, reference in (("update1", update1), ("update2", update2)):
            for name in ("loss", "entropy", "grad_norm"):
                assert r[step][name] == pytest.approx(reference[name], rel=1e-5, abs=1e-5), (step, name)
        # Adam's first step moves each weight by about lr (1e-3) whatever its gradient's size: where a gradient is
        # near 0 a last-digit difference moves it a little differently, never by a step's size.
        assert all(torch.allclose(r["weights1"][k], weights1[k], atol=2e-4, rtol=0) for k in weights1)
        # Resumed from the checkpoint of step 1: the same second step (weights, Adam moments, schedule restored).
        assert r["resumed_step"] == 1 and r["resumed_update2"] == r["update2"]
        assert all(torch.equal(r["resumed_weights2"][k], r["weights2"][k]) for k in original)
        assert torch.allclose(r["values"], values, atol=1e-5) and torch.allclose(r["values_after"], values_after, atol=1e-5)
        for name in ("vf_loss", "grad_norm"):
            assert r["critic_update"][name] == pytest.approx(critic_metrics[name], rel=1e-5, abs=1e-5), name
        # Four micro-batches there, three on one rank: the same token-weighted step.
        for name in ("loss", "entropy", "grad_norm"):
            assert r["dynamic_update"][name] == pytest.approx(dynamic_update[name], rel=1e-5, abs=1e-5), name
        assert all(torch.allclose(r["dynamic_weights"][k], dynamic_weights[k], atol=2e-4, rtol=0) for k in dynamic_weights)

    iteration = tmp_path / "out" / "ckpt" / "iter_0000001"
    shard = torch.load(iteration / "mp_rank_00_001" / MEGATRON_FILE, weights_only=False)
    assert "model" not in shard and {"model0", "model1"} <= shard.keys()  # Megatron's per-chunk keys
    converted = load_hf_state(convert_megatron_to_hf(iteration, tmp_path / "converted"))
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[k], ranks[0]["weights1"][k]) for k in original)
