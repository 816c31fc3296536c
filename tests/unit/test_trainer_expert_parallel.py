"""Expert parallel on CPU (gloo all-to-all): two ranks holding two experts each train a tiny Qwen2-MoE model as one rank
holding all four does: the same loss, load-balancing loss, gradients and weights after the step; so do four ranks at
expert parallel 2 x context parallel 2, routing replay included, and two pipeline stages. A checkpoint saved on
two expert-parallel ranks (one shard per EP rank, as Megatron names them) resumes to the uninterrupted run's next step
and converts to one Hugging Face model with every expert.

Each run is tests/unit/expert_parallel_worker.py under torchrun.
"""
import pathlib

import pytest
import torch
from trainer_helpers import tiny_hf_model, torchrun_ranks

from services.trainer.modeling.checkpoint_convert import convert_megatron_to_hf, load_hf_state

WORKER = pathlib.Path(__file__).with_name("expert_parallel_worker.py")


def run_ranks(hf_dir, out: pathlib.Path, ranks: int, ep: int, *mode) -> list[dict]:
    return torchrun_ranks(WORKER, ranks, hf_dir, out, ep, *mode)


@pytest.fixture(scope="module")
def single_rank_update(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """The tiny MoE model's directory and the update of one rank holding every expert."""
    tmp = tmp_path_factory.mktemp("moe")
    hf_dir = tiny_hf_model(tmp / "hf", architecture="qwen2_moe")
    (single,) = run_ranks(hf_dir, tmp / "ep1", 1, 1)
    return hf_dir, single


def test_two_expert_parallel_ranks_train_as_one(single_rank_update, tmp_path):
    hf_dir, single = single_rank_update
    pair = run_ranks(hf_dir, tmp_path / "ep2", 2, 2)
    assert single["local_experts"] == 4 and [r["local_experts"] for r in pair] == [2, 2]
    assert single["metrics"]["moe_aux_loss"] > 0  # the routers' load-balancing loss entered this update
    original = load_hf_state(hf_dir)
    assert max((single["weights"][k] - w).abs().max().item() for k, w in original.items()) > 1e-4  # the step moved the weights
    assert max(g.abs().max().item() for k, g in single["grads"].items() if ".experts." in k) > 1e-3  # expert gradients are not ~0
    for rank in pair:
        for name in ("loss", "pg_loss", "entropy", "grad_norm", "moe_aux_loss"):
            assert rank["metrics"][name] == pytest.approx(single["metrics"][name], abs=1e-6), name
        for name in ("natural", "padded", "packed"):
            assert torch.allclose(rank["replayed_logprobs"][name], single["replayed_logprobs"][name], atol=1e-6, rtol=0), name
        assert rank["grads"].keys() == single["grads"].keys() == original.keys()
        for name, grad in single["grads"].items():
            assert torch.allclose(rank["grads"][name], grad, atol=1e-6, rtol=0), name
        for name, weight in single["weights"].items():
            # Adam's step is ~lr * sign(g) whatever g's size: where g is rounding noise (k_proj.bias: a bias every key
            # shares leaves the softmax unchanged), two sums of the same terms may step apart: compare where g is not.
            moved = single["grads"][name].abs() > 1e-5
            assert torch.allclose(rank["weights"][name][moved], weight[moved], atol=1e-5, rtol=0), name


def test_expert_parallel_with_context_parallel_trains_as_one_rank(single_rank_update, tmp_path):
    """EP 2 x CP 2 (ring attention) on 4 ranks: the same step, the load-balancing loss included. Each CP rank's router
    scores half of every sequence, so its tracked load-balancing loss is a part that megatron sums over TP x CP."""
    hf_dir, single = single_rank_update
    ranks = run_ranks(hf_dir, tmp_path / "ep2cp2", 4, 2, "cp2")
    assert [r["local_experts"] for r in ranks] == [2, 2, 2, 2]
    replayed = single["replayed_logprobs"]
    assert not torch.allclose(replayed["padded"], replayed["natural"])  # the replayed experts are not the routers' own
    for rank in ranks:
        for name in ("loss", "pg_loss", "entropy", "grad_norm", "moe_aux_loss"):
            assert rank["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-5, abs=1e-6), name
        for name in ("natural", "padded", "packed"):  # routing replay: each CP rank's share replays its own tokens' experts
            assert torch.allclose(rank["replayed_logprobs"][name], replayed[name], atol=1e-5, rtol=0), name
        for name, weight in single["weights"].items():
            moved = single["grads"][name].abs() > 1e-5  # as above: where the gradient is not rounding noise
            assert torch.allclose(rank["weights"][name][moved], weight[moved], atol=1e-5, rtol=0), name


def test_pipeline_parallel_with_experts_trains_as_one_rank(single_rank_update, tmp_path):
    """PP 2 (megatron's 1F1B) of the MoE model: the schedule runs micro-batch i's backward after later micro-batches'
    forwards and sets its own uniform factor on the load-balancing gradient after each; the update still gives it i's
    weight. Replayed routing reaches each stage's layers by their number in the whole model."""
    hf_dir, single = single_rank_update
    stages = run_ranks(hf_dir, tmp_path / "pp2", 2, 1, "pp2")
    for rank in stages:
        for name in ("loss", "pg_loss", "entropy", "grad_norm", "moe_aux_loss"):
            assert rank["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-5, abs=1e-6), name
        for name in ("natural", "padded", "packed"):
            assert torch.allclose(rank["replayed_logprobs"][name], single["replayed_logprobs"][name], atol=1e-5, rtol=0), name
        for name, grad in single["grads"].items():
            assert torch.allclose(rank["grads"][name], grad, atol=1e-6, rtol=1e-5), name


def test_an_expert_parallel_checkpoint_resumes_and_converts_with_every_expert(tmp_path):
    hf_dir = tiny_hf_model(tmp_path / "hf", architecture="qwen2_moe")
    pair = run_ranks(hf_dir, tmp_path / "run", 2, 2, "checkpoint")
    iteration = tmp_path / "run" / "ckpt" / "iter_0000001"
    # One shard per expert-parallel rank, each with its experts' share of the distributed optimizer's state.
    assert sorted(p.name for p in iteration.glob("mp_rank_*")) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert all((iteration / shard / "distrib_optim.pt").exists() for shard in ("mp_rank_00_000", "mp_rank_00_001"))
    resumed = run_ranks(hf_dir, tmp_path / "resumed", 2, 2, "checkpoint", tmp_path / "run" / "ckpt")
    for uninterrupted, rank in zip(pair, resumed):
        assert rank["second"]["loss"] == pytest.approx(uninterrupted["second"]["loss"], abs=1e-6)
        for name, weight in uninterrupted["weights"].items():
            assert torch.equal(rank["weights"][name], weight), name  # same state, same arithmetic: bit for bit
    exported = load_hf_state(convert_megatron_to_hf(iteration, tmp_path / "hf-export"))
    first = pair[0]["first_weights"]
    assert exported.keys() == first.keys() and sum(".experts." in k for k in exported) > 0
    for name, weight in first.items():
        assert torch.equal(exported[name], weight), name
    with pytest.raises(Exception, match="expert parallel sizes"):  # resumed on one rank: the EP shards are not there
        run_ranks(hf_dir, tmp_path / "one-rank", 1, 1, "checkpoint", tmp_path / "run" / "ckpt")
