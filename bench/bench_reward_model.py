"""Samples/s of the reward model through the reward service against vLLM's pooling called in-process.

The service path is the real one: a client on loopback, Reward.Score with verifier_function
[reward_model] in batches of `--batch`, `--concurrency` requests in flight, the server tokenizing
prompt + response with the reward model's tokenizer and scoring on its AsyncLLM (pooling runner).
The in-process path hands the same texts to one `vllm.LLM(runner="pooling").classify` call (vLLM
tokenizes them), the fastest way to score a batch with vLLM. Both engines run the same locally
built Qwen2ForSequenceClassification (random weights, one label); the paths alternate, each timed
`--reps` times, and the median of the per-repetition ratios (service / in-process) is printed. The
two paths' scores must agree to 1e-4.

    python bench/bench_reward_model.py --quick      # 256 samples (CI)
    python bench/bench_reward_model.py              # 2048 samples
"""
from __future__ import annotations

import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from common import CPU_ENGINE_ENV, interleaved, machine_line, median, model_size, paired, parser, progress, ratio, work_dir

from services.common.config import InitModelConfig, config_from_dict
from services.common.tiny_model import build_tiny_model
from services.reward.client import RewardClient
from services.reward.model import MODEL_VERIFIER, RewardModelScorer
from services.reward.pool import InProcessRunner
from services.reward.scoring import ScoreInput
from services.reward.server import start_server

SEQ_LENGTH = 256


def make_inputs(count: int, seed: int) -> list[ScoreInput]:
    """Arithmetic prompts with responses of 10 to ~200 characters (one token each), right or wrong."""
    rng = random.Random(seed)
    inputs = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        reasoning = " ".join(f"{a}+{k}={a + k}." for k in range(rng.randint(0, 18)))
        inputs.append(ScoreInput(f"{reasoning} \\boxed{{{a + b + rng.choice((0, 0, 1))}}}", str(a + b), prompt=f"{a}+{b}="))
    return inputs


def main() -> int:
    p = parser(__doc__, "256 samples, 3 repetitions (default 2048 samples, 5 repetitions)")
    p.add_argument("--samples", type=int, help="samples per repetition (default 2048; --quick 256)")
    p.add_argument("--batch", type=int, default=64, help="items per Score request (default 64)")
    p.add_argument("--concurrency", type=int, default=4, help="Score requests in flight at once (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="reward model width (default 256; 128 is the demo's)")
    p.add_argument("--layers", type=int, default=4, help="reward model layers (default 4)")
    args = p.parse_args()
    samples = args.samples or (256 if args.quick else 2048)
    repeats = args.reps or (3 if args.quick else 5)
    for key, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)

    size = model_size(args.hidden, args.layers)
    model_dir = build_tiny_model(work_dir("reward-model") / "rm", InitModelConfig(
        hidden_size=size.hidden, num_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, intermediate_size=size.intermediate), prompt_type="empty", reward=True)
    cfg = config_from_dict({
        "rl_config": {"n_samples_per_prompt": 2, "verifier_function": [MODEL_VERIFIER], "verifier_weight": [1.0]},
        "generate_config": {"dtype": "float32", "max_num_seqs": 256, "max_num_batched_tokens": 8192},
        "reward_config": {"load": str(model_dir), "seq_length": SEQ_LENGTH},
    })
    inputs = make_inputs(samples, seed=0)
    texts = [s.prompt + s.response for s in inputs]
    batches = [inputs[i:i + args.batch] for i in range(0, len(inputs), args.batch)]

    from vllm import LLM
    from vllm.pooling_params import PoolingParams

    progress(f"starting two pooling engines on the reward model ({size.describe()})")
    offline = LLM(model=str(model_dir), runner="pooling", dtype="float32", max_model_len=SEQ_LENGTH,
                  max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=True, seed=0)
    raw = PoolingParams(use_activation=False)  # the head's output, as the service scores
    scorer = RewardModelScorer.start(cfg)
    server = start_server(cfg, InProcessRunner(), "127.0.0.1", 0, scorer)
    served: list[float] = []
    offline_scores: list[float] = []

    def in_process() -> float:
        started = time.perf_counter()
        outputs = offline.classify(texts, pooling_params=raw, use_tqdm=False)
        seconds = time.perf_counter() - started
        offline_scores[:] = [float(o.outputs.probs[0]) for o in outputs]
        return seconds

    with RewardClient(f"127.0.0.1:{server.port}") as client, ThreadPoolExecutor(args.concurrency) as requests:
        def service() -> float:
            started = time.perf_counter()
            results = list(requests.map(client.score, batches))
            seconds = time.perf_counter() - started
            served[:] = [r.total for batch in results for r in batch]
            return seconds

        times = interleaved({"in-process": in_process, "service": service}, repeats)
    server.stop()
    scorer.close()

    mismatched = sum(abs(a - b) > 1e-4 for a, b in zip(offline_scores, served))
    print(machine_line())
    print(f"reward model bench: {samples} samples, reward model {size.describe()}, seq_length {SEQ_LENGTH}, "
          f"{repeats} repeats, batch {args.batch}, {args.concurrency} requests in flight")
    for name, key in (("in-process vLLM pooling (LLM.classify)", "in-process"), ("gRPC service (reward_model)", "service")):
        print(f"  {name:40s}: {samples / median(times[key]):9.1f} samples/s  (median {median(times[key]):.3f} s)")
    print(f"  score mismatches: {mismatched}")
    ratio("reward model service / in-process vLLM pooling samples/s", paired(times, "in-process", "service"), at_least=0.9)
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
