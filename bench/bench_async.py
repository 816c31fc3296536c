"""Asynchronous RL: trained samples/s at rl_config.max_staleness (eta) 0, 1 and 2, and what the
overlap would give when rollout and trainer have their own devices.

Each run is `dockrl up` on the tiny CPU config (real Redis, a vLLM rollout replica, a reward
replica, the megatron-core trainer), without the warm start, so that the untrained model's
response lengths spread up to max_tokens (a long tail, as bench_partial_rollout's), and without
evaluations. Trained samples/s = GBS * n * iterations / their summed iteration time, the first
--skip iterations left out, and the last max(eta) too: admission stops at the run's last
iteration, so an eta run's last eta iterations train groups generated earlier without generating
any (at the start the backlog costs its time inside the measured iterations, as it would in a
long run). The runs are interleaved (eta 0, 1, 2, then again) and the medians
compared with eta 0; the issue's goal is eta 1 >= 1.3x eta 0 on this 2-core machine.

The model: from the eta 0 run's stage medians (R: the trainer waiting for scored groups, i.e.
rollout + reward; T: train; S: weight push), a synchronous iteration costs R + T + S and, with
rollout and trainer on devices of their own and eta >= 1, max(R, T + S): rollout of the next
batch overlaps the update and the push. Its prediction is printed beside the measured speedup;
here both sides share two cores, so the overlap cannot add compute, only fill idle time.
With --split S each eta also runs with interruptible partial rollout (rl_config.partial_rollout_max_split S:
a response is generated over up to S rounds, and once an iteration's groups are complete the replica
stops its rows in flight and puts them back with their tokens, resumed oldest first), the
"with interruption" rows. --max-tokens lengthens the tail (the tiny config's budget is 16 tokens).

    python bench/bench_async.py --quick     # eta 0 and 1, 6 iterations, one repetition (CI)
    python bench/bench_async.py             # 16 iterations, 3 repetitions
    python bench/bench_async.py --max-tokens 64 --split 4 --reps 2 --iters 12   # with and without interruption
"""
from __future__ import annotations

import sys

from bench_e2e import run_up
from common import machine_line, median, parser, progress, ratio, work_dir
from services.trainer.loop.run_log import draw_timeline

ETAS = (0, 1, 2)
GOAL = 1.3
AREAL_REPORTED = 2.77  # AReaL's paper: its asynchronous system over a synchronous one, same GPUs


def trained_samples_per_s(records: list[dict], samples_per_iteration: int) -> float:
    """Samples trained over the summed time of the iterations measured."""
    return samples_per_iteration * len(records) / sum(r["timing/iteration_s"] for r in records)


def main() -> int:
    p = parser(__doc__, "eta 0 and 1 only, 6 iterations (the first and the last left out), one repetition (CI)")
    p.add_argument("--iters", type=int, default=None, help="GRPO iterations per run (default 16; --quick 6)")
    p.add_argument("--skip", type=int, default=None, help="first iterations left out (default 2; --quick 1)")
    p.add_argument("--max-tokens", type=int, default=0, help="response budget in tokens (default: the tiny config's)")
    p.add_argument("--split", type=int, default=0,
                   help="also run each eta with interruptible partial rollout over this many rounds (default 0: not)")
    args = p.parse_args()
    iters = args.iters or (6 if args.quick else 16)
    skip = args.skip if args.skip is not None else (1 if args.quick else 2)
    reps = args.reps or (1 if args.quick else 3)
    etas = ETAS[:2] if args.quick else ETAS  # each eta is a whole `dockrl up`; CI checks that the script works
    if iters <= skip + max(etas):
        p.error(f"--iters must be more than --skip ({skip}) + {max(etas)}")
    common = [f"rl_config.rollout_max_tokens={args.max_tokens}",
              f"generate_config.sampling_config.max_tokens={args.max_tokens}"] if args.max_tokens else []
    settings = {f"eta {eta}": [*common, f"rl_config.max_staleness={eta}"] for eta in etas}
    if args.split > 1:
        settings.update({f"eta {eta}, interrupted": [*common, f"rl_config.max_staleness={eta}",
                                                     f"rl_config.partial_rollout_max_split={args.split}"] for eta in etas})

    from services.common.config import load_config

    root = work_dir("async")
    rates: dict[str, list[float]] = {label: [] for label in settings}
    sync_records: list[dict] = []
    last_records: dict[str, list[dict]] = {}
    samples = 0
    for rep in range(reps):
        for label, overrides in settings.items():
            work = root / f"{label.replace(' ', '').replace(',', '-')}-rep{rep}"
            records = run_up(work, iters, overrides)[skip:iters - max(etas)]
            cfg = load_config(str(work / "logs/config.yaml"))
            samples = cfg.megatron_training.global_batch_size * cfg.rl_config.n_samples_per_prompt
            rates[label].append(trained_samples_per_s(records, samples))
            lag = max(r["policy_lag/max"] for r in records)
            progress(f"rep {rep + 1}/{reps} {label}: {rates[label][-1]:.1f} trained samples/s, policy lag max {lag:.0f}")
            if "interrupted" not in label:
                last_records[label] = records
            if label == "eta 0":
                sync_records += records
    print(machine_line())
    print(f"{iters} iterations a run (first {skip} and last {max(etas)} left out), {samples} samples an iteration, {reps} repetitions"
          f"{f', max_tokens {args.max_tokens}' if args.max_tokens else ''}{f', interrupted runs split {args.split}' if args.split > 1 else ''}")
    print(f"{'run':<20}{'samples/s (median)':>20}")
    for label, values in rates.items():
        print(f"{label:<20}{median(values):>20.1f}")
    for label in list(rates)[1:]:
        ratio(f"trained samples/s {label} / eta 0", median(rates[label]) / median(rates["eta 0"]),
              at_least=GOAL if label == "eta 1" else None)
    rollout_s, train_s, push_s = (median([r[key] for r in sync_records]) for key in
                                  ("timing/rollout_and_reward_s", "timing/train_s", "timing/weight_sync_s"))
    predicted = (rollout_s + train_s + push_s) / max(rollout_s, train_s + push_s)
    print(f"eta 0 stages (median s): rollout + reward {rollout_s:.3f}, train {train_s:.3f}, weight push {push_s:.3f}")
    ratio("predicted eta >= 1 / eta 0 with rollout and trainer on their own devices", predicted)
    timeline = root / "async_timeline.png"
    draw_timeline(last_records, timeline, iterations=8, title="trainer timeline: synchronous vs asynchronous (rl_config.max_staleness)")
    print(f"timeline of the last repetition's runs: {timeline}")
    print(f"AReaL reports {AREAL_REPORTED}x over a synchronous system; it adds interruptible generation and a "
          "rollout fleet several times the trainer's, where this model has one replica and the tiny job's stages.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
