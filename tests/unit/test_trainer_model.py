"""The megatron GPTModel against transformers' Qwen2ForCausalLM, and TP=2 / PP=2 (megatron's 1F1B schedule) / TP=2 x PP=2
against one rank."""
import os
import socket
import pathlib
import subprocess
import sys

import pytest
import torch
from trainer_helpers import assert_logits_match, megatron_tp1, random_batch, response_nll, tiny_hf_model
from trainer_parallel_worker import PARITY_BATCH, parity_update

from services.trainer.modeling.checkpoint_convert import load_hf_state, megatron_to_hf
from services.trainer.modeling.logprobs import forward_micro_batch

WORKER = pathlib.Path(__file__).with_name("trainer_parallel_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf"), tie_word_embeddings=False)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tied, untied_dir, tmp_path):
    from transformers import Qwen2ForCausalLM

    hf_dir = tiny_hf_model(tmp_path, tie_word_embeddings=True) if tied else untied_dir
    model, _ = megatron_tp1(hf_dir)
    reference = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert_logits_match(model, reference)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2-1f1b", "tp2xpp2"])
def test_model_parallel_ranks_give_one_rank_loss_gradients_logprobs_and_weights(untied_dir, tmp_path, tp, pp):
    model, layout = megatron_tp1(untied_dir)
    batch = random_batch(**PARITY_BATCH)
    logp, _ = forward_micro_batch(model, batch, packed=False)
    loss = response_nll(logp, batch)
    model.zero_grad()
    loss.backward()
    reference = megatron_to_hf({(0, 0): {n: p.grad for n, p in model.named_parameters()}}, layout)
    model.zero_grad()
    update = parity_update(model, batch)

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp * pp), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(WORKER), str(untied_dir), str(tmp_path), str(tp), str(pp)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(tp * pp)]
    for r in ranks:
        assert r["loss"] == pytest.approx(loss.item(), abs=1e-5)
        assert torch.allclose(r["packed_logp"], logp.detach(), atol=1e-5)
        if r["logits_width"] is not None:  # log-probs from vocabulary-parallel logits: no rank held them all
            assert r["logits_width"] == layout.vocab_size // tp
        for name in ("loss", "entropy", "grad_norm", "pg_clipfrac"):  # grad_norm spans TP shards / PP stages
            assert r["update"][name] == pytest.approx(update[name], abs=1e-5), name
    grads = megatron_to_hf({tuple(r["key"]): r["grads"] for r in ranks}, layout)
    assert grads.keys() == reference.keys()
    for name in reference:
        assert torch.allclose(grads[name], reference[name], atol=1e-5, rtol=0), name
    assert max(g.abs().max().item() for g in reference.values()) > 1e-3  # the gradients compared are not all ~0
    original = load_hf_state(untied_dir)
    for r in ranks:
        assert r["hf_weights"].keys() == original.keys()
        assert all(torch.equal(r["hf_weights"][k], original[k]) for k in original)


def test_a_dense_qwen3_model_converts_both_ways_and_its_logits_match_transformers(tmp_path):
    """Qwen3 (Qwen3-0.6B / 8B / 32B's layer: q/k RMSNorm per head, no QKV bias) at the tiny size."""
    from transformers import Qwen3ForCausalLM

    from services.trainer.modeling.checkpoint_convert import hf_to_megatron
    from services.trainer.modeling.model import ModelLayout

    hf_dir = tiny_hf_model(tmp_path, architecture="qwen3")
    layout = ModelLayout.from_hf_dir(hf_dir)
    assert layout.qk_layernorm and not layout.qkv_bias
    hf = load_hf_state(hf_dir)
    assert "model.layers.0.self_attn.q_norm.weight" in hf
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        back = megatron_to_hf(hf_to_megatron(hf, layout, tp, pp), layout)
        assert back.keys() == hf.keys() and all(torch.equal(back[n], t) for n, t in hf.items()), (tp, pp)
    model, _ = megatron_tp1(hf_dir)
    assert_logits_match(model, Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
