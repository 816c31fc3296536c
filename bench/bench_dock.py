"""The dock's traffic for one GRPO iteration vs. plain redis-py pipelines moving the same bytes.

One iteration of a run, as the services do it through `services.dock.client.Dock` (real Redis,
real Lua scripts), at GBS*n rows:
  1. trainer: begin_iteration, put the prompts (prompts, prompt_length, labels)
  2. rollout workers: claim prompts, put responses, response_length, rollout_log_probs, versions, finish_reason
  3. reward workers: claim prompts, responses, response_length, labels; put rm_scores
  4. trainer: claim prompts, responses, rm_scores, rollout_log_probs, versions; ack
Workers claim in `--claims` dispatches per consumer (as that many replicas would). The baseline is
what a person would write instead: SET every encoded value in one pipeline per step and MGET the
same values back in the same chunks, with no flags, leases or checks. The two run side by side,
interleaved, on a private redis-server (the shared one is left alone); figures are medians.

A third path runs the same iteration on a pool that keeps `--live-rounds` admission rounds (default
2), as asynchronous RL with max_staleness >= 1 does: the older rounds' prompts wait in the pool,
each consumer takes one round's rows, oldest first, and claims walk the admission order (claim.lua's
several-rounds path) instead of the one-round bitmap path. It moves the same bytes as the others.

Prints put+claim rows/s of both and the dock's per-iteration overhead over plain pipelines (goal:
dock rows/s >= 0.8 of plain, for both dock paths). The share of a real iteration's wall time spent in the dock (goal
< 2%) is measured by bench/bench_e2e.py, which runs this same iteration at the tiny run's size
next to a real run.

Two more parts, on the same Redis:
  - many consumers: 1, 4, 16 claimer processes of one consumer (actor_rollout) empty one pool,
    each a worker's loop (claim prompts, put a result under the lease); rows/s, claims/s and
    p50 / p99 claim latency per count, interleaved; asserts no row was claimed twice or lost and
    each row kept its own claimer's result.
  - memory: Redis used_memory over --memory-iterations iterations of the traffic above, with the
    pool full (before the trained rows are retired) and empty (after begin_iteration retired them),
    and the memory one in-flight row takes.

    python bench/bench_dock.py --quick                # 256 and 4096 rows, short sequences (CI)
    python bench/bench_dock.py                        # 256, 4096, 32768 rows; 128-token prompts, 256-token responses
    python bench/bench_dock.py --redis-url redis://127.0.0.1:6379/0   # an existing Redis instead of a private one
    python bench/bench_dock.py --profile --rows 4096  # where one iteration's time goes (docs/dock.md), then exit
"""
from __future__ import annotations

import contextlib
import multiprocessing
import sys
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from common import interleaved, machine_line, median, paired, parser, private_redis, progress, ratio, work_dir
from services.dock.rows import ScoredSample, names
from services.dock.schema import (FINISH_REASON, LABELS, PROMPT_LENGTH, PROMPTS, RESPONSE_LENGTH, RESPONSES, RM_SCORES,
                                  ROLLOUT_LOG_PROBS, VERSIONS)

N = 8  # samples per prompt
PROMPT_COLUMNS = (PROMPTS.name, PROMPT_LENGTH.name, LABELS.name)
ROLLOUT_COLUMNS = (RESPONSES.name, RESPONSE_LENGTH.name, ROLLOUT_LOG_PROBS.name, VERSIONS.name, FINISH_REASON.name)
REWARD_READS = (PROMPTS.name, RESPONSES.name, RESPONSE_LENGTH.name, LABELS.name)
TRAIN_READS = tuple(names(ScoredSample.COLUMNS))  # what the trainer's claims take


