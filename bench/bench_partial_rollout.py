"""Iteration wall time under partial rollout (partial_rollout_max_split = 1, 2, 4) on a long-tail
response length distribution: most responses short, a few at the max.

One rollout replica per max_split, each a real `python -m services.rollout serve --dock` worker of
its own run in Redis, with that run's config. This script plays the trainer of all of them: per
iteration it calls begin_iteration, puts prompts into the free group slots and claims GBS
complete groups (as `actor_train`), then acks them; the iteration's wall time is put-to-last-claim.
Each run's iterations go back to back (no training time between them, in which a partial run's
worker would finish carried-over groups for free), after warm-up iterations that fill the partial
runs' carry-over; the runs go one after the other (interleaving them would hand a partial run's
worker the other runs' time) and the figures are medians.

The long tail comes from sampling: the bench model is random-initialised, so at temperature 1 its
next token is close to uniform over the 320-token vocabulary, and `--stop-chars` byte tokens end a
response. With k of them a response ends at each token with probability about k/320: lengths are
roughly geometric, most far below --max-tokens, a few percent at it. Under max_split 1 an iteration
waits for its longest sample; with splits, a round generates at most max_tokens/split tokens, the
groups that finish are trained, and the rest continue in the next iteration.

Goal: the iteration with max_split 4 takes at most 0.6x the one with max_split 1.

    python bench/bench_partial_rollout.py --quick     # max_split 1 and 4, small batch (CI)
    python bench/bench_partial_rollout.py             # max_split 1, 2, 4; GBS 16, n 8, 128 tokens
"""
from __future__ import annotations

import statistics
import string
import sys
import time
import uuid

import numpy as np

from common import TINY, build_model, engine_env, engine_overrides, interleaved, machine_line, median, parser, progress
from common import ratio, start_replicas, stop_all, work_dir
from services.dock.rows import PromptRow
from services.dock.schema import RESPONSES

GOAL = 0.6
PROMPT_LEN = 8


def run_overrides(split: int, args, prefix: str) -> list[str]:
    """The config of one run: its own dock run, its max_split, long-tail sampling, one claim for the whole pool."""
    capacity_rows = args.gbs * args.n * (2 if split > 1 else 1)  # the dock's default capacity (docs/dock.md)
    stops = ",".join(f'"{c}"' for c in string.ascii_lowercase[:args.stop_chars])
    # no sampling seed: over near-uniform logits one seed would draw the same tokens for every sample
    return [
        f"dock.prefix={prefix}", f"dock.run_id=split{split}", "dock.claim_poll_s=0.02", "rollout.max_queue=1024",
        f"megatron_training.global_batch_size={args.gbs}", f"rl_config.n_samples_per_prompt={args.n}",
        f"rl_config.partial_rollout_max_split={split}", f"rl_config.rollout_max_tokens={args.max_tokens}",
        f"rl_config.actor_rollout_dispatch_size={capacity_rows}",
        f"generate_config.sampling_config.max_tokens={args.max_tokens}", "generate_config.sampling_config.temperature=1.0",
        f"generate_config.sampling_config.stop=[{stops}]",
        f"generate_config.max_num_seqs={capacity_rows}", f"generate_config.max_model_len={PROMPT_LEN + args.max_tokens}",
        f"rl_config.max_prompt_length={PROMPT_LEN}",
    ]


