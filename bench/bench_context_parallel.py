"""Context parallel 2 (and 4) vs 1 in the trainer at a fixed long sequence: activation memory per rank and time per token.

Each repetition launches the same worker under torchrun in turn (interleaved), on the same weights
and one sample of `--length` tokens (16 prompt tokens, the rest response; fp32, 1 thread per rank):
cp1 (one rank), cp2-ulysses (`ulysses_cp_algo`), cp2-ring (`megatron_cp_algo`), and without
`--quick` cp4-hybrid (`hybrid_cp_algo`, CP 4 = Ulysses 2 x ring 2 on 4 ranks; a 4-rank launch
would add about 25 s to the quick run, which CI runs).
Each worker runs the trainer's forward + backward of the response NLL (`run_micro_batches`, what
an update runs per micro-batch) once to warm up and measure memory, then `--steps` timed ones, and reports:

- activation memory per rank: the bytes autograd keeps for the backward pass at the end of the
  forward (saved tensors, each storage counted once, the weights left out), exact and free of
  load; the issue's goal is CP 2 / CP 1 <= 0.6;
- peak resident memory the first step added (VmHWM, reset before it, minus VmRSS before it):
  this also counts transient working memory and what the allocator keeps (coarser, page-level);
- time per token of the forward + backward, CP 2 / CP 1 per repetition (median).

The model is the demo's shape (hidden 128, 2 layers, 4/2 heads) with RoPE positions up to the
sequence length. On this machine's 2 shared cores CP 2 runs one rank per core: the time ratio says
what splitting one sequence across two devices gives here, with gloo on loopback between them. CP 4
runs two ranks per core, so its time per token says little; its activation memory is exact.

    python bench/bench_context_parallel.py --quick
    python bench/bench_context_parallel.py
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

from common import REPO, machine_line, median, parser, progress, ratio, work_dir

MEMORY_GOAL = 0.6
PROMPT = 16
# name -> (CP size, context_parallel_algo, ulysses_degree_in_cp)
PATHS = {"cp1": (1, "megatron_cp_algo", 1), "cp2-ulysses": (2, "ulysses_cp_algo", 1), "cp2-ring": (2, "megatron_cp_algo", 1),
         "cp4-hybrid": (4, "hybrid_cp_algo", 2)}
QUICK_PATHS = ("cp1", "cp2-ulysses", "cp2-ring")


def _memory_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _worker(hf_dir: str, out: str, cp: int, algo: str, ulysses: int, length: int, steps: int) -> None:
    """One rank (under torchrun): a warm-up step, `steps` timed ones, the memory figures; rank 0 writes `out`."""
    import time

    import torch

    sys.path.insert(0, str(REPO))
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.logprobs import ResponseBatch, run_micro_batches
    from services.trainer.modeling.model import ModelLayout, build_model, destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(1, 1, cp=cp, ulysses=ulysses)
    layout = ModelLayout.from_hf_dir(hf_dir)
    model = build_model(layout, cp_algo=algo)
    load_hf_into_model(model, load_hf_state(hf_dir), layout)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, layout.vocab_size, (length,), generator=gen).tolist()
    batch = ResponseBatch.from_token_ids([tokens[:PROMPT]], [tokens[PROMPT:]])
    response_tokens = float(length - PROMPT)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step(saved: dict | None = None) -> float:
        """Forward + backward of the response NLL; with `saved`, records the storages autograd keeps."""
        def pack(t):
            storage = t.untyped_storage()
            if saved is not None and storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        def loss(i, logp, entropy):
            return -logp.sum() / response_tokens

        torch.distributed.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run_micro_batches(model, [batch], packed=True, loss_fn=loss)
        torch.distributed.barrier()
        return time.perf_counter() - start

    # The first step is the measured one for memory (a later one would reuse what the allocator kept) and the warm-up.
    saved: dict[int, int] = {}
    rss_before = _memory_kib("VmRSS")
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set
    step(saved)
    peak_added = (_memory_kib("VmHWM") - rss_before) * 1024
    seconds = [step() for _ in range(steps)]
    figures = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(figures, {"activation_bytes": sum(saved.values()), "peak_added_bytes": peak_added})
    if torch.distributed.get_rank() == 0:
        pathlib.Path(out).write_text(json.dumps({"step_s": median(seconds), "tokens": length, "ranks": figures}))
    destroy_parallel()


def run_worker(hf_dir: pathlib.Path, work: pathlib.Path, name: str, length: int, steps: int) -> dict:
    """One torchrun launch of the worker for path `name`; its figures."""
    cp, algo, ulysses = PATHS[name]
    out = work / f"result-{name}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-addr", "127.0.0.1",
           "--master-port", str(port), __file__, "--worker", str(hf_dir), str(out), str(cp), algo, str(ulysses), str(length),
           str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"worker {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def build_long_model(out_dir: pathlib.Path, length: int) -> pathlib.Path:
    """The demo's model shape with RoPE positions for `length` tokens (random weights)."""
    from services.common.config import InitModelConfig
    from services.common.tiny_model import build_tiny_model

    return build_tiny_model(out_dir, InitModelConfig(max_position_embeddings=length))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]))
        return
    p = parser(__doc__, "a 1024-token sequence at CP 1 and 2 only, one repetition of 2 steps (seconds, to check it runs)")
    p.add_argument("--length", type=int, default=None, help="tokens in the sequence (default 4096; --quick 1024)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per launch (default 3; --quick 2)")
    args = p.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    length = args.length or (1024 if args.quick else 4096)
    steps = args.steps or (2 if args.quick else 3)
    print(machine_line())
    work = work_dir("context-parallel")
    hf_dir = build_long_model(work / "model", length)
    progress(f"one sequence of {length} tokens, demo model shape, {steps} timed forward + backward steps per launch")
    paths = QUICK_PATHS if args.quick else tuple(PATHS)
    results: dict[str, list[dict]] = {name: [] for name in paths}
    for rep in range(reps):  # interleaved: each repetition launches every path once
        for name in paths:
            results[name].append(run_worker(hf_dir, work, name, length, steps))
        progress(f"rep {rep + 1}/{reps}: " + ", ".join(f"{n} {r[-1]['step_s']:.3f} s" for n, r in results.items()))
    last = {name: r[-1] for name, r in results.items()}
    one = last["cp1"]["ranks"][0]
    for name, figures in last.items():
        activations = max(rank["activation_bytes"] for rank in figures["ranks"])
        peak = max(rank["peak_added_bytes"] for rank in figures["ranks"])
        print(f"{name}: activations {activations / 2**20:.1f} MiB per rank (largest), step peak resident +{peak / 2**20:.1f} MiB, "
              f"step {median([r['step_s'] for r in results[name]]):.3f} s")
    for name in paths[1:]:
        activations = max(rank["activation_bytes"] for rank in last[name]["ranks"])
        # The issue's goal is CP 2's; CP 4 has none of its own (a quarter of each sequence would be ideal).
        ratio(f"activation memory per rank {name} / cp1", activations / one["activation_bytes"],
              at_most=MEMORY_GOAL if PATHS[name][0] == 2 else None)
        peak = max(rank["peak_added_bytes"] for rank in last[name]["ranks"])
        ratio(f"step peak resident added per rank {name} / cp1", peak / max(1, one["peak_added_bytes"]))
        per_token = [(r2["step_s"] / r2["tokens"]) / (r1["step_s"] / r1["tokens"]) for r1, r2 in zip(results["cp1"], results[name])]
        ratio(f"time per token {name} / cp1", median(per_token))


if __name__ == "__main__":
    main()
