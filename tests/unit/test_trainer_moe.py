"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE): megatron's logits equal transformers', HF <-> Megatron
conversion is bit-identical over TP and EP splits, and layouts the trainer does not build are refused by key."""
import json

import pytest
import torch
from trainer_helpers import assert_logits_match, megatron_tp1, tiny_hf_model

from services.trainer.modeling.checkpoint_convert import (expert_parallel_part, hf_to_megatron, load_hf_state, megatron_to_hf,
                                                          merge_expert_parallel)
from services.trainer.modeling.model import ModelLayout

ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def moe_dir(request, tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp(request.param), architecture=request.param)


def test_layout_reads_the_moe_config(moe_dir):
    layout = ModelLayout.from_hf_dir(moe_dir)
    assert (layout.num_experts, layout.moe_topk, layout.moe_ffn_hidden_size) == (4, 2, 96)
    qwen2 = layout.architecture == "Qwen2MoeForCausalLM"
    assert layout.shared_expert_ffn_hidden_size == (192 if qwen2 else 0)
    assert (layout.qkv_bias, layout.qk_layernorm, layout.norm_topk_prob) == (qwen2, not qwen2, not qwen2)
    assert layout.router_aux_loss_coef == pytest.approx(0.001)


def test_logits_match_transformers(moe_dir):
    import transformers

    model, layout = megatron_tp1(moe_dir)
    reference = getattr(transformers, layout.architecture).from_pretrained(moe_dir, dtype=torch.float32).eval()
    assert_logits_match(model, reference)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_round_trip_is_bit_identical(moe_dir, tp, ep):
    hf = load_hf_state(moe_dir)
    layout = ModelLayout.from_hf_dir(moe_dir)
    layout.check_parallel(tp, 1, ep=ep)
    shards = hf_to_megatron(hf, layout, tp, 1)
    parts = {t: [expert_parallel_part(shards[(0, t)], layout, ep, e) for e in range(ep)] for t in range(tp)}
    # Each EP rank holds num_experts / ep experts, numbered from 0 as megatron's SequentialMLP names them.
    local = {name.split("local_experts.")[1].split(".")[0] for name in parts[0][-1] if "local_experts." in name}
    assert local == {str(e) for e in range(4 // ep)}
    back = megatron_to_hf({(0, t): merge_expert_parallel(parts[t], layout) for t in range(tp)}, layout)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_experts_router_and_shared_expert_land_where_megatron_reads_them(moe_dir):
    hf = load_hf_state(moe_dir)
    layout = ModelLayout.from_hf_dir(moe_dir)
    last_rank = expert_parallel_part(hf_to_megatron(hf, layout, 2, 1)[(0, 1)], layout, 2, 1)
    src, dst = "model.layers.1.mlp.", "decoder.layers.1.mlp."
    fc1 = last_rank[f"{dst}experts.local_experts.1.linear_fc1.weight"]  # global expert 3, TP half 2: [gate half 2; up half 2]
    assert torch.equal(fc1[:48], hf[f"{src}experts.3.gate_proj.weight"][48:])
    assert torch.equal(fc1[48:], hf[f"{src}experts.3.up_proj.weight"][48:])
    assert torch.equal(last_rank[f"{dst}experts.local_experts.1.linear_fc2.weight"], hf[f"{src}experts.3.down_proj.weight"][:, 48:])
    assert torch.equal(last_rank[f"{dst}router.weight"], hf[f"{src}gate.weight"])
    if layout.shared_expert_ffn_hidden_size:
        assert torch.equal(last_rank[f"{dst}shared_experts.gate_weight"], hf[f"{src}shared_expert_gate.weight"])
        assert torch.equal(last_rank[f"{dst}shared_experts.linear_fc2.weight"], hf[f"{src}shared_expert.down_proj.weight"][:, 96:])
    else:
        assert torch.equal(last_rank["decoder.layers.1.self_attention.q_layernorm.weight"], hf["model.layers.1.self_attn.q_norm.weight"])


@pytest.mark.parametrize("tp,pp,ep,message", [
    (1, 1, 3, "expert_model_parallel_size: 3 does not divide the model's num_experts 4"),
    (1, 4, 1, "pipeline_model_parallel_size: 4 does not divide num_hidden_layers 2"),
])
def test_splits_the_trainer_cannot_make_are_refused(moe_dir, tp, pp, ep, message):
    with pytest.raises(ValueError, match=message):
        ModelLayout.from_hf_dir(moe_dir).check_parallel(tp, pp, ep=ep)


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path):
    layout = ModelLayout.from_hf_dir(tiny_hf_model(tmp_path))
    with pytest.raises(ValueError, match="expert_model_parallel_size: 2 needs a mixture-of-experts model"):
        layout.check_parallel(1, 1, ep=2)


@pytest.mark.parametrize("change,message", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step: 2 is not supported"),
    ({"mlp_only_layers": [0]}, r"mlp_only_layers: \[0\] is not supported"),
])
def test_moe_layouts_this_model_cannot_build_are_refused(moe_dir, tmp_path, change, message):
    config = json.loads((moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        ModelLayout.from_hf_dir(tmp_path)


def test_the_load_balancing_loss_enters_the_gradient_and_is_reported(tmp_path):
    import dataclasses

    from trainer_helpers import random_batch
    from trainer_parallel_worker import PARITY_BATCH, parity_update

    from services.trainer.modeling.checkpoint_convert import load_hf_into_model
    from services.trainer.modeling.model import build_model, init_parallel

    hf_dir = tiny_hf_model(tmp_path, architecture="qwen2_moe")
    init_parallel(1, 1)
    hf, layout = load_hf_state(hf_dir), ModelLayout.from_hf_dir(hf_dir)
    metrics = {}
    for coef in (0.0, 0.001, 0.1):
        model = build_model(dataclasses.replace(layout, router_aux_loss_coef=coef))
        load_hf_into_model(model, hf, layout)
        metrics[coef] = parity_update(model, random_batch(**PARITY_BATCH))
    assert metrics[0.0]["moe_aux_loss"] == 0.0 and metrics[0.001]["moe_aux_loss"] > 0
    # The same routing, scaled by its coefficient: the metric is router_aux_loss_coef x the load-balancing loss.
    assert metrics[0.1]["moe_aux_loss"] == pytest.approx(100 * metrics[0.001]["moe_aux_loss"], rel=1e-5)
    assert metrics[0.1]["pg_loss"] == pytest.approx(metrics[0.0]["pg_loss"], abs=1e-7)  # the policy loss is the same ...
    assert abs(metrics[0.1]["grad_norm"] - metrics[0.0]["grad_norm"]) > 1e-4  # ... its gradient is not
