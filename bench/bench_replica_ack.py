"""What dock.min_replicas_acked costs: the dock's traffic on a primary with one replica, with and without WAIT.

    python bench/bench_replica_ack.py [--rows 256 4096] [--reps 5] [--small-puts 300]

Starts a private primary and replica (redis-server on free loopback ports, no persistence), then
runs one iteration's dock traffic (bench/bench_dock.py's: the trainer's prompts, the rollout,
reward and trainer claims and puts) with dock.min_replicas_acked 0 and 1 in turn, and times puts
of one group alone (the latency a single write sees). Prints medians.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import redis  # noqa: E402

from bench_dock import N, PROMPT_COLUMNS, BenchPool, IterationData, dock_iteration  # noqa: E402
from services.dock.client import Dock  # noqa: E402
from services.dock.schema import DockLayout  # noqa: E402
from tests.conftest import start_redis_server, stop_redis_server  # noqa: E402


def _dock(client: redis.Redis, rows: int, replicas: int) -> Dock:
    dock = Dock(client, f"ack-{uuid.uuid4().hex[:8]}", "run", poll_s=0.001, min_replicas_acked=replicas, replica_ack_timeout_s=5.0)
    dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=rows // N))
    return dock


def iterations(client: redis.Redis, rows: int, reps: int) -> dict[int, tuple[float, int]]:
    """Median seconds of one iteration and the dock writes it makes, per min_replicas_acked (0 and 1), interleaved."""
    data = IterationData.make(rows, 32, 64)
    docks = {k: _dock(client, rows, k) for k in (0, 1)}
    times: dict[int, list[float]] = {0: [], 1: []}
    writes = {}
    for rep in range(reps + 1):  # the first round warms up
        for k, dock in docks.items():
            before = dock.journal.writes
            seconds = dock_iteration(BenchPool(dock, 1, {}), data, claims=8)
            writes[k] = dock.journal.writes - before
            if rep:
                times[k].append(seconds)
    for dock in docks.values():
        dock.destroy()
    return {k: (statistics.median(times[k]), writes[k]) for k in times}


def small_puts(client: redis.Redis, count: int) -> dict[int, float]:
    """Median milliseconds of a put of one group's prompts, per min_replicas_acked."""
    data = IterationData.make(N, 32, 64)
    latencies: dict[int, list[float]] = {0: [], 1: []}
    docks = {k: _dock(client, N, k) for k in (0, 1)}
    for _ in range(count):
        for k, dock in docks.items():
            start = time.perf_counter()
            dock.put(list(range(N)), data.columns(PROMPT_COLUMNS, list(range(N))))
            latencies[k].append((time.perf_counter() - start) * 1000)
    for dock in docks.values():
        dock.destroy()
    return {k: statistics.median(v) for k, v in latencies.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 4096], help=f"GBS*n rows per iteration, multiples of {N}")
    parser.add_argument("--reps", type=int, default=5, help="timed iterations per setting")
    parser.add_argument("--small-puts", type=int, default=300, help="one-group puts timed per setting")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        primary, url = start_redis_server(pathlib.Path(tmp), "--appendonly", "no")
        replica_dir = pathlib.Path(tmp) / "replica"
        replica_dir.mkdir()
        port = url.rsplit(":", 1)[1].split("/")[0]
        replica, replica_url = start_redis_server(replica_dir, "--appendonly", "no", "--replicaof", "127.0.0.1", port)
        try:
            client = redis.Redis.from_url(url, socket_timeout=30)
            follower = redis.Redis.from_url(replica_url)
            while follower.info("replication").get("master_link_status") != "up":
                time.sleep(0.05)
            for rows in args.rows:
                result = iterations(client, rows, args.reps)
                (t0, w0), (t1, _) = result[0], result[1]
                print(f"{rows} rows: {t0:.3f} s without WAIT, {t1:.3f} s with min_replicas_acked=1 ({t1 / t0:.2f}x); "
                      f"{w0} dock writes, {(t1 - t0) / w0 * 1000:.2f} ms more per write")
            latency = small_puts(client, args.small_puts)
            print(f"one-group put: p50 {latency[0]:.2f} ms without WAIT, {latency[1]:.2f} ms with min_replicas_acked=1")
        finally:
            stop_redis_server(replica)
            stop_redis_server(primary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
