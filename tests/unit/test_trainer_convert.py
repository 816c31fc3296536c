"""HF <-> Megatron conversion: bit-identical round trips for TP/PP splits, files and CLI, and errors."""
import argparse

import pytest
import torch
from trainer_helpers import tiny_hf_model

from services.trainer import cli
from services.trainer.modeling.checkpoint_convert import (MEGATRON_FILE, hf_to_megatron, load_hf_state, load_megatron,
                                                          megatron_to_hf)
from services.trainer.modeling.model import ModelLayout


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"), tie_word_embeddings=request.param)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_identical(hf_dir, tp, pp):
    hf = load_hf_state(hf_dir)
    layout = ModelLayout.from_hf_dir(hf_dir)
    shards = hf_to_megatron(hf, layout, tp, pp)
    assert set(shards) == {(p, t) for p in range(pp) for t in range(tp)}
    back = megatron_to_hf(shards, layout)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_qkv_is_interleaved_per_query_group(hf_dir):
    hf = load_hf_state(hf_dir)
    layout = ModelLayout.from_hf_dir(hf_dir)  # 4 heads, 2 groups, head_dim 32
    qkv = hf_to_megatron(hf, layout, 1, 1)[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    hd = 32
    # group 1 = [q heads 2, 3 | k head 1 | v head 1]
    group1 = qkv[4 * hd: 8 * hd]
    assert torch.equal(group1[: 2 * hd], q[2 * hd: 4 * hd])
    assert torch.equal(group1[2 * hd: 3 * hd], k[hd: 2 * hd])
    assert torch.equal(group1[3 * hd:], v[hd:])
    tp2 = hf_to_megatron(hf, layout, 2, 1)
    assert torch.equal(tp2[(0, 1)]["decoder.layers.0.self_attention.linear_qkv.weight"], group1)
    fc1 = tp2[(0, 1)]["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate half 2; up half 2]
    assert torch.equal(fc1[:192], hf["model.layers.0.mlp.gate_proj.weight"][192:])
    assert torch.equal(fc1[192:], hf["model.layers.0.mlp.up_proj.weight"][192:])


def test_tp_that_does_not_divide_kv_heads_is_refused(hf_dir):
    layout = ModelLayout.from_hf_dir(hf_dir)
    with pytest.raises(ValueError, match="tensor_model_parallel_size: 4 does not divide the model's num_key_value_heads 2"):
        hf_to_megatron(load_hf_state(hf_dir), layout, 4, 1)


def test_cli_convert_both_ways(hf_dir, tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    mg = tmp_path / "mg"
    assert cli.run(parser.parse_args(["convert", "--to", "megatron", "--src", str(hf_dir), "--dst", str(mg), "--tp", "2"])) == 0
    assert set(load_megatron(mg)) == {(0, 0), (0, 1)}
    back = tmp_path / "hf"
    assert cli.run(parser.parse_args(["convert", "--to", "hf", "--src", str(mg), "--dst", str(back)])) == 0
    original, converted = load_hf_state(hf_dir), load_hf_state(back)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[k], original[k]) for k in original)
    assert (back / "tokenizer.json").exists() and (back / "config.json").exists()



def test_cli_convert_writes_virtual_pipeline_chunks_as_megatron_keys_them(tmp_path, capsys):
    hf_dir = tiny_hf_model(tmp_path / "hf4", num_layers=4)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    mg = tmp_path / "mg"
    assert cli.run(parser.parse_args(["convert", "--to", "megatron", "--src", str(hf_dir), "--dst", str(mg),
                                      "--pp", "2", "--vpp", "2"])) == 0
    assert '"pp": 2, "vpp": 2' in capsys.readouterr().out
    hf = load_hf_state(hf_dir)
    for stage in (0, 1):
        payload = torch.load(mg / f"mp_rank_00_{stage:03d}" / MEGATRON_FILE, weights_only=True)
        assert sorted(payload) == ["model0", "model1"]
        # Megatron's interleaved numbering: chunk v of stage p holds layer v * PP + p (one layer per chunk here).
        for chunk in (0, 1):
            norm = payload[f"model{chunk}"]["decoder.layers.0.input_layernorm.weight"]
            assert torch.equal(norm, hf[f"model.layers.{chunk * 2 + stage}.input_layernorm.weight"])
        assert ("embedding.word_embeddings.weight" in payload["model0"]) == (stage == 0)
        assert ("output_layer.weight" in payload["model1"]) == (stage == 1)
    back = tmp_path / "back"
    assert cli.run(parser.parse_args(["convert", "--to", "hf", "--src", str(mg), "--dst", str(back)])) == 0
    converted = load_hf_state(back)
    assert converted.keys() == hf.keys() and all(torch.equal(converted[k], hf[k]) for k in hf)


@pytest.mark.parametrize("pp,vpp,message", [
    (1, 2, "--vpp: 2 chunks need --pp >= 2"),
    (2, 3, "virtual_pipeline_model_parallel_size: 3 chunks on each of 2 stages do not divide num_hidden_layers 2"),
])
def test_cli_convert_refuses_a_virtual_pipeline_the_trainer_cannot_run(hf_dir, tmp_path, capsys, pp, vpp, message):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["convert", "--to", "megatron", "--src", str(hf_dir), "--dst", str(tmp_path / "mg"), "--pp", str(pp), "--vpp", str(vpp)]
    assert cli.run(parser.parse_args(argv)) == 2
    assert message in capsys.readouterr().err

def test_cli_convert_reports_a_missing_source(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["convert", "--to", "hf", "--src", str(tmp_path / "nope"), "--dst", str(tmp_path / "o")])) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures: 'GPT2LMHeadModel' is not one of"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn"}}, "rope_type: 'yarn' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu'"),
])
def test_layouts_this_model_cannot_build_are_refused(hf_dir, tmp_path, change, message):
    import json

    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        ModelLayout.from_hf_dir(tmp_path)
