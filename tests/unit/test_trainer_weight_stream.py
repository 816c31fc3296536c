"""The weight gather streams bucket by bucket (issue 25): at TP 2, PP 2 and EP 2 (gloo, under torchrun) every rank's
buckets, concatenated, are the HF checkpoint the model was loaded from, bit for bit, in the push's bucket plan;
and the most tensor memory a rank holds at once while they stream is about one bucket, where gathering the
whole model first holds all of it.

Each run is tests/unit/weight_stream_worker.py.
"""
import pathlib

import pytest
import torch
from trainer_helpers import gather_hf_weights, megatron_tp1, tiny_hf_model, torchrun_ranks

from services.common.weight_wire import MIB
from services.trainer.modeling.checkpoint_convert import load_hf_state

WORKER = pathlib.Path(__file__).with_name("weight_stream_worker.py")
# The tiny models are 1.8 (dense) and 2.4 MiB (MoE): about four buckets; the largest megatron tensor's HF tensors
# (a fused gate/up) are 0.375 MiB, so one bucket plus the one being converted stays under two buckets.
BUCKET_MB = 0.5


@pytest.mark.parametrize("architecture, ranks, tp, pp, ep", [
    ("qwen2", 1, 1, 1, 1), ("qwen2", 2, 2, 1, 1), ("qwen2", 2, 1, 2, 1), ("qwen2_moe", 2, 1, 1, 2)],
    ids=["tp1", "tp2", "pp2", "moe-ep2"])
def test_streamed_buckets_are_the_checkpoint_and_hold_about_one_bucket(tmp_path, architecture, ranks, tp, pp, ep):
    hf_dir = tiny_hf_model(tmp_path / "hf", architecture=architecture)
    checkpoint = load_hf_state(hf_dir)
    model_bytes = sum(t.numel() * t.element_size() for t in checkpoint.values())
    limit = int(BUCKET_MB * MIB)
    for rank in torchrun_ranks(WORKER, ranks, hf_dir, tmp_path / "out", tp, pp, ep, BUCKET_MB):
        assert rank["bucket_names"] == rank["plan"] and len(rank["plan"]) >= 4
        streamed = rank["streamed"]
        assert streamed.keys() == checkpoint.keys()
        for name, tensor in checkpoint.items():
            assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name
        # Gathering first holds the whole model: the bound below fails it.
        assert rank["peak_whole"] > 0.95 * model_bytes > 2 * limit
        assert 0 < rank["peak_stream"] < 2 * limit, rank["peak_stream"]


def test_the_whole_gather_is_a_copy_that_a_later_step_does_not_move(tmp_path):
    """Tests and checks keep gather_hf_weights' dict across updates: at TP 1 the tensors it passes through unconverted
    (norms, biases) must not be the model's own, or the next optimizer step would change the kept copy too."""
    model, layout = megatron_tp1(tiny_hf_model(tmp_path / "hf"))
    kept = gather_hf_weights(model, layout)
    before = {name: t.clone() for name, t in kept.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what an optimizer step does to every parameter, in place
    assert all(torch.equal(kept[name], before[name]) for name in kept)


def test_a_later_push_keeps_the_plan_and_streams_the_current_weights(tmp_path):
    """The session plans the push once (HfWeightStream.over): a later stream has the same buckets and carries the
    weights as they are now, even a parameter whose storage was replaced; another model's tensors are refused."""
    from services.trainer.weights.gather import model_state, stream_hf_weights

    model, layout = megatron_tp1(tiny_hf_model(tmp_path / "hf"))
    first = stream_hf_weights(model, layout, BUCKET_MB)
    assert len(first.plan) >= 4 and all(len(bucket) for bucket in first)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % 2:
                p.add_(1.0)  # an optimizer step, in place
            else:
                p.data = p.data + 1.0  # a new storage: a stream still holding the old tensors would send stale weights
    later = first.over(model_state(model))
    assert later.plan == first.plan
    streamed = {name: t for bucket in later for name, t in bucket.items()}
    expected = gather_hf_weights(model, layout)
    assert streamed.keys() == expected.keys() and all(torch.equal(streamed[k], expected[k]) for k in expected)
    other, _ = megatron_tp1(tiny_hf_model(tmp_path / "hf4", num_layers=4))
    with pytest.raises(ValueError, match="changed names or shapes"):
        first.over(model_state(other))
