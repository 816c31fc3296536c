"""Every benchmark's `--quick` run still works: it exits 0 and prints each of its ratio lines.

The figures are not checked (a shared CI machine makes them noise); what is checked is that each
script runs its real paths end to end and reports the ratios it promises, so one repetition of each
path is enough (`--reps 1`). Each script starts its own servers once; nothing is shared between them.
"""
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.service, pytest.mark.slow]

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
RATIO = re.compile(r"^ratio (.+): (-?\d+\.\d+)", re.M)

# script -> the ratio lines its --quick run prints (labels as printed, before the colon)
EXPECTED = {
    "bench_rollout.py": [f"{api} / offline tokens/s at concurrency {c}" for c in (1, 8, 64) for api in ("gRPC", "HTTP")]
    + [f"HTTP / vllm serve tokens/s at concurrency {c}" for c in (1, 8, 64)],
    "bench_weight_sync.py": [label for b in ("1", "16") for label in (
        f"raw socket / push to 1 replica time, {b} MiB buckets",
        f"raw socket / collective push to 1 replica time, {b} MiB buckets",
        f"replica peak extra memory / bucket size, collective, {b} MiB buckets",
        f"push to 2 / push to 1 replica time, fanout, {b} MiB buckets",
        f"push to 2 / push to 1 replica time, chain, {b} MiB buckets",
        f"push to 2 / push to 1 replica time, collective, {b} MiB buckets")],
    "bench_weight_reload.py": ["raw socket / vLLM reload from memory time (the most a push can reach against the raw socket)"],
    "bench_dock.py": [f"dock / plain pipelines rows/s at GBS*n={rows}{rounds}" for rows in (256, 4096)
                      for rounds in ("", ", 2 admission rounds live")],
    "bench_partial_rollout.py": ["iteration time max_split 4 / max_split 1"],
    "bench_reward.py": ["reward service / in-process verifiers samples/s"],
    "bench_sandbox.py": ["sandbox service / bare subprocess time per execution, 1 in flight",
                         "sandbox service / bare subprocess executions/s at 4 in flight"],
    "bench_e2e.py": ["trainer waiting on rollout / iteration time", "dock time / iteration time",
                     *(f"dockrl / single-process reference ({engine}) iteration time"
                       for engine in ("HF generate", "vLLM offline generate"))],
    "bench_trainer_step.py": ["dockrl / plain train step time"],
    "bench_trainer.py": ["optimizer state per rank distributed / replicated at DP 2", "weight gather peak / model size",
                         "weight gather peak / bucket size", "trained tokens/s DP 2 / DP 1"],
    "bench_async.py": ["trained samples/s eta 1 / eta 0",
                       "predicted eta >= 1 / eta 0 with rollout and trainer on their own devices"],
    "trainer_logprobs.py": ["packed / padded log-prob pass time"],
    "bench_context_parallel.py": [f"{what} per rank {path} / cp1" for path in ("cp2-ulysses", "cp2-ring")
                                  for what in ("activation memory", "step peak resident added")]
    + [f"time per token {path} / cp1" for path in ("cp2-ulysses", "cp2-ring")],
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_quick_run_prints_its_ratios(script, redis_url):
    extra = ["--redis-url", redis_url] if script == "bench_partial_rollout.py" else []
    run = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--reps", "1", *extra], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{script} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    printed = dict(RATIO.findall(run.stdout))
    assert sorted(printed) == sorted(EXPECTED[script]), run.stdout[-3000:]
    assert all(float(v) > 0 for v in printed.values()), printed


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_help_shows_the_docstring_and_the_shared_flags(script):
    run = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "python bench/" in run.stdout  # the docstring's example commands
    assert "--quick" in run.stdout and "--reps" in run.stdout
