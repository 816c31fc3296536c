"""EPLB planning with vLLM's own policy (services/rollout/eplb.py) and the `dockrl eplb` command: a skewed expert
load gets a placement that lowers max / mean tokens per device, written as vllm-ascend's expert map file."""
import json
import re

import pytest

from services.cli import main
from services.rollout.eplb import (
    ExpertMapError, check_map_against_checkpoint, checkpoint_moe_shape, contiguous_placement, device_loads, imbalance,
    layer_imbalance, load_report, plan_placement, read_expert_map, spread_copies, write_expert_map,
)

# 3 MoE layers x 8 experts, Zipf-like: one or two hot experts per layer, in a different place in each layer.
SKEWED = [
    [4000, 900, 300, 150, 100, 80, 60, 50],
    [60, 80, 100, 150, 300, 900, 4000, 50],
    [500, 500, 2500, 20, 20, 2500, 10, 10],
]


def test_the_policys_map_lowers_the_imbalance_of_a_skewed_load(tmp_path):
    placement = plan_placement(SKEWED, num_devices=4, num_redundant=4)
    before = imbalance(SKEWED, contiguous_placement(3, 8, 4))
    after = imbalance(SKEWED, placement)
    assert before > 2.5  # the hot experts' devices carry most of the tokens
    assert after < 1.5 and after < before / 2
    for layer, devices in zip(SKEWED, placement):
        assert [len(d) for d in devices] == [3, 3, 3, 3]  # (8 + 4) slots over 4 devices
        assert all(len(set(d)) == len(d) for d in devices)  # no expert twice on a device
        assert set().union(*devices) == set(range(8))
        # copies share their expert's tokens: no token is lost or counted twice
        assert sum(device_loads(layer, devices)) == pytest.approx(sum(layer))
    hot = [devices for devices in placement[0] if 0 in devices]
    assert sum(d.count(0) for d in hot) > 1  # the hottest expert got copies
    # vllm-ascend's layout, read back exactly
    path = write_expert_map(tmp_path / "map.json", placement)
    doc = json.loads(path.read_text())
    assert doc["moe_layer_count"] == 3 and doc["layer_list"][1]["device_count"] == 4
    assert doc["layer_list"][1]["device_list"][2] == {"device_id": 2, "device_expert": placement[1][2]}
    assert read_expert_map(path, 3, 8) == placement
    report = load_report(SKEWED, placement)
    assert report["imbalance_contiguous"] == pytest.approx(before) and report["imbalance_with_map"] == pytest.approx(after)


def test_a_second_copy_on_a_device_is_swapped_to_a_device_without_one():
    # vLLM's policy for a real replica's counts (tests/service/test_rollout_expert_load.py), 2 devices x 3 slots
    counts = [8, 33, 17, 36]
    devices = [[3, 2, 0], [3, 1, 1]]
    spread = spread_copies(devices, counts)
    assert spread == [[3, 1, 0], [3, 1, 2]]  # every expert keeps its copies
    assert devices[1] == [3, 1, 1]  # the input is left as it was
    assert layer_imbalance(counts, spread) == pytest.approx(51.5 / 47)
    assert layer_imbalance(counts, spread) < layer_imbalance(counts, contiguous_placement(1, 4, 2)[0])


def test_copies_beyond_the_device_count_go_to_the_busiest_expert_a_device_lacks():
    # as vLLM's policy placed SKEWED's first layer: expert 0 five times on 4 devices
    counts = SKEWED[0]
    spread = spread_copies([[0, 0, 5], [4, 4, 6], [0, 3, 7], [0, 2, 1]], counts)
    assert all(len(set(d)) == len(d) == 3 for d in spread) and set().union(*spread) == set(range(8))
    assert sum(d.count(0) for d in spread) == 4  # one copy per device, the fifth became another expert's
    with pytest.raises(ValueError, match="3 slots per device cannot hold distinct experts of 2"):
        spread_copies([[0, 1, 0], [1, 0, 1]], [5, 5])


def test_an_even_load_is_balanced_without_a_map():
    assert imbalance([[10] * 8], contiguous_placement(1, 8, 4)) == 1.0
    assert contiguous_placement(1, 5, 2) == [[[0, 1], [2, 3, 4]]]


def test_slots_that_do_not_split_over_the_devices_are_refused():
    with pytest.raises(ValueError, match="9 slots cannot be split evenly over 4 devices"):
        plan_placement(SKEWED, num_devices=4, num_redundant=1)


