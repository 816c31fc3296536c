"""`dockrl up`: the whole system on one machine, as separate processes on loopback.

1. prepare what the config needs (tiny model, data, warm start)
2. start redis-server when `dock.redis_url` is empty (and no `dock.redis_sentinels` name the primary)
3. start rollout replicas, reward replicas (rule ones, and reward-model ones when
   reward_config.model_replicas > 0) and the trainer together (the trainer's imports and model
   build overlap vLLM's start; it waits for a replica in the dock's registry itself), and wait
   until each replica answers health checks
4. show one progress bar fed by the trainer's metrics log
5. on Ctrl-C, a failed service or the trainer's end: stop every process (no orphans)
"""
from __future__ import annotations

import json
import pathlib
import signal
import time

from services.common.config import load_config
from services.common.log import log_event, setup_logging
from services.common.ready_file import read_ready_file
from services.launch.health_probe import wait_serving
from services.launch.plan import add_replica_command, plan_processes, write_resolved_config
from services.launch.prepare import prepare_run
from services.launch.process_group import ProcessGroup, ProcessSpec
from services.launch.redis_local import start_local_redis

ADD_REPLICA_FILE = "add_rollout_replica.sh"  # beside the run's logs: the command that adds one more rollout replica


class _Interrupted(Exception):
    pass


def _raise_interrupt(signum, frame):
    raise _Interrupted()


def _wait_ready(group: ProcessGroup, spec: ProcessSpec, timeout_s: float) -> str | None:
    """The gRPC address of `spec` once it wrote its ready file and answers SERVING; None when it (or any
    other service) exited first or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and group.first_exit() is None:
        ports = read_ready_file(spec.ready_file)
        if ports is None:
            time.sleep(0.5)
            continue
        address = f"127.0.0.1:{ports['grpc_port']}"
        if wait_serving(address, timeout_s=5.0):
            return address
    return None


def _follow_metrics(path: pathlib.Path, offset: int) -> tuple[list[dict], int]:
    if not path.exists():
        return [], offset
    with path.open() as f:
        f.seek(offset)
        lines = f.readlines()
        return [json.loads(line) for line in lines if line.strip()], f.tell()


def _print_summary(log_dir: pathlib.Path) -> None:
    """The run's outcome as a person reads it: accuracy before and after, and where the curves are."""
    path = log_dir / "summary.json"
    if not path.exists():
        return
    summary = json.loads(path.read_text())
    sizes = summary.get("eval_prompts", {})
    for key, what in (("accuracy", "prompts RL trains on"), ("test_accuracy", "prompts held out from RL")):
        before, after = summary.get(f"{key}_before"), summary.get(f"{key}_after")
        if before is not None and after is not None:
            print(f"accuracy on {sizes.get(key)} {what}: before {before:.1%} -> after {after:.1%} ({(after - before) * 100:+.1f} points)")
    acc = summary.get("accounting", {})
    unused = "".join(f", {acc[key]} {what}" for key, what in (("rows_stale", "dropped as stale (max_staleness)"),
                                                                ("rows_failed", "dropped as failed by rollout")) if acc.get(key))
    # a resumed run counts what it trained itself: the steps from its checkpoint's on
    steps = (f"steps {acc['from_step']}-{summary.get('steps')}" if acc.get("from_step", 1) > 1
             else f"{summary.get('steps')} iterations")
    print(f"{steps}, {acc.get('rows_trained')} samples trained, {acc.get('rows_dropped')} dropped by "
          f"dynamic sampling{unused}; curves: {log_dir / 'curves.png'}, metrics: {log_dir / 'metrics.jsonl'}")


def up(config_path: str | None, overrides: list[str], resume: bool = False, start_timeout_s: float = 600.0) -> int:
    """Runs the config to the end; returns the trainer's exit code (non-zero when any service died)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    logger = setup_logging("up")
    cfg = load_config(config_path, overrides)
    log_dir = pathlib.Path(cfg.trainer.log_dir)
    for line in prepare_run(cfg):
        log_event(logger, line)
    previous = signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    group = ProcessGroup(log_dir / "services")
    try:
        # Behind sentinels the services find the primary themselves (redis_url stays empty, rollout gets `--dock config`).
        redis_url = cfg.dock.redis_url or ("" if cfg.dock.redis_sentinels else start_local_redis(group, log_dir / "redis", cfg.dock.durability))
        resolved = write_resolved_config(cfg, redis_url, log_dir / "config.yaml")
        specs = plan_processes(cfg, resolved, redis_url, log_dir / "services" / "ready")
        trainer_spec = specs[-1]
        if resume:
            trainer_spec = type(trainer_spec)(trainer_spec.name, (*trainer_spec.argv, "--resume"), trainer_spec.env)
        metrics_path, offset = log_dir / "metrics.jsonl", 0
        if metrics_path.exists() and not resume:  # before the trainer starts: it opens the file for appending
            metrics_path.unlink()
        services_started = time.monotonic()
        started = {spec.name: group.start(spec) for spec in (*specs[:-1], trainer_spec)}
        for name in started:
            log_event(logger, "started", service=name, log=str(group.log_dir / f"{name}.log"))
        trainer = started[trainer_spec.name]
        for spec in specs[:-1]:
            address = _wait_ready(group, spec, start_timeout_s)
            if address is None:
                failed = group.first_exit()
                name = failed[0].name if failed else spec.name
                log_event(logger, "service failed to start", service=name, log_tail=group.log_tail(name))
                return 1
            # the start-up's parts: each service in turn, from the moment all of them were started
            log_event(logger, "serving", service=spec.name, address=address, seconds_after_start=f"{time.monotonic() - services_started:.1f}")
        add_replica = log_dir / ADD_REPLICA_FILE
        add_replica.write_text(f"#!/bin/sh\n# adds a rollout replica to this run\nexec {add_replica_command(cfg, resolved)}\n")
        add_replica.chmod(0o755)
        log_event(logger, "to add a rollout replica to this run", command=add_replica_command(cfg, resolved), script=str(add_replica))
        rl = cfg.rl_config
        algorithm = "PPO" if rl.adv_estimator == "gae" else "DAPO" if rl.filter_groups_enable or rl.clip_higher_enable else "GRPO"
        columns = (TextColumn(f"[bold]{algorithm}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*columns) as progress:
            task = progress.add_task("train", total=cfg.megatron_training.train_iters, info="starting")
            first_step_s = None
            while trainer.poll() is None:
                failed = group.first_exit()
                if failed and failed[0].name != "trainer":
                    log_event(logger, "service died", service=failed[0].name, code=failed[1], log_tail=group.log_tail(failed[0].name))
                    return 1
                records, offset = _follow_metrics(metrics_path, offset)
                if records and first_step_s is None:
                    first_step_s = time.monotonic() - services_started
                    log_event(logger, "first iteration done", seconds_after_services_started=f"{first_step_s:.1f}",
                              detail="the trainer's 'start-up' log line splits it")
                for r in records:
                    info = " ".join(f"{k.split('/')[-1]}={r[k]:.3g}" for k in ("reward/mean", "eval/test_accuracy", "timing/iteration_s")
                                    if r.get(k) is not None)
                    progress.update(task, completed=r["step"], info=info)
                time.sleep(0.5)
        if trainer.returncode != 0:
            log_event(logger, "trainer failed", code=trainer.returncode, log_tail=group.log_tail("trainer", 40))
        else:
            _print_summary(log_dir)
        return trainer.returncode
    except _Interrupted:
        log_event(logger, "interrupted: stopping every service")
        return 130
    finally:
        group.stop()
        signal.signal(signal.SIGINT, previous)
