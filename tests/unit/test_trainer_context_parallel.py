"""Context parallel in the trainer: Ulysses and ring attention over two CP ranks (and TP 2 x CP 2), and the hybrid of the
two over four (Ulysses pairs, a ring of two, the PPO critic too), give what one rank gives.

Each case runs tests/unit/context_parallel_worker.py under torchrun (gloo) and compares what a user would check
against one rank on the same batch: the log-probs and entropy handed back (padded and packed), the loss, the
gradients once DDP has summed the CP ranks' parts, the metrics of an update with dynamic batch size, and the weights
after it. A split that gave a token the wrong RoPE position, or an exchange that mixed heads or positions, would
move the log-probs far past these fp32 tolerances.
"""
import pathlib

import pytest
import torch
from trainer_helpers import tiny_hf_model, torchrun_ranks

from services.trainer.modeling.context_parallel import chunk_index, layout_index, padded_length
from services.trainer.modeling.model import ModelLayout, init_parallel

WORKER = pathlib.Path(__file__).with_name("context_parallel_worker.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


def run_ranks(hf_dir, out: pathlib.Path, tp: int, cp: int, algo: str, dp: int = 1, pp: int = 1, ulysses: int = 1,
              critic: bool = False) -> list[dict]:
    return torchrun_ranks(WORKER, tp * cp * dp * pp, hf_dir, out, tp, cp, algo, pp, ulysses, int(critic))


@pytest.fixture(scope="module")
def single(hf_dir, tmp_path_factory):
    # The critic's one-rank figures come from this launch too, for the hybrid case to compare with.
    (rank,) = run_ranks(hf_dir, tmp_path_factory.mktemp("cp1"), 1, 1, "megatron_cp_algo", critic=True)
    return rank


def assert_same_as_one_rank(single: dict, rank: dict, grads: bool = True) -> None:
    for layout in ("padded", "packed"):
        one, other = single[layout], rank[layout]
        assert torch.allclose(other["logp"], one["logp"], atol=1e-5), layout
        assert torch.allclose(other["entropy"], one["entropy"], atol=1e-5), layout
        # A mean of log-probs each within 1e-5: the ring's other summation order moved it by 1.4e-6 (3 float32 steps at
        # 6.4) on one machine, within 1e-6 on another.
        assert other["loss"] == pytest.approx(one["loss"], abs=1e-5), layout
        if grads:
            for name, grad in one["grads"].items():
                assert torch.allclose(other["grads"][name], grad, atol=1e-5), (layout, name)
    for name in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert rank["update"][name] == pytest.approx(single["update"][name], abs=1e-5), name
    for name, weight in single["weights"].items():
        assert torch.allclose(rank["weights"][name], weight, atol=1e-4, rtol=0), name


@pytest.mark.parametrize("algo", ["ulysses_cp_algo", "megatron_cp_algo"])
def test_two_context_parallel_ranks_give_the_log_probs_loss_and_gradients_of_one(hf_dir, tmp_path, single, algo):
    pair = run_ranks(hf_dir, tmp_path / algo, 1, 2, algo)
    for rank in pair:
        assert_same_as_one_rank(single, rank)
        # Each rank ran the model on half of every (padded) row, and on the positions megatron-core's split gives it.
        padded = rank["padded"]
        assert padded["local_tokens"].size(1) * 2 == padded_length(single["padded"]["local_tokens"].size(1), 2)
        assert torch.equal(padded["local_tokens"], padded["megatron_tokens"])
    assert not torch.equal(pair[0]["padded"]["local_tokens"], pair[1]["padded"]["local_tokens"])


def test_hybrid_context_parallel_4_as_ulysses_2_by_ring_2_trains_as_one_rank(hf_dir, tmp_path, single):
    # CP ranks 0, 1 and 2, 3 exchange heads (4 heads -> 2 each; the 2 KV heads split too), then 0, 2 and 1, 3 run the ring
    # on their pair's positions: chunks 0-1 + 6-7 and 2-3 + 4-5 of 8, the ring's layout for two ranks.
    ranks = run_ranks(hf_dir, tmp_path / "hybrid", 1, 4, "hybrid_cp_algo", ulysses=2, critic=True)
    assert sorted(rank["key"] for rank in ranks) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]
    one = single["critic"]
    for rank in ranks:
        assert_same_as_one_rank(single, rank)
        padded = rank["padded"]  # a quarter of every row, padded to a multiple of 8, megatron's positions
        assert padded["local_tokens"].size(1) * 4 == padded_length(single["padded"]["local_tokens"].size(1), 4)
        assert torch.equal(padded["local_tokens"], padded["megatron_tokens"])
        # The PPO critic under the same groups: one rank's values, and its step (test_trainer_critic's CP 2 checks).
        critic = rank["critic"]
        assert torch.allclose(critic["values"], one["values"], atol=1e-5)
        assert torch.allclose(critic["values_after"], one["values_after"], atol=1e-5)
        for name in ("vf_loss", "vf_clipfrac", "values_mean", "grad_norm"):
            assert critic["metrics"][name] == pytest.approx(one["metrics"][name], abs=1e-5), name
    assert (one["values_after"] - one["values"]).abs().max() > 1e-3  # the compared step moved the values


