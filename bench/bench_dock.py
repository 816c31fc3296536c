"""Dock put + claim throughput vs. plain redis-py SET/GET pipelines moving the same bytes.

One iteration's worth of rows (GBS * n = 4096) with 6 columns goes into the dock in one put and
comes out in claims of `--dispatch` rows; the baseline SETs the same encoded values under one
key each in a pipeline and GETs them back. Both run side by side in each repetition; the
figures are medians.

    python -m bench.bench_dock --quick            # 3 repetitions, shorter sequences
    python -m bench.bench_dock --redis-url redis://127.0.0.1:6379/0
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid

import numpy as np
import redis

from services.dock import codec
from services.dock.client import Dock
from services.dock.schema import ColumnSpec, DockLayout

GBS, N = 512, 8  # 4096 rows
COLUMNS = (
    ColumnSpec("prompts", "int32", (None,)),
    ColumnSpec("responses", "int32", (None,)),
    ColumnSpec("rollout_log_probs", "float32", (None,)),
    ColumnSpec("old_log_prob", "float32", (None,)),
    ColumnSpec("advantages", "float32", (None,)),
    ColumnSpec("rm_scores", "float32"),
)


def make_rows(prompt_len: int, response_len: int, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Per column, one value per row: token ids and per-token floats, plus a scalar score."""
    rng = np.random.default_rng(seed)
    rows = GBS * N
    tokens = lambda length: [rng.integers(0, 32000, length, dtype=np.int32) for _ in range(rows)]  # noqa: E731
    floats = lambda: [rng.standard_normal(response_len, dtype=np.float32) for _ in range(rows)]  # noqa: E731
    return {
        "prompts": tokens(prompt_len), "responses": tokens(response_len), "rollout_log_probs": floats(),
        "old_log_prob": floats(), "advantages": floats(), "rm_scores": [np.float32(v) for v in rng.random(rows)],
    }


def run_dock(dock: Dock, values: dict[str, list[np.ndarray]], dispatch: int) -> float:
    """Seconds for one put of every row and claims of `dispatch` rows until the pool is drained."""
    dock.clear()
    rows = list(range(GBS * N))
    start = time.perf_counter()
    dock.put(rows, values)
    taken = 0
    while (claim := dock.claim("actor_train", list(values), dispatch)) is not None:
        taken += len(claim)
        dock.ack(claim.lease, claim.indexes)
    elapsed = time.perf_counter() - start
    assert taken == len(rows), f"claimed {taken} of {len(rows)} rows"
    return elapsed


def run_plain(client: redis.Redis, prefix: str, blobs: list[bytes], dispatch_values: int) -> float:
    """Seconds to SET every blob in one pipeline and GET them back in pipelines of the dock's claim size."""
    keys = [f"{prefix}:plain:{i}" for i in range(len(blobs))]
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for key, blob in zip(keys, blobs):
        pipe.set(key, blob)
    pipe.execute()
    got = 0
    for first in range(0, len(keys), dispatch_values):
        pipe = client.pipeline(transaction=False)
        for key in keys[first:first + dispatch_values]:
            pipe.get(key)
        got += sum(len(b) for b in pipe.execute())
    elapsed = time.perf_counter() - start
    assert got == sum(len(b) for b in blobs)
    client.delete(*keys)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis to measure against")
    parser.add_argument("--quick", action="store_true", help="3 repetitions with 128 prompt / 256 response tokens")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 7, or 3 with --quick)")
    parser.add_argument("--dispatch", type=int, default=256, help="rows per claim (a multiple of n=8; default 256)")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 7)
    prompt_len, response_len = (128, 256) if args.quick else (256, 1024)

    client = redis.Redis.from_url(args.redis_url)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    dock = Dock(client, prefix, "run")
    dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=GBS, columns=COLUMNS))
    values = make_rows(prompt_len, response_len)
    blobs = [codec.encode(v) for name in values for v in values[name]]
    total_mb = sum(len(b) for b in blobs) / 1e6
    print(f"{GBS * N} rows x {len(COLUMNS)} columns, {total_mb:.1f} MB per pass, claims of {args.dispatch} rows, {reps} reps")
    dock_s, plain_s = [], []
    try:
        for rep in range(reps):
            dock_s.append(run_dock(dock, values, args.dispatch))
            plain_s.append(run_plain(client, prefix, blobs, args.dispatch * len(COLUMNS)))
            print(f"  rep {rep + 1}/{reps}: dock {dock_s[-1]:.3f} s, plain SET/GET {plain_s[-1]:.3f} s", flush=True)
    finally:
        dock.destroy()
    d, p = statistics.median(dock_s), statistics.median(plain_s)
    rows = GBS * N
    print(f"dock put+claim : {d:.3f} s  {rows / d:,.0f} rows/s  {total_mb / d:,.0f} MB/s")
    print(f"plain SET/GET  : {p:.3f} s  {rows / p:,.0f} rows/s  {total_mb / p:,.0f} MB/s")
    print(f"ratio dock/plain throughput: {p / d:.2f} (of medians); {statistics.median(q / e for q, e in zip(plain_s, dock_s)):.2f} "
          "(median of per-rep ratios, steadier on a loaded machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
