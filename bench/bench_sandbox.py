"""A small test program through the sandbox service against a bare subprocess running the same program.

The service path is the real one: a client on loopback, Sandbox.Execute, the server's worker pool, each program
under bubblewrap with its rlimits (services/sandbox/runner.py). The bare path is `subprocess.run([python3, -I, -B,
-c, program])` with no isolation. Both run the system's python3 with the program on a small stdin, one at a time
(the per-execution overhead in ms) and `--in-flight` at a time (executions/s; p50 / p99 latency). Rounds of the
paths are interleaved; times are medians, ratios the median of per-round ratios. Every execution's output is checked.

    python bench/bench_sandbox.py --quick      # 16 executions per round, 3 rounds (CI)
    python bench/bench_sandbox.py              # 64 executions per round, 5 rounds
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from common import interleaved, machine_line, paired, parser, progress, ratio

from services.common.config import config_from_dict
from services.common.sandbox_client import ExecStatus, Program, SandboxClient
from services.sandbox.server import start_server

PROGRAM = "import sys\nnumbers = [int(x) for x in sys.stdin.read().split()]\nprint(sum(numbers), max(numbers))"
STDIN = b" ".join(str(i).encode() for i in range(1000))
EXPECTED = b"499500 999\n"


def main() -> int:
    p = parser(__doc__, "16 executions per round, 3 rounds (default 64 executions, 5 rounds)")
    p.add_argument("--executions", type=int, help="executions per round and path (default 64; --quick 16)")
    p.add_argument("--in-flight", type=int, default=4, help="executions at once in the concurrent paths (default 4)")
    args = p.parse_args()
    count = args.executions or (16 if args.quick else 64)
    reps = args.reps or (3 if args.quick else 5)
    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": 2}, "sandbox": {"workers": args.in_flight, "queue": args.in_flight}})
    interpreter = cfg.sandbox.interpreter
    latencies: dict[str, list[float]] = {}
    wrong: list[str] = []

    def bare_one() -> float:
        started = time.perf_counter()
        run = subprocess.run([interpreter, "-I", "-B", "-c", PROGRAM], input=STDIN, capture_output=True, timeout=60)
        if run.stdout != EXPECTED:
            wrong.append(f"bare: {run.stdout!r} {run.stderr[-200:]!r}")
        return time.perf_counter() - started

    def served_one(client: SandboxClient) -> float:
        started = time.perf_counter()
        result = client.execute(Program(PROGRAM, STDIN))
        if result.status is not ExecStatus.OK or result.stdout != EXPECTED:
            wrong.append(f"service: {result.status.value} {result.reason} {result.stdout!r} {result.stderr[-200:]!r}")
        return time.perf_counter() - started

    def round_of(name: str, one, in_flight: int):
        def run() -> float:
            started = time.perf_counter()
            with ThreadPoolExecutor(in_flight) as threads:
                latencies.setdefault(name, []).extend(threads.map(lambda _: one(), range(count)))
            return time.perf_counter() - started
        return run

    server = start_server(cfg, "127.0.0.1", 0)
    try:
        with SandboxClient(f"127.0.0.1:{server.port}") as client:
            paths = {
                "bare 1": round_of("bare 1", bare_one, 1),
                "service 1": round_of("service 1", lambda: served_one(client), 1),
                f"bare {args.in_flight}": round_of(f"bare {args.in_flight}", bare_one, args.in_flight),
                f"service {args.in_flight}": round_of(f"service {args.in_flight}", lambda: served_one(client), args.in_flight),
            }
            times = interleaved(paths, reps)
    finally:
        server.stop()

    print(machine_line())
    print(f"sandbox bench: {count} executions per round, {reps} rounds, {args.in_flight} in flight; interpreter {interpreter}")
    for name, seconds in times.items():
        lat = sorted(latencies[name])
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"  {name:>10} in flight: {count / statistics.median(seconds):7.1f} executions/s   "
              f"p50 {statistics.median(lat) * 1000:6.1f} ms   p99 {p99 * 1000:6.1f} ms")
    overhead = (statistics.median(times["service 1"]) - statistics.median(times["bare 1"])) / count * 1000
    print(f"  per-execution overhead of the service, one at a time: {overhead:.1f} ms")
    print(f"  wrong outputs: {len(wrong)}" + (f" (first: {wrong[0]})" if wrong else ""))
    ratio("sandbox service / bare subprocess time per execution, 1 in flight", paired(times, "service 1", "bare 1"))
    ratio(f"sandbox service / bare subprocess executions/s at {args.in_flight} in flight",
          paired(times, f"bare {args.in_flight}", f"service {args.in_flight}"), at_least=0.5)
    progress("done")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