def test_context_parallel_2_with_tensor_parallel_2_trains_as_one_rank(hf_dir, tmp_path, single):
    # 4 heads / TP 2 = 2 per rank, split over CP 2; the 2 KV heads (1 per TP rank) are too few and get expanded.
    ranks = run_ranks(hf_dir, tmp_path / "tp2cp2", 2, 2, "ulysses_cp_algo")
    assert sorted(rank["key"] for rank in ranks) == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    for rank in ranks:  # gradients are TP shards here: the update's grad norm and weights compare them
        assert_same_as_one_rank(single, rank, grads=False)


def test_context_parallel_2_with_data_parallel_2_trains_as_one_rank(hf_dir, tmp_path, single):
    # Each data-parallel replica is a CP pair on half the samples; DDP reduces the gradients over all four ranks.
    ranks = run_ranks(hf_dir, tmp_path / "dp2cp2", 1, 2, "megatron_cp_algo", dp=2)
    assert sorted(rank["key"] for rank in ranks) == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    for rank in ranks:  # a rank's gradients are its replica's half of the batch: the update compares the whole
        assert_same_as_one_rank(single, rank, grads=False)



def test_context_parallel_2_with_pipeline_parallel_2_trains_as_one_rank(hf_dir, tmp_path, single):
    # The 1F1B schedule passes each CP rank's share of the activations between the stages: [S / CP, b, h].
    ranks = run_ranks(hf_dir, tmp_path / "pp2cp2", 1, 2, "megatron_cp_algo", pp=2)
    for rank in ranks:  # a rank's gradients are its stage's: the update's grad norm and weights compare the whole
        assert_same_as_one_rank(single, rank, grads=False)

def test_the_split_balances_causal_work_and_covers_every_position_once():
    # CP 2 of a 12-token sequence: chunks of 3, rank 0 holds the first and last, rank 1 the middle two.
    assert chunk_index(12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert chunk_index(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    index = layout_index([8, 4], 2)  # two packed sequences, each split on its own
    assert index.tolist() == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]
    assert sorted(index.reshape(-1).tolist()) == list(range(12))
    assert [padded_length(n, 2) for n in (1, 4, 5)] == [4, 4, 8] and padded_length(5, 1) == 5


def test_ulysses_refuses_a_head_count_the_context_parallel_size_does_not_divide(hf_dir):
    layout = ModelLayout.from_hf_dir(hf_dir)  # 4 attention heads
    with pytest.raises(ValueError, match=r"megatron_training.context_parallel_size: 4 does not divide the 2 attention heads"):
        layout.check_parallel(tp=2, pp=1, cp=4, cp_algo="ulysses_cp_algo")
    layout.check_parallel(tp=2, pp=1, cp=4, cp_algo="megatron_cp_algo")  # the ring splits positions, not heads


def test_a_ulysses_group_of_the_cp_split_holds_one_ring_rank_of_the_coarser_split():
    # CP 4 = U 2 x R 2: CP ranks 0, 1 together hold what ring rank 0 of 2 holds, ranks 2, 3 what ring rank 1 holds, so
    # hybrid_cp_algo's ring runs on the positions its Ulysses exchange gathers, with no other layout.
    index = layout_index([16, 8], 4)
    coarse = layout_index([16, 8], 2)
    for group in range(2):
        assert index[2 * group:2 * group + 2].reshape(-1).sort().values.tolist() == coarse[group].tolist()


def test_hybrid_refuses_a_head_count_its_ulysses_degree_does_not_divide(hf_dir):
    layout = ModelLayout.from_hf_dir(hf_dir)  # 4 attention heads, 2 per TP rank at TP 2
    with pytest.raises(ValueError, match=r"megatron_training.ulysses_degree_in_cp: 4 does not divide the 2 attention heads"):
        layout.check_parallel(tp=2, pp=1, cp=8, cp_algo="hybrid_cp_algo", ulysses=4)
    layout.check_parallel(tp=2, pp=1, cp=8, cp_algo="hybrid_cp_algo", ulysses=2)  # the ring takes the rest of CP
    for cp, ulysses in ((4, 3), (4, 4)):  # before any process group is made
        with pytest.raises(ValueError, match=rf"megatron_training.ulysses_degree_in_cp: {ulysses} must divide context_parallel_size"):
            init_parallel(cp=cp, ulysses=ulysses)


@pytest.mark.parametrize("causal", [True, False], ids=["own-block", "other-rank-block"])
def test_ring_blocks_off_the_cpu_give_what_the_cpu_flash_kernel_gives(causal):
    # The ring's explicit-score block (devices other than the CPU) against torch's CPU flash kernel, forward and backward.
    from services.trainer.modeling.context_parallel import _block_backward, _block_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(4))
    k, v = (t if causal else t[:, :, :3] for t in (k, v))
    fused = _block_forward(q, k, v, causal, 0.3, fused=True)
    explicit = _block_forward(q, k, v, causal, 0.3, fused=False)
    for a, b in zip(fused, explicit):
        assert torch.allclose(a, b, atol=1e-5)
    out, lse = fused
    for a, b in zip(_block_backward(dout, q, k, v, out, lse, causal, 0.3, fused=True),
                    _block_backward(dout, q, k, v, out, lse, causal, 0.3, fused=False)):
        assert torch.allclose(a, b, atol=1e-5)
