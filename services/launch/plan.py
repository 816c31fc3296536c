"""Which processes `dockrl up` starts for a config, with their ports, threads and logs."""
from __future__ import annotations

import os
import shlex
import pathlib
import sys

import yaml

from services.common.config import Config, config_to_dict
from services.launch.process_group import ProcessSpec


def engine_core_binds(count: int, cores: list[int] | None = None) -> list[str]:
    """The cores of each of `count` rollout engines' OpenMP threads (VLLM_CPU_OMP_THREADS_BIND), split evenly.

    As vLLM's own `auto` binding does for one engine, one core per replica is left out when there are
    enough, for the replica's scheduler and API processes: with every core taken by the engine's threads,
    those processes preempt one of them each step and the others wait at its barrier (on 2 cores the
    tiny run's rollout took 0.50 s instead of 0.34 s, docs/benchmarks.md). Replicas get distinct cores,
    so they don't fight over threads.
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if count <= 0:
        return []
    usable = cores[:len(cores) - count] if len(cores) >= 2 * count else cores
    share = max(1, len(usable) // count)
    return [",".join(map(str, usable[(i * share) % len(usable):][:share])) for i in range(count)]


def write_resolved_config(cfg: Config, redis_url: str, path: pathlib.Path) -> pathlib.Path:
    """Writes `cfg` with the dock's URL filled in; every child process loads this file."""
    data = config_to_dict(cfg)
    data["dock"]["redis_url"] = redis_url
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def add_replica_command(cfg: Config, config_path: pathlib.Path) -> str:
    """The command that adds one more rollout replica to the run `config_path` (the resolved config
    `dockrl up` wrote) describes, on this host or any that reaches its Redis: free ports, the run's
    dock; with rollout.omp_threads_bind auto its engine takes cores no running replica of its host holds
    (services/rollout/core_claims.py)."""
    argv = ["dockrl", "rollout", "serve", "--config", str(config_path), "--model", cfg.megatron_training.load,
            "--dock", "config", "--grpc-port", "0", "--http-port", "0"]
    return shlex.join(argv)


def _port(base: int, i: int) -> int:
    """Replica i's port: base + i, or 0 when the config says 0 (the service binds a free one and writes it to its ready file)."""
    return base + i if base else 0


def plan_processes(cfg: Config, config_path: pathlib.Path, redis_url: str, ready_dir: pathlib.Path) -> list[ProcessSpec]:
    """Sandbox replicas (when the run executes model-written code), rollout replicas, reward replicas (rule, then
    reward-model ones), and the trainer, in start order; the servers write their bound ports under `ready_dir`."""
    python = sys.executable
    ready_dir.mkdir(parents=True, exist_ok=True)
    conf = ["--config", str(config_path)]
    specs = []
    # For the clients that leave their address empty (sandbox.address); the ports are fixed (checked).
    own_sandbox = any(not address for address in cfg.sandbox_clients.values())
    for i in range(cfg.sandbox.replicas if own_sandbox else 0):
        ready = str(ready_dir / f"sandbox-{i}.json")
        specs.append(ProcessSpec(f"sandbox-{i}", (
            python, "-m", "services.sandbox", "serve", *conf, "--replica-index", str(i), "--dock", "--ready-file", ready,
        ), ready_file=ready))
    binds = engine_core_binds(cfg.rollout.replicas)
    for i in range(cfg.rollout.replicas):
        env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.generate_config.cpu_kvcache_space_gb)}
        if cfg.rollout.omp_threads_bind == "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = binds[i]
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.rollout.omp_threads_bind
        ready = str(ready_dir / f"rollout-{i}.json")
        specs.append(ProcessSpec(f"rollout-{i}", (
            python, "-m", "services.rollout", "serve", *conf, "--model", cfg.megatron_training.load,
            "--grpc-port", str(_port(cfg.rollout.grpc_port, i)), "--http-port", str(_port(cfg.rollout.http_port, i)), "--dock", redis_url or "config",
            "--ready-file", ready,
        ), env, ready_file=ready))
    for i in range(cfg.reward.replicas):
        ready = str(ready_dir / f"reward-{i}.json")
        specs.append(ProcessSpec(f"reward-{i}", (
            python, "-m", "services.reward", "serve", *conf, "--port", str(_port(cfg.reward.grpc_port, i)), "--dock",
            "--ready-file", ready,
        ), ready_file=ready))
    for i in range(cfg.reward_config.model_replicas):
        # Port reward.grpc_port + reward.replicas + i: after the rule replicas', so none collide.
        ready = str(ready_dir / f"reward-model-{i}.json")
        specs.append(ProcessSpec(f"reward-model-{i}", (
            python, "-m", "services.reward", "serve", *conf, "--kind", "model",
            "--port", str(_port(cfg.reward.grpc_port, cfg.reward.replicas + i)), "--dock", "--ready-file", ready,
        ), ready_file=ready))
    specs.append(ProcessSpec("trainer", (python, "-m", "services.trainer", "train", *conf, "--port", str(_port(cfg.trainer.grpc_port, 0)))))
    return specs
