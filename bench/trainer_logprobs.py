"""Padded vs packed (remove-padding) log-prob passes on the tiny model, side by side in one run.

Prints the median seconds of each over several repetitions and their ratio, for a batch whose
response lengths vary as RL batches do (most short, a few long). `--quick` runs fewer, smaller
repetitions.

    python bench/trainer_logprobs.py --quick
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from common import machine_line, parser, progress, ratio


def main() -> int:
    p = parser(__doc__, "3 repetitions of 16 samples instead of 7 of 64")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from services.common.config import InitModelConfig
    from services.common.tiny_model import build_tiny_model
    from services.trainer.modeling.checkpoint_convert import load_hf_into_model, load_hf_state
    from services.trainer.modeling.logprobs import ForwardConfig, ResponseBatch, compute_logprobs
    from services.trainer.modeling.model import ModelLayout, build_model, init_parallel

    samples, reps = (16, 3) if args.quick else (64, 7)
    reps = args.reps or reps
    gen = torch.Generator().manual_seed(0)
    # Response lengths: 3/4 short (4-16 tokens), 1/4 long (up to 200): the padded path pads to the longest.
    lengths = [int(torch.randint(4, 17, (1,), generator=gen)) if i % 4 else int(torch.randint(100, 201, (1,), generator=gen))
               for i in range(samples)]
    prompts = [torch.randint(0, 256, (24,), generator=gen).tolist() for _ in range(samples)]
    responses = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    batch = ResponseBatch.from_token_ids(prompts, responses)

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_tiny_model(tmp, InitModelConfig())
        init_parallel(1, 1)
        layout = ModelLayout.from_hf_dir(hf_dir)
        model = build_model(layout)
        load_hf_into_model(model, load_hf_state(hf_dir), layout)

    configs = {
        "padded (micro_batch_size 8)": ForwardConfig(micro_batch_size=8),
        "packed (dynamic, 2048 tokens)": ForwardConfig(use_remove_padding=True, use_dynamic_bsz=True, max_packing_token_size=2048),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    results = {}
    for rep in range(reps):
        for name, cfg in configs.items():  # interleaved, so drift in machine load hits both alike
            start = time.perf_counter()
            results[name] = compute_logprobs(model, batch, cfg)[0]
            times[name].append(time.perf_counter() - start)
        progress(f"repetition {rep + 1}/{reps} done")
    padded, packed = (statistics.median(t) for t in times.values())
    a, b = results.values()
    print(f"samples {samples}, tokens {int(batch.sequence_lengths.sum())}, padded tokens {samples * batch.tokens.size(1)}")
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.3f} s over {reps}")
    print(machine_line())
    print(f"max |logprob diff| packed vs padded: {float((a - b).abs().max()):.2e}")
    ratio("packed / padded log-prob pass time", packed / padded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
