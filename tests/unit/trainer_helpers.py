"""Shared pieces of the trainer tests: a tiny HF model with informative weights, random batches."""
from __future__ import annotations

import pathlib

import torch

from services.common.config import InitModelConfig
from services.common.tiny_model import build_tiny_model
from services.trainer.modeling.logprobs import ResponseBatch


def tiny_hf_model(out_dir: pathlib.Path, tie_word_embeddings: bool = False, seed: int = 0, architecture: str = "qwen2") -> pathlib.Path:
    """The foundation's tiny Qwen2 (or Qwen MoE) model with its weights redrawn larger (std 0.1, norms around 1).

    The default init (std 0.02) gives near-uniform logits, where a wrong head order or a
    swapped gate/up could hide under the 1e-5 tolerance; these weights make every mapping show.
    """
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(out_dir, InitModelConfig(tie_word_embeddings=tie_word_embeddings, seed=seed, architecture=architecture))
    weights = path / "model.safetensors"
    gen = torch.Generator().manual_seed(seed + 1)
    state = load_file(str(weights))
    for name, t in state.items():
        noise = torch.randn(t.shape, generator=gen)
        state[name] = (1.0 + 0.1 * noise) if name.endswith("norm.weight") else 0.1 * noise
    save_file(state, str(weights), metadata={"format": "pt"})
    return path


def random_batch(seed: int, prompt_lengths: list[int], response_lengths: list[int], vocab: int = 256) -> ResponseBatch:
    """Random prompt and response token ids of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lengths]
    responses = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in response_lengths]
    return ResponseBatch.from_lists(prompts, responses)


def megatron_tp1(hf_dir: pathlib.Path):
    """This process's one-rank megatron model loaded from `hf_dir` (initialises parallel state once per process)."""
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.model import ModelLayout, build_model, init_parallel

    torch.set_num_threads(1)
    init_parallel(1, 1)
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    return model, layout


def response_nll(logp: torch.Tensor, batch: ResponseBatch) -> torch.Tensor:
    """Mean negative log-likelihood over response tokens: the loss the parity tests compare."""
    mask = batch.response_mask()
    return -(logp * mask).sum() / mask.sum()
