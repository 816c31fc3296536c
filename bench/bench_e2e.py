"""Where an iteration's time goes in a whole GRPO run: per-stage breakdown, the share the trainer
waits on rollout, and the share spent in the dock.

Runs `dockrl up` on the tiny CPU config (real Redis, a vLLM rollout replica, a reward replica and
the megatron-core trainer, as separate processes on loopback) for --iters iterations, without the
warm start (only time matters here) or evaluations, and reads the trainer's metrics.jsonl: per
iteration, rollout + reward (the trainer waits on the dock for scored groups), train (log-probs,
advantages, update) and weight sync (push to the replica), and the whole. The first
iterations (--skip) are left out (first use of every kernel and code path).

The dock's share: the same iteration's dock traffic (bench/bench_dock.py: prompts in, rollout
claims and puts, reward claims and puts, trainer claims and acks, at the run's GBS*n, prompt and
response lengths) is timed against a private redis-server right after the run, several times;
its median over the run's median iteration time is the share (goal < 2%). It counts every
service's dock calls as if they were on the critical path, so it is an upper bound.

    python bench/bench_e2e.py --quick      # 3 iterations (CI)
    python bench/bench_e2e.py              # 14 iterations
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from bench_dock import IterationData, dock_iteration, new_dock
from common import REPO, interleaved, machine_line, median, parser, private_redis, progress, ratio, work_dir

DOCK_GOAL = 0.02
STAGES = (("rollout + reward (trainer waits)", "timing/rollout_and_reward_s"), ("train", "timing/train_s"),
          ("weight sync", "timing/weight_sync_s"))


def run_up(work, iters: int) -> list[dict]:
    """Runs `dockrl up` on configs/tiny_cpu.yaml under `work`; returns the per-iteration metric records."""
    logs = work / "logs"
    sets = [
        f"megatron_training.load={work}/model", f"megatron_training.tokenizer_name_or_path={work}/model",
        f"megatron_training.data_path={work}/data/train", f"megatron_training.save={work}/ckpt",
        f"megatron_training.train_iters={iters}", f"arithmetic.out_dir={work}/raw", f"trainer.log_dir={logs}",
        "trainer.eval_data_path=", "trainer.test_data_path=", "trainer.eval_interval=0", "init_model.warm_start_accuracy=0",
        "rollout.grpc_port=0", "rollout.http_port=0", "reward.grpc_port=0", "trainer.grpc_port=0",
    ]
    argv = [sys.executable, "-m", "services", "up", str(REPO / "configs/tiny_cpu.yaml"), *[f"--set={s}" for s in sets]]
    progress(f"dockrl up: {iters} GRPO iterations on the tiny config (logs in {logs})")
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"dockrl up exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    records = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "timing/iteration_s" in r]


def main() -> int:
    p = parser(__doc__, "3 iterations (the first skipped), the dock replay 3 times (CI)")
    p.add_argument("--iters", type=int, default=None, help="GRPO iterations (default 14; --quick 3)")
    p.add_argument("--skip", type=int, default=None, help="first iterations left out of the medians (default 2; --quick 1)")
    args = p.parse_args()
    iters = args.iters or (3 if args.quick else 14)
    args.skip = args.skip if args.skip is not None else (1 if args.quick else 2)
    reps = args.reps or (3 if args.quick else 7)
    if iters <= args.skip:
        p.error(f"--iters must be more than --skip ({args.skip})")

    from services.common.config import load_config
    from services.common.preprocess import load_prompts

    work = work_dir("e2e")
    records = run_up(work, iters)[args.skip:]
    cfg = load_config(str(work / "logs/config.yaml"))
    gbs, n = cfg.megatron_training.global_batch_size, cfg.rl_config.n_samples_per_prompt
    iteration = median([r["timing/iteration_s"] for r in records])
    print(machine_line())
    print(f"{len(records)} iterations measured (first {args.skip} skipped), GBS {gbs} x n {n}, "
          f"median iteration {iteration:.3f} s")
    print(f"{'stage':<34}{'median s':>10}{'share':>8}")
    for label, key in STAGES:
        seconds = median([r[key] for r in records])
        print(f"{label:<34}{seconds:>10.3f}{seconds / iteration:>8.1%}")

    # the dock's traffic of one such iteration, at the run's sizes (response lengths uniform up to twice the mean)
    prompt_len = round(np.mean([len(r.prompt_ids) for r in load_prompts(cfg.megatron_training.data_path)]))
    response_len = max(1, round(2 * median([r["response_length/mean"] for r in records])))
    with private_redis(work) as url:
        import redis

        dock = new_dock(redis.Redis.from_url(url), gbs * n)
        data = IterationData.make(gbs * n, prompt_len, response_len)
        dock_s = median(interleaved({"dock": lambda: dock_iteration(dock, data, claims=1)}, reps, warmups=1, label="dock replay: ")["dock"])
        dock.destroy()
    print(f"dock traffic of one iteration ({gbs * n} rows, {prompt_len}-token prompts, responses up to {response_len}): "
          f"{dock_s:.3f} s")
    ratio("trainer waiting on rollout / iteration time", median([r["timing/rollout_and_reward_s"] / r["timing/iteration_s"] for r in records]))
    ratio("dock time / iteration time", dock_s / iteration, at_most=DOCK_GOAL)
    tokens = np.median([r["throughput/tokens_per_s"] for r in records])
    print(f"rollout throughput as the trainer sees it: {tokens:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