@dataclass
class IterationData:
    """Every value one iteration puts, per column, one per row ([rows] lists)."""

    rows: int
    values: dict[str, list]

    @classmethod
    def make(cls, rows: int, prompt_len: int, response_len: int, seed: int = 0) -> IterationData:
        """Random token ids and floats: `prompt_len`-token prompts, responses of 1..`response_len` tokens."""
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, response_len + 1, rows)
        return cls(rows, {
            PROMPTS.name: [rng.integers(0, 32000, prompt_len, dtype=np.int32) for _ in range(rows)],
            PROMPT_LENGTH.name: [prompt_len] * rows,
            LABELS.name: [str(v) for v in rng.integers(0, 100, rows)],
            RESPONSES.name: [rng.integers(0, 32000, n, dtype=np.int32) for n in lengths],
            RESPONSE_LENGTH.name: [int(n) for n in lengths],
            ROLLOUT_LOG_PROBS.name: [rng.standard_normal(n, dtype=np.float32) for n in lengths],
            VERSIONS.name: [np.zeros(n, np.int32) for n in lengths],
            FINISH_REASON.name: ["stop"] * rows,
            RM_SCORES.name: [float(v) for v in rng.random(rows)],
        })

    def columns(self, names, rows: list[int], origin: dict[int, int] | None = None) -> dict[str, list]:
        """The values of `names` for pool rows `rows` (`origin`: pool row -> the data row admitted there; default the same row), as a put takes them."""
        return {name: [self.values[name][origin[r] if origin else r] for r in rows] for name in names}


@dataclass
class BenchPool:
    """A dock under test and, per pool row, the data row admitted into it (slots are reused as groups retire)."""

    dock: object
    live_rounds: int  # admission rounds in the pool at once (1: each iteration's rows are trained before the next come)
    origin: dict[int, int]
    round_of: dict[int, int] = field(default_factory=dict)  # pool row -> the admission (1, 2, ...) that put it
    admitted: int = 0  # admissions so far


def claims_of(dock, consumer: str, columns, dispatch: int, limit: int | None):
    """`consumer`'s claims in turn: until one comes back empty (limit None: how a worker learns the pool is
    drained), or until they took `limit` rows (the pool holds younger rounds that later iterations take)."""
    taken = 0
    while limit is None or taken < limit:
        claim = dock.claim(consumer, columns, dispatch)
        if claim is None:
            return
        taken += len(claim)
        yield claim