class TrainerSide:
    """The trainer's dock traffic for one run: prompts in, GBS complete groups out."""

    def __init__(self, redis_url: str, overrides: list[str]):
        from services.common.config import load_config
        from services.dock.client import Dock
        from services.dock.schema import DockLayout

        self.cfg = load_config(None, overrides)
        self.dock = Dock.from_config(self.cfg, redis_url=redis_url)
        self.dock.create(DockLayout.from_config(self.cfg))
        self.gbs = self.cfg.megatron_training.global_batch_size
        self.n = self.cfg.rl_config.n_samples_per_prompt
        self.lengths: list[int] = []
        self._prompt = 0

    def iteration(self) -> float:
        """Seconds from putting this iteration's prompts to holding GBS complete groups."""
        start = time.perf_counter()
        groups = self.dock.begin_iteration(self.gbs)
        rows = self.dock.rows_of(groups)
        prompts = []
        for _ in groups:
            self._prompt += 1
            prompts += [np.arange(self._prompt, self._prompt + PROMPT_LEN, dtype=np.int32) % 256] * self.n
        self.dock.put(rows, PromptRow.to_columns([PromptRow(p, "0") for p in prompts]))
        held, rows_held = [], 0
        while rows_held < self.gbs * self.n:
            claim = self.dock.claim("actor_train", [RESPONSES.name], self.gbs * self.n - rows_held, min_count=self.n, timeout_s=600)
            if claim is None:
                raise RuntimeError(f"no complete groups within 600 s: {self.dock.stats()}")
            held.append(claim)
            rows_held += len(claim)
            self.lengths += [len(r) for r in claim.columns[RESPONSES.name]]
        seconds = time.perf_counter() - start
        for claim in held:
            self.dock.ack(claim.lease, claim.indexes)
        return seconds


def main() -> int:
    p = parser(__doc__, "max_split 1 and 4, GBS 4, n 4, 64 tokens, 3 repetitions (CI)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the Redis the runs' docks live in (default the local one)")
    p.add_argument("--splits", type=int, nargs="+", default=None, help="partial_rollout_max_split values (default 1 2 4; --quick 1 4)")
    p.add_argument("--gbs", type=int, default=None, help="prompts per iteration (default 16; --quick 4)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 8; --quick 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="response budget (default 128; --quick 64); each split must divide it")
    p.add_argument("--stop-chars", type=int, default=None,
                   help="how many byte tokens end a response (stop strings a, b, c, ...; default 10; --quick 8)")
    p.add_argument("--warmups", type=int, default=2, help="untimed iterations per run first (default 2)")
    args = p.parse_args()
    q = args.quick
    args.splits = args.splits or ([1, 4] if q else [1, 2, 4])
    args.gbs = args.gbs or (4 if q else 16)
    args.n = args.n or (4 if q else 8)
    args.max_tokens = args.max_tokens or (64 if q else 128)
    args.stop_chars = args.stop_chars or (8 if q else 10)
    reps = args.reps or (3 if q else 7)

    work = work_dir("partial")
    model = build_model(work / "model", TINY)
    prefix = f"bench-partial-{uuid.uuid4().hex[:8]}"
    progress(f"tiny model; max_split {args.splits}; GBS {args.gbs} x n {args.n}, max {args.max_tokens} tokens, "
             f"{args.stop_chars} stop tokens, {reps} reps after {args.warmups} warm-up iterations")
    trainers = {s: TrainerSide(args.redis_url, run_overrides(s, args, prefix)) for s in args.splits}
    replicas = []
    try:
        replicas = start_replicas(model, work, {f"split{s}": [*engine_overrides("cpu", 1, "float32"), *run_overrides(s, args, prefix)]
                                                for s in args.splits}, engine_env("cpu"), extra_args=("--dock", args.redis_url))
        times = {}
        for s, t in trainers.items():
            times.update(interleaved({f"max_split {s}": t.iteration}, reps, args.warmups, label=f"max_split {s}: "))
    finally:
        stop_all(replicas)
        for t in trainers.values():
            t.dock.destroy()

    print(machine_line())
    lengths = np.array(trainers[args.splits[0]].lengths)
    print(f"response lengths (max_split {args.splits[0]}, {len(lengths)} samples): median {statistics.median(lengths):.0f}, "
          f"p90 {np.percentile(lengths, 90):.0f}, at the max {np.mean(lengths >= args.max_tokens):.1%}")
    base = median(times[f"max_split {args.splits[0]}"])
    print(f"{'max_split':>10}{'median s/iter':>15}{'vs first':>10}   per-rep s")
    for s in args.splits:
        t = times[f"max_split {s}"]
        print(f"{s:>10}{median(t):>15.3f}{median(t) / base:>10.2f}   {' '.join(f'{x:.2f}' for x in t)}")
    for s in args.splits[1:]:
        ratio(f"iteration time max_split {s} / max_split {args.splits[0]}", median(times[f"max_split {s}"]) / base,
              at_most=GOAL if s == 4 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
