"""Expert parallel on CPU (gloo all-to-all): two ranks holding two experts each train a tiny Qwen2-MoE model as one rank
holding all four does: the same loss, load-balancing loss, gradients and weights after the step.

Each run is tests/unit/expert_parallel_worker.py under torchrun.
"""
import pathlib

import pytest
import torch
from trainer_helpers import tiny_hf_model, torchrun_ranks

from services.trainer.modeling.checkpoint_convert import load_hf_state

WORKER = pathlib.Path(__file__).with_name("expert_parallel_worker.py")


def run_ranks(hf_dir, out: pathlib.Path, ranks: int, ep: int) -> list[dict]:
    return torchrun_ranks(WORKER, ranks, hf_dir, out, ep)


def test_two_expert_parallel_ranks_train_as_one(tmp_path):
    hf_dir = tiny_hf_model(tmp_path / "hf", architecture="qwen2_moe")
    (single,) = run_ranks(hf_dir, tmp_path / "ep1", 1, 1)
    pair = run_ranks(hf_dir, tmp_path / "ep2", 2, 2)
    assert single["local_experts"] == 4 and [r["local_experts"] for r in pair] == [2, 2]
    assert single["metrics"]["moe_aux_loss"] > 0  # the routers' load-balancing loss entered this update
    original = load_hf_state(hf_dir)
    assert max((single["weights"][k] - w).abs().max().item() for k, w in original.items()) > 1e-4  # the step moved the weights
    assert max(g.abs().max().item() for k, g in single["grads"].items() if ".experts." in k) > 1e-3  # expert gradients are not ~0
    for rank in pair:
        for name in ("loss", "pg_loss", "entropy", "grad_norm", "moe_aux_loss"):
            assert rank["metrics"][name] == pytest.approx(single["metrics"][name], abs=1e-6), name
        assert rank["grads"].keys() == single["grads"].keys() == original.keys()
        for name, grad in single["grads"].items():
            assert torch.allclose(rank["grads"][name], grad, atol=1e-6, rtol=0), name
        for name, weight in single["weights"].items():
            # Adam's step is ~lr * sign(g) whatever g's size: where g is rounding noise (k_proj.bias: a bias every key
            # shares leaves the softmax unchanged), two sums of the same terms may step apart: compare where g is not.
            moved = single["grads"][name].abs() > 1e-5
            assert torch.allclose(rank["weights"][name][moved], weight[moved], atol=1e-5, rtol=0), name
