"""Response log-probs and entropy: padded vs packed vs dynamic batches, and against transformers."""
import dataclasses

import pytest
import torch
from trainer_helpers import megatron_tp1, random_batch, tiny_hf_model

from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, compute_logprobs, micro_batches

LENGTHS = dict(prompt_lengths=[3, 5, 2, 4, 6], response_lengths=[4, 1, 6, 3, 2])


@pytest.fixture(scope="module")
def model_and_dir(tmp_path_factory):
    hf_dir = tiny_hf_model(tmp_path_factory.mktemp("hf"))
    model, _ = megatron_tp1(hf_dir)
    return model, hf_dir


def test_padded_logprobs_match_transformers(model_and_dir):
    from transformers import Qwen2ForCausalLM

    model, hf_dir = model_and_dir
    batch = random_batch(1, **LENGTHS)
    logp, entropy = compute_logprobs(model, batch, ForwardConfig(micro_batch_size=2))
    reference = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for i in range(batch.size):
        p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        seq = batch.tokens[i, : p + r].unsqueeze(0)
        with torch.no_grad():
            full = torch.log_softmax(reference(seq).logits[0], dim=-1)[p - 1: p + r - 1]
        want = full.gather(-1, seq[0, p:].unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(logp[i, :r], want, atol=1e-5)
        assert torch.allclose(entropy[i, :r], -(full.exp() * full).sum(-1), atol=1e-5)
        assert torch.all(logp[i, r:] == 0) and torch.all(entropy[i, r:] == 0)


@pytest.mark.parametrize("cfg", [
    ForwardConfig(micro_batch_size=1),
    ForwardConfig(micro_batch_size=3, use_remove_padding=True),
    ForwardConfig(use_remove_padding=True, use_dynamic_bsz=True, max_packing_token_size=16),
    ForwardConfig(use_dynamic_bsz=True, max_packing_token_size=20),
], ids=["padded-mbs1", "packed-mbs3", "packed-dynamic", "padded-dynamic"])
def test_every_path_gives_the_padded_numbers(model_and_dir, cfg):
    model, _ = model_and_dir
    batch = random_batch(2, **LENGTHS)
    want_logp, want_entropy = compute_logprobs(model, batch, ForwardConfig(micro_batch_size=5))
    logp, entropy = compute_logprobs(model, batch, cfg)
    assert logp.abs().sum() > 1.0
    assert torch.allclose(logp, want_logp, atol=1e-5) and torch.allclose(entropy, want_entropy, atol=1e-5)


def test_dynamic_micro_batches_respect_the_token_budget():
    batch = random_batch(0, **LENGTHS)  # sequence lengths 7 6 8 7 8
    packed = micro_batches(batch, ForwardConfig(use_remove_padding=True, use_dynamic_bsz=True, max_packing_token_size=16))
    assert [m.tolist() for m in packed] == [[0, 1], [2, 3], [4]]
    padded = micro_batches(batch, ForwardConfig(use_dynamic_bsz=True, max_packing_token_size=20))
    assert [m.tolist() for m in padded] == [[0, 1], [2, 3], [4]]  # 2 rows x 8 = 16; 3 rows x 8 = 24 > 20
    with pytest.raises(ValueError, match="max_packing_token_size: 5 is below sample 0's 7 tokens"):
        micro_batches(batch, ForwardConfig(use_dynamic_bsz=True, max_packing_token_size=5))



def test_dynamic_micro_batches_come_in_a_multiple_of_the_pipeline_size_when_asked():
    batch = random_batch(0, **LENGTHS)  # sequence lengths 7 6 8 7 8
    cfg = ForwardConfig(use_remove_padding=True, use_dynamic_bsz=True, max_packing_token_size=16, count_multiple_of=2)
    # [0, 1] 13, [2, 3] 15, [4] 8 tokens: the costliest of several samples is cut, in order
    assert [m.tolist() for m in micro_batches(batch, cfg)] == [[0, 1], [2], [3], [4]]
    assert [m.tolist() for m in micro_batches(batch, dataclasses.replace(cfg, count_multiple_of=5))] == [[0], [1], [2], [3], [4]]
    with pytest.raises(ValueError, match="use_dynamic_bsz: 5 samples make 5 micro-batches, and the interleaved schedule needs a "
                                         "multiple of pipeline_model_parallel_size 2"):
        micro_batches(batch, dataclasses.replace(cfg, max_packing_token_size=8))

def test_batch_rejects_empty_prompts_and_responses():
    with pytest.raises(ValueError, match="responses: every sample"):
        ResponseBatch.from_token_ids([[1, 2]], [[]])
    with pytest.raises(ValueError, match="prompts: every sample"):
        ResponseBatch.from_token_ids([[]], [[1]])
