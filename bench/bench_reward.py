"""Samples/s of the reward gRPC service against calling the verifiers in-process, on the same inputs.

The service path is the real one: a client on loopback, Reward.Score in batches of `--batch`
with `--concurrency` requests in flight, the server's process pool (`--parallel` workers, a
deadline per verifier). The in-process path calls the same
verifiers in one thread with no isolation and no deadline. Each is timed `--reps` times; the
medians and their ratio (service / in-process) are printed, and both paths' scores must agree.

    python bench/bench_reward.py --quick      # 256 samples (CI)
    python bench/bench_reward.py              # 2048 samples
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from common import machine_line, paired, parser, progress, ratio

from services.common.config import config_from_dict
from services.reward.client import RewardClient
from services.reward.pool import InProcessRunner, VerifierPool
from services.reward.scoring import ScoreInput, ScoringPlan, score_samples
from services.reward.server import start_server

VERIFIERS = ("acc", "strict_format", "math_17k_acc", "acc_for_dapo")


def make_inputs(count: int, seed: int) -> list[ScoreInput]:
    """Responses of the shapes training sees: right, wrong, unboxed, Minerva, fractions, long reasoning."""
    rng = random.Random(seed)
    inputs = []
    for _ in range(count):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        answer = a + b
        reasoning = " ".join(f"step {k}: {a}+{k}={a + k}." for k in range(rng.randint(5, 60)))
        shape = rng.randrange(5)
        if shape == 0:
            text = f"<think>{reasoning}</think><answer>The sum is \\boxed{{{answer}}}</answer>"
        elif shape == 1:
            text = f"<think>{reasoning}</think><answer>\\boxed{{{answer + rng.randint(1, 5)}}}</answer>"
        elif shape == 2:
            text = f"{reasoning} So the answer is {answer}."
        elif shape == 3:
            text = f"{reasoning}\nAnswer: {answer}"
        else:
            text = f"{reasoning} \\boxed{{\\frac{{{answer * 2}}}{{2}}}}"
        inputs.append(ScoreInput(text, str(answer), response_length=len(text) // 4))
    return inputs


def time_it(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    p = parser(__doc__, "256 samples, 3 repetitions (default 2048 samples, 5 repetitions)")
    p.add_argument("--samples", type=int, help="samples per repetition (default 2048; --quick 256)")
    p.add_argument("--batch", type=int, default=64, help="items per Score request (default 64)")
    p.add_argument("--parallel", type=int, default=2, help="verifier worker processes (default 2)")
    p.add_argument("--concurrency", type=int, default=2, help="Score requests in flight at once (default 2)")
    args = p.parse_args()
    samples = args.samples or (256 if args.quick else 2048)
    repeats = args.reps or (3 if args.quick else 5)

    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": 2, "verifier_function": list(VERIFIERS),
                                          "verifier_weight": [1.0] * len(VERIFIERS),
                                          "verifier_parallel": args.parallel, "verifier_timeout": 10}})
    plan = ScoringPlan.from_rl_config(cfg.rl_config)
    inputs = make_inputs(samples, seed=0)
    batches = [inputs[i:i + args.batch] for i in range(0, len(inputs), args.batch)]

    in_process = InProcessRunner()
    reference = score_samples(inputs, plan, in_process)  # also warms the parsers
    local_times, service_times = [], []
    with VerifierPool(args.parallel, cfg.rl_config.verifier_timeout) as pool:
        server = start_server(cfg, pool, "127.0.0.1", 0)
        with RewardClient(f"127.0.0.1:{server.port}") as client, ThreadPoolExecutor(args.concurrency) as requests:
            served = [r for batch in batches for r in client.score(batch)]
            # alternate the two paths so both see the same load on a shared machine
            for rep in range(repeats):
                local_times.append(time_it(lambda: score_samples(inputs, plan, in_process)))
                service_times.append(time_it(lambda: list(requests.map(client.score, batches))))
                progress(f"rep {rep + 1}/{repeats}: in-process {local_times[-1]:.3f} s, service {service_times[-1]:.3f} s")
        server.stop()

    mismatched = sum(abs(a.total - b.total) > 1e-6 for a, b in zip(reference, served))
    local_rate = samples / statistics.median(local_times)
    service_rate = samples / statistics.median(service_times)
    print(machine_line())
    print(f"reward bench: {samples} samples x {len(VERIFIERS)} verifiers ({', '.join(VERIFIERS)}), "
          f"{repeats} repeats, batch {args.batch}, {args.concurrency} requests in flight, {args.parallel} workers")
    print(f"  in-process verifiers : {local_rate:9.1f} samples/s  (median {statistics.median(local_times):.3f} s)")
    print(f"  gRPC service         : {service_rate:9.1f} samples/s  (median {statistics.median(service_times):.3f} s)")
    print(f"  score mismatches: {mismatched}")
    ratio("reward service / in-process verifiers samples/s", paired({"local": local_times, "service": service_times}, "local", "service"))
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
