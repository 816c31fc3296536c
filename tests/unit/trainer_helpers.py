"""Shared pieces of the trainer tests: a tiny HF model with informative weights, random batches, torchrun ranks, the
whole model gathered in HF names (a push streams it instead), and the measure of tensor memory a streamed weight gather
holds (bench/bench_trainer.py uses the last two too)."""
from __future__ import annotations

import gc
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import torch

from services.common.config import InitModelConfig
from services.common.tiny_model import build_tiny_model
from services.dock.rows import ScoredSample
from services.trainer.loop.iteration_data import ScoredBatch
from services.trainer.modeling.logprobs import ResponseBatch
from services.trainer.weights.gather import HfWeightStream, model_state

# gather_hf_tensors merges every bucket, so their size only sets how often the merge happens
WHOLE_GATHER_BUCKET_MB = 64


def tiny_hf_model(out_dir: pathlib.Path, tie_word_embeddings: bool = False, seed: int = 0, architecture: str = "qwen2",
                  num_layers: int = 2) -> pathlib.Path:
    """The foundation's tiny Qwen2 (or Qwen MoE) model with its weights redrawn larger (std 0.1, norms around 1).

    The default init (std 0.02) gives near-uniform logits, where a wrong head order or a
    swapped gate/up could hide under the 1e-5 tolerance; these weights make every mapping show.
    """
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(out_dir, InitModelConfig(tie_word_embeddings=tie_word_embeddings, seed=seed, architecture=architecture,
                                                     num_layers=num_layers))
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
    return ResponseBatch.from_token_ids(prompts, responses)


def scored_batch(prompts: list[list[int]], responses: list[list[int]], scores: list[float], log_probs: list[list[float]],
                 versions: list[list[int]], parts: list[list[float] | None] | None = None) -> ScoredBatch:
    """A batch of rows 0..B-1 as the dock would give them: each sample's fields in the dock's dtypes."""
    parts = parts or [None] * len(prompts)
    return ScoredBatch([ScoredSample(np.array(p, np.int32), np.array(r, np.int32), s, np.array(lp, np.float32),
                                     np.array(v, np.int32), None if part is None else np.array(part, np.float32), None, None)
                        for p, r, s, lp, v, part in zip(prompts, responses, scores, log_probs, versions, parts)],
                       list(range(len(prompts))))


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


def assert_logits_match(model, reference) -> None:
    """The megatron `model`'s logits equal transformers' `reference` (same weights) on a random batch, within 1e-5."""
    model.eval()
    ids = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(13).unsqueeze(0).expand(2, -1), None)
        theirs = reference(ids).logits
    assert theirs.std() > 0.5  # informative logits, not a near-uniform softmax
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


def response_nll(logp: torch.Tensor, batch: ResponseBatch) -> torch.Tensor:
    """Mean negative log-likelihood over response tokens: the loss the parity tests compare."""
    mask = batch.response_mask()
    return -(logp * mask).sum() / mask.sum()


def torchrun_ranks(worker: pathlib.Path, ranks: int, hf_dir: pathlib.Path, out: pathlib.Path, *args) -> list[dict]:
    """Runs `worker` (argv: hf_dir, out, *args) on `ranks` gloo ranks under torchrun; returns each rank's out/rank{r}.pt."""
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(worker), str(hf_dir), str(out), *map(str, args)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def _live_cpu_storages() -> dict[int, int]:
    """Every live CPU tensor's storage (by address) and its bytes: what the garbage collector sees, wherever it is held."""
    gc.collect()
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in gc.get_objects() if torch.is_tensor(t) and t.device.type == "cpu"}


def _extra_storage_bytes(before) -> tuple[int, int]:
    """(bytes of CPU tensor storage alive beyond the storages in `before`, the part of them a Python object holds).

    A tensor that only C++ still references keeps its Python object, so the garbage collector lists it too."""
    gc.collect()
    new = [t for t in gc.get_objects()
           if torch.is_tensor(t) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in before]
    held = {id(o) for r in gc.get_referrers(*new) if r is not new for o in gc.get_referents(r)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in new}
    in_python = {t.untyped_storage().data_ptr() for t in new if id(t) in held}
    return sum(storages.values()), sum(n for ptr, n in storages.items() if ptr in in_python)


def peak_extra_tensor_bytes(make_buckets) -> int:
    """The most bytes of CPU tensor storage alive beyond those alive before `make_buckets()` was called, sampled as
    each bucket arrives (the consumer holding it, the producer holding what it has gathered ahead); each bucket is
    dropped before the next, as a push does. Tensors that alias storage alive before (the model's own) count nothing.

    Storage that only C++ holds is read again for up to a second: gloo's worker thread drops a finished
    collective's buffers a moment after wait() has returned, and a loaded machine can sample in between (CI read
    one layer's gathered TP parts so). Whatever C++ still holds after that counts, so a real leak is not hidden."""
    before = _live_cpu_storages().keys()
    peak = 0
    for bucket in make_buckets():
        total, in_python = _extra_storage_bytes(before)
        for _ in range(50):
            if total == in_python:
                break
            time.sleep(0.02)
            total, in_python = _extra_storage_bytes(before)
        peak = max(peak, total)
        del bucket
    return peak


def chosen_experts(model, batch: ResponseBatch, packed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(log-probs, per sample [P+L, MoE layers, top_k] sorted expert ids the routers picked) of one forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    from services.trainer.modeling.logprobs import forward_micro_batch

    maps = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach()))
             for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        with torch.no_grad():
            logp, _ = forward_micro_batch(model, batch, packed)
    finally:
        for hook in hooks:
            hook.remove()
    top_k = int(maps[0][0].sum())
    # routing_map [tokens, experts] -> sorted ids [tokens, layers, top_k], tokens in the router's order
    ids = torch.stack([m.nonzero()[:, 1].view(-1, top_k) for m in maps], 1)
    lengths = batch.sequence_lengths.tolist()
    if packed:
        return logp, list(ids.split(lengths))
    width = ids.size(0) // batch.size
    rows = ids.view(width, batch.size, *ids.shape[1:]).transpose(0, 1)  # [S, b] S-major -> [b, S]
    return logp, [rows[i, :n] for i, n in enumerate(lengths)]


def gather_hf_weights(model, layout) -> dict[str, torch.Tensor]:
    """The full model in HF names on every rank (tests and checks that compare whole models; a push streams instead)."""
    return gather_hf_tensors(model_state(model), layout)


def gather_hf_tensors(state: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """`state` (this rank's tensors by megatron name: its weights, or gradients) gathered from every rank into HF names.

    Copies, never the live tensors: a tensor the stream passes through unconverted (a norm, a router at TP 1) would
    otherwise move with the next optimizer step in the caller's dict."""
    live = {t.data_ptr() for t in state.values()}
    return {name: t.clone() if t.data_ptr() in live else t
            for bucket in HfWeightStream(state, layout, WHOLE_GATHER_BUCKET_MB) for name, t in bucket.items()}
