"""Data parallel on megatron-core's DDP and distributed optimizer: two ranks split the work and train as one does
(also with two pipeline stages each).

Each case runs tests/unit/data_parallel_worker.py under torchrun (gloo) on one and on two processes with the same
batch and compares what a user would: the update's losses and grad norms, the weights after it, the log-probs
handed back, the critic's values and step, how many samples each rank's forward passes saw, how much Adam state
each rank holds, and a checkpoint resumed on the same and on another number of ranks.
"""
import pathlib

import pytest
import torch
from trainer_helpers import tiny_hf_model, torchrun_ranks

from services.trainer.modeling.checkpoint_convert import load_hf_state

WORKER = pathlib.Path(__file__).with_name("data_parallel_worker.py")
METRICS = ("loss", "pg_loss", "entropy", "kl", "ppo_kl", "pg_clipfrac", "grad_norm")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"))


def run_ranks(hf_dir, out: pathlib.Path, ranks: int, distributed: bool, resume_from: pathlib.Path | None = None,
              pp: int = 1) -> list[dict]:
    return torchrun_ranks(WORKER, ranks, hf_dir, out, "1" if distributed else "0", pp, *([resume_from] if resume_from else []))


def assert_same_training(one: dict, other: dict, updates=("first", "second")) -> None:
    for update in updates:
        for name in METRICS:
            assert other[update][name] == pytest.approx(one[update][name], abs=1e-5), (update, name)
    for name, weight in one["weights"].items():
        assert torch.allclose(other["weights"][name], weight, atol=1e-4, rtol=0), name


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed-optimizer", "replicated-optimizer"])
def test_two_data_parallel_ranks_split_the_batch_and_train_as_one(hf_dir, tmp_path, distributed):
    (single,) = run_ranks(hf_dir, tmp_path / "dp1", 1, distributed)
    pair = run_ranks(hf_dir, tmp_path / "dp2", 2, distributed)
    moved = max((single["weights"][k] - w).abs().max().item() for k, w in load_hf_state(hf_dir).items())
    assert moved > 1e-3  # the compared updates moved the weights
    for rank in pair:
        assert_same_training(single, rank)
        assert torch.allclose(rank["start_logprobs"], single["start_logprobs"], atol=1e-5)
        for name in ("vf_loss", "grad_norm", "values_mean"):
            assert rank["critic"][name] == pytest.approx(single["critic"][name], abs=1e-5), name
        assert torch.allclose(rank["values"], single["values"], atol=1e-5)
        assert torch.allclose(rank["values_after"], single["values_after"], atol=1e-5)
        # Each rank ran its half of every pass: the reference, old-policy and update forwards and the critic's.
        assert rank["samples_forwarded"] == single["samples_forwarded"] // 2
    state = [r["adam_state_numel"] for r in pair]
    if distributed:  # each rank holds its half of the Adam moments (a bucket's padding at most beyond it)
        assert sum(state) >= single["adam_state_numel"] and max(state) <= 0.51 * single["adam_state_numel"]
    else:
        assert state == [single["adam_state_numel"]] * 2


def test_data_parallel_2_by_pipeline_parallel_2_trains_as_one_rank(hf_dir, tmp_path):
    (single,) = run_ranks(hf_dir, tmp_path / "dp1", 1, True)
    for rank in run_ranks(hf_dir, tmp_path / "dp2xpp2", 4, True, pp=2):  # 1F1B within each replica, DDP across them
        assert_same_training(single, rank)
        assert rank["critic"]["vf_loss"] == pytest.approx(single["critic"]["vf_loss"], abs=1e-5)
        assert torch.allclose(rank["values_after"], single["values_after"], atol=1e-5)
        assert rank["samples_forwarded"] == single["samples_forwarded"] // 2  # each stage of a replica sees its half


def test_a_distributed_optimizer_checkpoint_resumes_on_the_same_and_another_number_of_ranks(hf_dir, tmp_path):
    (single,) = run_ranks(hf_dir, tmp_path / "dp1", 1, True)
    pair = run_ranks(hf_dir, tmp_path / "dp2", 2, True)
    assert (tmp_path / "dp2" / "ckpt" / "iter_0000001" / "mp_rank_00" / "distrib_optim.pt").exists()
    for rank in run_ranks(hf_dir, tmp_path / "dp2-resumed", 2, True, resume_from=tmp_path / "dp2" / "ckpt"):
        assert_same_training(pair[0], rank, updates=("second",))
    (resumed,) = run_ranks(hf_dir, tmp_path / "dp1-resumed-from-dp2", 1, True, resume_from=tmp_path / "dp2" / "ckpt")
    assert_same_training(single, resumed, updates=("second",))