@pytest.mark.parametrize("doc,message", [
    ("not json", "not an expert map file"),
    ({"layer_list": []}, "not an expert map file"),
    ({"moe_layer_count": 1, "layer_list": [{"device_list": [{"device_expert": [0, 1]}]}]}, "the model has 2 MoE layers"),
    ({"moe_layer_count": 2, "layer_list": [{"device_list": [{"device_expert": [0, 1]}, {"device_expert": [2]}]}] * 2},
     r"places no copy of experts \[3\]"),
    ({"moe_layer_count": 2, "layer_list": [{"device_list": [{"device_expert": [0, 1]}, {"device_expert": [2, 7]}]}] * 2},
     r"distinct expert ids in \[0, 4\)"),
    ({"moe_layer_count": 2, "layer_list": [{"device_list": [{"device_expert": [0, 1, 2]}, {"device_expert": [3, 3, 0]}]}] * 2},
     r"device 1 holds \[3, 3, 0\]: distinct"),
])
def test_a_bad_map_file_is_refused_saying_why(tmp_path, doc, message):
    path = tmp_path / "map.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ExpertMapError, match=message):
        read_expert_map(path, num_layers=2, num_experts=4)


def test_dockrl_eplb_sums_replicas_counts_and_writes_a_map_that_loads(tmp_path, capsys):
    # two replicas' /v1/expert_load answers, saved as files; their sum is SKEWED
    first, second = tmp_path / "r0.json", tmp_path / "r1.json"
    first.write_text(json.dumps({"counts": [[c // 2 for c in layer] for layer in SKEWED]}))
    second.write_text(json.dumps({"counts": [[c - c // 2 for c in layer] for layer in SKEWED]}))
    out = tmp_path / "expert_map.json"
    assert main(["eplb", "--counts", str(first), "--counts", str(second), "--devices", "4", "--redundant-experts", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    before, after = map(float, re.search(r"contiguous ([0-9.]+), with the map ([0-9.]+)", printed).groups())
    assert before == pytest.approx(imbalance(SKEWED, contiguous_placement(3, 8, 4)), abs=1e-3)
    assert read_expert_map(out, 3, 8) == plan_placement(SKEWED, 4, 4)
    assert after == pytest.approx(imbalance(SKEWED, read_expert_map(out, 3, 8)), abs=1e-3) and after < before
    assert main(["eplb", "--counts", str(first), "--devices", "4", "--redundant-experts", "1", "--out", str(out)]) == 2
    assert "cannot be split evenly" in capsys.readouterr().err


def test_dockrl_eplb_plans_more_devices_than_experts_with_copies(tmp_path, capsys):
    """8 experts on 16 devices: no placement without copies exists, yet the plan with 8 redundant slots is valid."""
    counts = tmp_path / "load.json"
    counts.write_text(json.dumps({"counts": SKEWED}))
    out = tmp_path / "expert_map.json"
    assert main(["eplb", "--counts", str(counts), "--devices", "16", "--redundant-experts", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "contiguous: none (8 experts on 16 devices need copies)" in printed
    after = float(re.search(r"with the map ([0-9.]+)", printed).group(1))
    assert after == pytest.approx(imbalance(SKEWED, read_expert_map(out, 3, 8)), abs=1e-3)


def test_a_map_is_checked_against_the_checkpoint_before_the_engine_starts(tmp_path):
    """config.json says how many MoE layers and experts a Qwen MoE checkpoint has: a map of another shape, or a map
    for a dense model, is refused without starting vLLM (the replica then exits 2 in a second)."""
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for path, config in ((moe, {"num_hidden_layers": 4, "num_experts": 8, "decoder_sparse_step": 1, "mlp_only_layers": [0]}),
                         (dense, {"num_hidden_layers": 4})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    assert checkpoint_moe_shape(moe) == (3, 8) and checkpoint_moe_shape(dense) == (0, 0)
    assert checkpoint_moe_shape(tmp_path / "not-local") is None  # a hub name: the replica's own check decides
    good = write_expert_map(tmp_path / "map.json", plan_placement(SKEWED, 4, 4))  # 3 layers x 8 experts
    check_map_against_checkpoint(good, moe)
    with pytest.raises(ExpertMapError, match="has no MoE layers"):
        check_map_against_checkpoint(good, dense)
    (moe / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts": 8}))
    with pytest.raises(ExpertMapError, match="the model has 2 MoE layers"):
        check_map_against_checkpoint(good, moe)
