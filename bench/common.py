"""What every benchmark shares: flags, the models it builds, rollout replicas, interleaved timing, and
how ratios are printed.

Every script measures its paths side by side in one run: the repetitions are interleaved (A, B,
C, A, B, C, ...) so load from other jobs on the machine hits every path alike; times and rates
are medians, and a ratio of two interleaved paths is the median of their per-repetition ratios.
Each ratio is printed on a line of its own that starts with `ratio ` (tests/service/
test_bench_quick.py looks for them), with the issue's goal and whether this run met it.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/x.py` as well as `python -m bench.x`
    sys.path.insert(0, str(REPO))
# The local replica launcher lives with the tests' harness (code only tests and benchmarks use stays out of services/).
if str(REPO / "tests" / "service") not in sys.path:
    sys.path.insert(0, str(REPO / "tests" / "service"))

DEVICES = ("cpu", "cuda")
# vLLM on CPU: 1 GiB of KV cache is plenty for these models; `nobind` lets several engines and the
# benchmark share the cores; PASSIVE makes an idle engine's OpenMP threads sleep instead of spinning
# on the cores the measured path needs.
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
_STARTED = time.monotonic()


# ---------------------------------------------------------------- flags and printing


def parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """An argument parser whose --help shows the script's docstring, with --quick and --reps."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per path (medians are reported; default: see --quick)")
    return p


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """--device: the same benchmark on CPU (vllm-cpu, the default) or on an NVIDIA GPU."""
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cpu: vllm-cpu and a small model; cuda: vLLM on the GPU with a Qwen2.5-0.5B-size random-init model (default cpu)")


def progress(message: str) -> None:
    """A progress line with the seconds since the script started (long work shows it is moving)."""
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {message}", flush=True)


def ratio(label: str, value: float, at_most: float | None = None, at_least: float | None = None) -> None:
    """Prints `ratio <label>: <value>` and, where the issue sets a goal for it, the goal and whether this run met it."""
    goal = ""
    if at_most is not None:
        goal = f"   goal <= {at_most} ({'met' if value <= at_most else 'NOT met'})"
    elif at_least is not None:
        goal = f"   goal >= {at_least} ({'met' if value >= at_least else 'NOT met'})"
    print(f"ratio {label}: {value:.3f}{goal}", flush=True)


def median(values: Sequence[float]) -> float:
    """The median of one path's repetitions."""
    return statistics.median(values)


def paired(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over repetitions of numerator[i] / denominator[i]: the two ran back to back in the
    same repetition, so drift in the machine's load cancels (steadier than a ratio of medians)."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def interleaved(paths: dict[str, Callable[[], float]], reps: int, warmups: int = 1, label: str = "") -> dict[str, list[float]]:
    """Runs each path once per repetition, in turn, `warmups` untimed rounds first; seconds per path.

    A path returns the seconds it measured itself (so set-up inside it is not counted).
    """
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(warmups + reps):
        for name, run in paths.items():
            seconds = run()
            if rep >= warmups:
                times[name].append(seconds)
        if rep >= warmups:
            progress(f"{label}rep {rep - warmups + 1}/{reps}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()))
    return times


def machine_line() -> str:
    """The machine the figures come from: CPU count and load (the docs table quotes it)."""
    import os

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"machine: {os.cpu_count()} CPUs, load average {load}"


# ---------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSize:
    """A Qwen2-layout model to build locally with random weights (nothing is downloaded)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 0  # 0: the byte tokenizer's padded vocabulary (320)

    def describe(self) -> str:
        """The shapes, for progress lines."""
        vocab = f" vocab {self.vocab}" if self.vocab else ""
        return f"hidden {self.hidden}, {self.layers} layers, {self.heads}/{self.kv_heads} heads, intermediate {self.intermediate}{vocab}"


TINY = ModelSize(128, 2, 4, 2, 384)  # the demo's model (InitModelConfig defaults)
# The GPU variant: Qwen2.5-0.5B's shapes (its config.json), random weights.
QWEN25_05B = ModelSize(896, 24, 14, 2, 4864, 151936)


def model_size(hidden: int, layers: int) -> ModelSize:
    """The tiny model for hidden 128, else `layers` x `hidden` with head_dim 64 (a vLLM CPU head size)."""
    if hidden == TINY.hidden:
        return ModelSize(TINY.hidden, layers, TINY.heads, TINY.kv_heads, TINY.intermediate)
    return ModelSize(hidden, layers, hidden // 64, max(1, hidden // 128), 3 * hidden)


def build_model(out_dir: pathlib.Path, size: ModelSize) -> pathlib.Path:
    """Writes the HF checkpoint and byte tokenizer of `size` under `out_dir`."""
    from services.common.config import InitModelConfig
    from services.common.tiny_model import build_tiny_model

    cfg = InitModelConfig(hidden_size=size.hidden, num_layers=size.layers, num_attention_heads=size.heads,
                          num_key_value_heads=size.kv_heads, intermediate_size=size.intermediate)
    return build_tiny_model(out_dir, cfg, vocab_size=size.vocab)


def work_dir(prefix: str) -> pathlib.Path:
    """A fresh directory for this run's model, logs and ready files."""
    return pathlib.Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-"))


# ---------------------------------------------------------------- rollout replicas


def engine_overrides(device: str, engines: int, dtype: str) -> list[str]:
    """Config overrides for a replica: dtype, and on CUDA a share of the GPU for each of `engines` engines."""
    overrides = [f"generate_config.dtype={dtype}", "generate_config.seed=1234"]
    if device == "cuda":
        overrides.append(f"generate_config.gpu_memory_utilization={0.85 / engines:.3f}")
    else:
        overrides.append("rollout.omp_threads_bind=nobind")
    return overrides


def engine_env(device: str) -> dict[str, str]:
    """Environment for an engine process: the vLLM CPU settings on CPU, nothing extra on CUDA."""
    return dict(CPU_ENGINE_ENV) if device == "cpu" else {}


def start_replicas(model: pathlib.Path, work: pathlib.Path, overrides: dict[str, Sequence[str]], env: dict[str, str],
                   extra_args: Sequence[str] = ()) -> list:
    """Starts one `python -m services.rollout serve` per name (with that name's config overrides), all at
    once, and waits until every one serves."""
    from replica_launcher import spawn_replica

    progress(f"starting {len(overrides)} rollout replica(s): {', '.join(overrides)}")
    pending = [spawn_replica(model, work, name, sets, "bench", env, extra_args) for name, sets in overrides.items()]
    started = []
    try:
        for p in pending:
            started.append(p.wait(timeout_s=600))
    except BaseException:
        for p in pending:
            p.proc.kill()
        raise
    progress("replicas serving")
    return started


def stop_all(replicas: Sequence) -> None:
    """Stops every replica (SIGTERM, then SIGKILL of its process group)."""
    for replica in replicas:
        replica.stop()


# ---------------------------------------------------------------- Redis


@contextlib.contextmanager
def private_redis(directory: pathlib.Path) -> Iterator[str]:
    """A redis-server of this benchmark alone on a free loopback port (no persistence); yields its URL.

    Started as `dockrl up` starts its own (services/launch/redis_local.py), log under `directory`.
    """
    from services.launch.process_group import ProcessGroup
    from services.launch.redis_local import start_local_redis

    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: run scripts/setup.sh, or pass --redis-url")
    group = ProcessGroup(directory)
    try:
        yield start_local_redis(group, directory, durability=False)
    finally:
        group.stop()