def admit(pool: BenchPool, data: IterationData) -> None:
    """The trainer's start of an iteration: begin_iteration (retires the trained groups), prompts into GBS free slots."""
    groups = pool.dock.begin_iteration(data.rows // N)[:data.rows // N]
    put_rows = pool.dock.rows_of(groups)
    pool.origin.update(zip(put_rows, range(data.rows)))
    pool.admitted += 1
    pool.round_of.update(dict.fromkeys(put_rows, pool.admitted))
    pool.dock.put(put_rows, data.columns(PROMPT_COLUMNS, put_rows, pool.origin))


def dock_iteration(pool: BenchPool, data: IterationData, claims: int) -> float:
    """Seconds for one iteration's dock calls, every consumer in turn (the sum of what all services spend in the dock).

    With one live round every consumer claims until the pool has nothing for it. With more, the pool
    also holds the older rounds new_pool admitted (asynchronous RL with max_staleness >= 1), each
    consumer takes one round's rows, oldest first, and claims walk the admission order (claim.lua)
    instead of the one-round bitmap path.
    """
    rows, dock = data.rows, pool.dock
    dispatch = max(N, rows // claims // N * N)
    limit = rows if pool.live_rounds > 1 else None
    start = time.perf_counter()
    admit(pool, data)
    oldest = pool.admitted - pool.live_rounds + 1  # every consumer takes this round's rows (claims go oldest first)
    for c in claims_of(dock, "actor_rollout", [PROMPTS.name], dispatch, limit):
        assert all(pool.round_of[r] == oldest for r in c.indexes), "a rollout claim took a younger round's rows first"
        dock.put(c.indexes, data.columns(ROLLOUT_COLUMNS, c.indexes, pool.origin), lease=c.lease, version=0)
    for c in claims_of(dock, "rule_reward", REWARD_READS, dispatch, limit):
        dock.put(c.indexes, data.columns((RM_SCORES.name,), c.indexes, pool.origin), lease=c.lease)
    taken = 0
    for c in claims_of(dock, "actor_train", TRAIN_READS, dispatch, limit):
        dock.ack(c.lease, c.indexes)
        taken += len(c)
    seconds = time.perf_counter() - start
    assert taken == rows, f"the trainer claimed {taken} of {rows} rows"
    return seconds


def plain_iteration(client, prefix: str, blobs: dict[str, list[bytes]], claims: int) -> float:
    """Seconds to SET and MGET the same encoded values in the same steps and chunks, with plain pipelines."""
    rows = len(blobs[PROMPTS.name])
    dispatch = max(N, rows // claims // N * N)
    chunks = [range(first, min(first + dispatch, rows)) for first in range(0, rows, dispatch)]

    def key(column: str, row: int) -> str:
        return f"{prefix}:{column}:{row}"

    def write(columns, row_range) -> None:
        pipe = client.pipeline(transaction=False)
        for name in columns:
            for r in row_range:
                pipe.set(key(name, r), blobs[name][r])
        pipe.execute()

    def read(columns, row_range) -> int:
        pipe = client.pipeline(transaction=False)
        for name in columns:
            pipe.mget([key(name, r) for r in row_range])
        return sum(len(v) for reply in pipe.execute() for v in reply)

    start = time.perf_counter()
    write(PROMPT_COLUMNS, range(rows))
    for chunk in chunks:
        read((PROMPTS.name,), chunk)
        write(ROLLOUT_COLUMNS, chunk)
    for chunk in chunks:
        read(REWARD_READS, chunk)
        write((RM_SCORES.name,), chunk)
    got = sum(read(TRAIN_READS, chunk) for chunk in chunks)
    seconds = time.perf_counter() - start
    assert got == sum(len(b) for name in TRAIN_READS for b in blobs[name])
    client.delete(*[key(name, r) for name in blobs for r in range(rows)])
    return seconds


def new_dock(client, rows: int, capacity_rows: int | None = None):
    """A dock of `capacity_rows` rows (default `rows`, GBS*n) with the default columns under a fresh prefix."""
    from services.dock.client import Dock
    from services.dock.schema import DockLayout

    dock = Dock(client, f"bench-{uuid.uuid4().hex[:8]}", "run", poll_s=0.001)
    dock.create(DockLayout(n_samples_per_prompt=N, capacity_groups=(capacity_rows or rows) // N))
    return dock


def new_pool(client, data: IterationData, live_rounds: int) -> BenchPool:
    """A pool of `live_rounds` x GBS groups, the `live_rounds` - 1 older rounds admitted (prompts waiting for rollout)."""
    pool = BenchPool(new_dock(client, data.rows, live_rounds * data.rows), live_rounds, {})
    for _ in range(live_rounds - 1):
        admit(pool, data)
    return pool


def measure(client, rows: int, prompt_len: int, response_len: int, claims: int, reps: int, live_rounds: int) -> dict[str, list[float]]:
    """Interleaved dock and plain iterations at `rows` rows (and, live_rounds > 1, the dock with that many rounds live); seconds per path."""
    from services.dock import codec

    data = IterationData.make(rows, prompt_len, response_len)
    blobs = {name: [codec.encode(codec.to_array(v, spec_dtype(name), name)) for v in values] for name, values in data.values.items()}
    pools = {"dock": new_pool(client, data, 1)}
    if live_rounds > 1:
        pools["rounds"] = new_pool(client, data, live_rounds)
    paths = {name: (lambda pool=pool: dock_iteration(pool, data, claims)) for name, pool in pools.items()}
    paths["plain"] = lambda: plain_iteration(client, pools["dock"].dock.keys.base + "plain", blobs, claims)
    try:
        return interleaved(paths, reps, warmups=1, label=f"{rows} rows: ")
    finally:
        for pool in pools.values():
            pool.dock.destroy()


def claimer(url: str, prefix: str, dispatch: int, worker: int, start, results) -> None:
    """One worker process: claims prompts until the pool is empty, puts its id as each row's result; sends (rows, latencies)."""
    import redis

    from services.common.config import DockConfig
    from services.dock.client import Dock

    dock = Dock(redis.Redis.from_url(url, socket_timeout=DockConfig.socket_timeout_s), prefix, "run")
    dock.layout  # read before the start, so every worker begins claiming at once
    start.wait()
    taken, latencies = [], []
    while True:
        began = time.perf_counter()
        claim = dock.claim("actor_rollout", [PROMPTS.name], dispatch)
        if claim is None:
            break
        latencies.append(time.perf_counter() - began)
        dock.put(claim.indexes, {RESPONSE_LENGTH.name: [worker] * len(claim)}, lease=claim.lease)
        taken += claim.indexes
    results.put((worker, taken, latencies))


def concurrent_claims(client, url: str, rows: int, prompt_len: int, claimers: int, dispatch: int) -> tuple[float, list[float]]:
    """`claimers` processes empty a pool of `rows` prompts; returns (seconds, claim latencies) after checking every row went to exactly one."""
    data = IterationData.make(rows, prompt_len, 1)
    dock = new_dock(client, rows)
    try:
        all_rows = list(range(rows))
        dock.put(all_rows, {PROMPTS.name: data.values[PROMPTS.name]})
        ctx = multiprocessing.get_context("fork")
        start, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=claimer, args=(url, dock.keys.prefix, dispatch, w, start, results)) for w in range(claimers)]
        for p in procs:
            p.start()
        time.sleep(0.2)  # let every worker connect and read the layout before the clock starts
        began = time.perf_counter()
        start.set()
        got = [results.get(timeout=600) for _ in procs]
        seconds = time.perf_counter() - began
        for p in procs:
            p.join()
        taken = [row for _, worker_rows, _ in got for row in worker_rows]
        assert len(taken) == len(set(taken)), f"{claimers} claimers: {len(taken) - len(set(taken))} rows claimed twice"
        assert sorted(taken) == all_rows, f"{claimers} claimers: {rows - len(set(taken))} rows never claimed"
        owner = {row: w for w, worker_rows, _ in got for row in worker_rows}
        stored = dock.read(all_rows, [RESPONSE_LENGTH.name])[RESPONSE_LENGTH.name]
        assert all(int(v) == owner[row] for row, v in zip(all_rows, stored)), "a row kept another claimer's result"
        stats = dock.stats()
        assert stats.leased["actor_rollout"] == 0 and stats.unaccounted_rows() == 0, stats
        return seconds, [t for _, _, latencies in got for t in latencies]
    finally:
        dock.destroy()


def measure_claimers(client, url: str, rows: int, prompt_len: int, counts: list[int], dispatch: int, reps: int):
    """Interleaved rounds at each claimer count; per count, seconds per timed round and the latencies of its claims."""
    rounds: dict[int, list[list[float]]] = {k: [] for k in counts}  # per count, each round's claim latencies

    def round_at(k: int):
        def run() -> float:
            seconds, latencies = concurrent_claims(client, url, rows, prompt_len, k, dispatch)
            rounds[k].append(latencies)
            return seconds
        return run

    warmups = 1
    times = interleaved({str(k): round_at(k) for k in counts}, reps, warmups=warmups, label=f"{rows} rows, claimers: ")
    return {k: (times[str(k)], [t for latencies in rounds[k][warmups:] for t in latencies]) for k in counts}


def measure_memory(client, rows: int, prompt_len: int, response_len: int, claims: int, iterations: int) -> dict[str, list[int]]:
    """Redis used_memory (bytes) and key count over `iterations` iterations, with the pool full and after retiring."""
    from services.dock import codec

    data = IterationData.make(rows, prompt_len, response_len)
    found = {"before": [client.info("memory")["used_memory"]], "full": [], "retired": [], "keys": [],
             "payload": [sum(len(codec.encode(codec.to_array(v, spec_dtype(name), name)))
                             for name, values in data.values.items() for v in values)]}
    pool = new_pool(client, data, 1)
    dock = pool.dock
    try:
        for i in range(iterations):
            dock_iteration(pool, data, claims)
            found["full"].append(client.info("memory")["used_memory"])
            dock.begin_iteration(rows // N)  # retires the trained groups, as the next iteration's start does
            found["retired"].append(client.info("memory")["used_memory"])
            found["keys"].append(client.dbsize())
            if (i + 1) % max(1, iterations // 5) == 0:
                progress(f"memory: iteration {i + 1}/{iterations}: full {found['full'][-1] / 2**20:.2f} MiB, "
                         f"retired {found['retired'][-1] / 2**20:.2f} MiB, {found['keys'][-1]} keys")
        stats = dock.stats()
        assert stats.live_rows == 0 and stats.unaccounted_rows() == 0, stats
    finally:
        dock.destroy()
    return found


def spec_dtype(column: str) -> str:
    """The dtype the dock's default layout gives `column` (the baseline encodes values as the dock does)."""
    from services.dock.schema import DEFAULT_COLUMNS

    return next(c.dtype for c in DEFAULT_COLUMNS if c.name == column)


def profile(client, rows: int, prompt_len: int, response_len: int, claims: int) -> None:
    """One dock and one plain iteration after a warm-up: Redis's time per command (INFO commandstats) and the client's top functions (cProfile)."""
    import cProfile
    import pstats

    from services.dock import codec

    data = IterationData.make(rows, prompt_len, response_len)
    blobs = {name: [codec.encode(codec.to_array(v, spec_dtype(name), name)) for v in values] for name, values in data.values.items()}
    pool = new_pool(client, data, 1)
    dock = pool.dock
    try:
        dock_iteration(pool, data, claims)
        plain_iteration(client, dock.keys.base + "plain", blobs, claims)
        for name, run in (("plain", lambda: plain_iteration(client, dock.keys.base + "plain", blobs, claims)),
                          ("dock", lambda: dock_iteration(pool, data, claims))):
            client.config_resetstat()
            profiler = cProfile.Profile()
            seconds = profiler.runcall(run)
            stats = client.info("commandstats")
            print(f"\n{name}: {seconds:.3f} s at {rows} rows (under cProfile); Redis's time: "
                  f"{sum(v['usec'] for v in stats.values()) / 1e6:.3f} s")
            for command, v in sorted(stats.items(), key=lambda kv: -kv[1]["usec"])[:10]:
                print(f"  {command.removeprefix('cmdstat_'):>16} {v['calls']:>8} calls {v['usec'] / 1e3:>9.1f} ms")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    finally:
        dock.destroy()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def main() -> int:
    p = parser(__doc__, "256 and 4096 rows, 32-token prompts, 64-token responses, 3 repetitions; "
                        "1024-row claimer rounds; 20 memory iterations of 256 rows (CI)")
    p.add_argument("--redis-url", default="", help="measure against this Redis (default: start a private redis-server on a free port)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="GBS*n rows per iteration (default 256 4096 32768; --quick 256 4096)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; --quick 32)")
    p.add_argument("--response-len", type=int, default=None, help="longest response; lengths are uniform in [1, this] (default 256; --quick 64)")
    p.add_argument("--live-rounds", type=int, default=2, help="admission rounds the second dock path keeps in the pool, as asynchronous RL "
                   "with max_staleness >= 1 does (claims then walk the admission order); 1: leave that path out (default 2)")
    p.add_argument("--claims", type=int, default=8, help="claims per consumer per iteration, as that many workers would take (default 8)")
    p.add_argument("--claimers", type=int, nargs="+", default=[1, 4, 16], help="concurrent claimer processes to compare (default 1 4 16)")
    p.add_argument("--claim-rows", type=int, default=None, help="rows the claimers empty per round (default 8192; --quick 1024)")
    p.add_argument("--dispatch", type=int, default=32, help="rows per claim in the claimer rounds (default 32)")
    p.add_argument("--memory-iterations", type=int, default=None, help="iterations of the memory run (default 200; --quick 20)")
    p.add_argument("--memory-rows", type=int, default=None, help="GBS*n of the memory run (default 1024; --quick 256)")
    p.add_argument("--profile", action="store_true", help="profile one iteration at the first --rows (Redis per command, client per function) and exit")
    args = p.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    sizes = args.rows or ([256, 4096] if args.quick else [256, 4096, 32768])
    prompt_len = args.prompt_len or (32 if args.quick else 128)
    response_len = args.response_len or (64 if args.quick else 256)
    claim_rows = args.claim_rows or (1024 if args.quick else 8192)
    memory_iterations = args.memory_iterations or (20 if args.quick else 200)
    memory_rows = args.memory_rows or (256 if args.quick else 1024)
    if any(r % N for r in [*sizes, claim_rows, memory_rows, args.dispatch]):
        p.error(f"--rows, --claim-rows, --memory-rows, --dispatch: each must be a multiple of n={N}")
    if args.live_rounds < 1:
        p.error("--live-rounds must be >= 1")

    import redis

    from services.common.config import DockConfig

    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(private_redis(work_dir("dock")))
        # the services' socket timeout (dock.socket_timeout_s): a Redis call that blocks longer fails here as it would there
        client = redis.Redis.from_url(url, socket_timeout=DockConfig.socket_timeout_s)
        progress(f"redis {url}; rows {sizes}, {prompt_len}-token prompts, responses 1..{response_len} tokens, "
                 f"{args.claims} claims per consumer, {reps} reps")
        if args.profile:
            profile(client, sizes[0], prompt_len, response_len, args.claims)
            return 0
        results = {rows: measure(client, rows, prompt_len, response_len, args.claims, reps, args.live_rounds) for rows in sizes}
        claimers = measure_claimers(client, url, claim_rows, prompt_len, args.claimers, args.dispatch, reps)
        memory = measure_memory(client, memory_rows, prompt_len, response_len, args.claims, memory_iterations)

    print(machine_line())
    print(f"{'GBS*n':>7}{'dock s/iter':>13}{'plain s/iter':>14}{'dock rows/s':>13}{'plain rows/s':>14}{'overhead s/iter':>17}"
          + (f"{f'dock s/iter, {args.live_rounds} rounds':>24}" if args.live_rounds > 1 else ""))
    for rows, times in results.items():
        d, q = median(times["dock"]), median(times["plain"])
        print(f"{rows:>7}{d:>13.3f}{q:>14.3f}{rows / d:>13,.0f}{rows / q:>14,.0f}{d - q:>17.3f}"
              + (f"{median(times['rounds']):>24.3f}" if args.live_rounds > 1 else ""))
    print(f"\nclaimers emptying {claim_rows} rows in claims of {args.dispatch} (claim, then put under the lease); "
          "no row twice, none lost, each kept its claimer's result")
    print(f"{'claimers':>9}{'s/round':>10}{'rows/s':>10}{'claims/s':>10}{'p50 ms':>9}{'p99 ms':>9}")
    for k, (seconds, latencies) in claimers.items():
        t = median(seconds)
        print(f"{k:>9}{t:>10.3f}{claim_rows / t:>10,.0f}{claim_rows / args.dispatch / t:>10,.0f}"
              f"{1e3 * percentile(latencies, 50):>9.2f}{1e3 * percentile(latencies, 99):>9.2f}")
    full, retired = memory["full"], memory["retired"]
    per_row = (median(full) - median(retired)) / memory_rows
    print(f"\nmemory over {memory_iterations} iterations of {memory_rows} rows: used_memory before the dock "
          f"{memory['before'][0] / 2**20:.2f} MiB; pool full {full[0] / 2**20:.2f} -> {full[-1] / 2**20:.2f} MiB "
          f"(max {max(full) / 2**20:.2f}); retired {retired[0] / 2**20:.2f} -> {retired[-1] / 2**20:.2f} MiB "
          f"(max {max(retired) / 2**20:.2f}); keys after retiring {min(memory['keys'])}..{max(memory['keys'])}")
    print(f"memory per in-flight row: {per_row:,.0f} bytes (encoded values {memory['payload'][0] / memory_rows:,.0f} bytes a row)")
    for rows, times in results.items():
        ratio(f"dock / plain pipelines rows/s at GBS*n={rows}", paired(times, "plain", "dock"), at_least=0.8)
    for rows, times in results.items():
        if args.live_rounds > 1:
            ratio(f"dock / plain pipelines rows/s at GBS*n={rows}, {args.live_rounds} admission rounds live",
                  paired(times, "plain", "rounds"), at_least=0.8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
