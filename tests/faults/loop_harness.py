"""The whole training loop as separate real processes, for tests that break parts of it.

`dockrl up` ends a run when any service dies; these tests need the opposite: kill one process
with a real signal and watch the rest carry on. So the harness starts each piece itself, from the
same plan `dockrl up` uses (services/launch/plan.py): a private redis-server on a fixed port
(so it can be restarted in place), rollout and reward replicas, and the trainer.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
from dataclasses import dataclass, field

import grpc
import redis

from services.common.config import Config, load_config
from services.common.pb import rollout_pb2, rollout_pb2_grpc
from services.common.ready_file import read_ready_file
from services.dock.client import Dock, DockStats
from services.dock.registry import ReplicaRegistry
from services.launch.plan import plan_processes, write_resolved_config
from services.launch.prepare import prepare_run
from services.launch.process_group import ProcessGroup, ProcessSpec
from services.launch.redis_local import free_port
from tests.conftest import redis_answers, start_redis_server

ROOT = pathlib.Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout_s: float, what: str, alive: subprocess.Popen | None = None) -> None:
    """Polls `predicate` until it holds; fails after `timeout_s` (a generous deadline, not a speed claim)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the process exited ({alive.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@dataclass
class Kill:
    """A worker killed while it held rows: which rows, and the dock's requeue count just before."""

    name: str
    replica_id: str
    rows: list[int]
    requeued_before: int


@dataclass
class LoopSystem:
    """Redis, the replicas and the trainer of one run, each a process (group) the test can signal."""

    tmp: pathlib.Path
    overrides: list[str]
    cfg: Config | None = None
    config_path: pathlib.Path | None = None
    redis_port: int = 0
    redis_proc: subprocess.Popen | None = None
    group: ProcessGroup | None = None
    specs: dict[str, ProcessSpec] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)  # services the test killed on purpose

    # ------------------------------------------------------------ start and stop

    def start(self) -> None:
        """Prepares model and data, starts Redis (AOF on), the replicas and then the trainer."""
        self.redis_port = free_port()
        self.start_redis(aof=True)
        url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), self.overrides)
        prepare_run(self.cfg)
        self.config_path = write_resolved_config(self.cfg, url, self.log_dir / "config.yaml")
        self.group = ProcessGroup(self.log_dir / "services")
        self.specs = {spec.name: spec for spec in plan_processes(self.cfg, self.config_path, url, self.log_dir / "services" / "ready")}
        for name in self.specs:
            if name != "trainer":
                self.procs[name] = self.group.start(self.specs[name])
        self.start_trainer()

    def start_trainer(self, resume: bool = False) -> subprocess.Popen:
        """Starts `dockrl trainer train` (with --resume) in its own process group."""
        spec = self.specs["trainer"]
        if resume:
            spec = ProcessSpec(spec.name, (*spec.argv, "--resume"), spec.env)
        self.procs["trainer"] = self.group.start(spec)
        self.killed.discard("trainer")
        return self.procs["trainer"]

    def start_redis(self, aof: bool) -> None:
        """redis-server on the run's port and data directory; with `aof` it loads and writes the AOF there."""
        data = self.tmp / "redis"
        data.mkdir(exist_ok=True)
        flags = ["--appendonly", "yes", "--appendfsync", "always"] if aof else ["--appendonly", "no"]
        self.redis_proc, url = start_redis_server(data, *flags, port=self.redis_port)
        # start_redis_server waits a few seconds; loading an AOF on a loaded machine may take longer.
        wait_for(lambda: redis_answers(url), 60, "redis-server to answer", self.redis_proc)

    def stop_redis(self, sig: int) -> None:
        """Stops redis-server with `sig` (SIGTERM: it flushes the AOF first; SIGKILL: it does not)."""
        self.redis_proc.send_signal(sig)
        self.redis_proc.wait(timeout=60)

    def close(self) -> None:
        """Stops every process this harness started."""
        if self.group is not None:
            self.group.stop()
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.stop_redis(signal.SIGTERM)

    # ------------------------------------------------------------ faults

    def kill(self, name: str) -> None:
        """SIGKILL to the process group of `name` (the service and its engine or verifier workers)."""
        self.killed.add(name)
        _killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(timeout=60)

    def kill_while_holding(self, name: str, consumer: str, timeout_s: float = 300.0) -> Kill:
        """SIGKILLs worker `name` at a moment it holds leased rows of `consumer` (mid-batch); returns them.

        A reward worker scores a batch in milliseconds, so its verifier pool is stopped first: the
        next batch it claims cannot finish. A rollout replica's engine must keep running (the
        trainer's weight push waits on it, and no new work comes until the push ends), and its
        batches take long enough to catch: it is watched until it holds rows. Either way the
        service process itself is stopped before the look that decides, so it cannot put between
        that look and the kill.
        """
        main = self.procs[name].pid
        replica_id = self.replica_id(name)
        freeze_helpers_first = consumer != "actor_rollout"
        if freeze_helpers_first:
            for child in descendants(main):
                os.kill(child, signal.SIGSTOP)
        dock = self.dock()
        owners = dock.keys.base + f"owner:{consumer}"
        client = self.redis()  # one connection: a rollout replica is polled every 10 ms

        def held_rows() -> list[int]:
            return sorted(int(row) for row, lease in client.hgetall(owners).items() if lease.decode().startswith(f"{replica_id}/"))

        deadline = time.monotonic() + timeout_s
        while True:
            if freeze_helpers_first or held_rows():
                os.kill(main, signal.SIGSTOP)
                requeued = dock.stats().requeued
                held = held_rows()
                if held:
                    self.kill(name)
                    return Kill(name, replica_id, held, requeued)
                os.kill(main, signal.SIGCONT)
            assert time.monotonic() < deadline, f"{name} held no {consumer} rows within {timeout_s:.0f} s"
            time.sleep(0.2 if freeze_helpers_first else 0.01)

    # ------------------------------------------------------------ looking

    @property
    def log_dir(self) -> pathlib.Path:
        return self.tmp / "logs"

    @property
    def save_dir(self) -> pathlib.Path:
        return pathlib.Path(self.cfg.megatron_training.save)

    def redis(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port)

    def dock(self) -> Dock:
        """A dock client on the run (reads only: no token is set in these runs)."""
        return Dock.from_config(self.cfg, redis_url=f"redis://127.0.0.1:{self.redis_port}/0")

    def stats(self) -> DockStats:
        return self.dock().stats()

    def records(self) -> list[dict]:
        """The metrics log's records, in the order written (a resumed trainer appends)."""
        path = self.log_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def steps(self) -> list[int]:
        """The steps in the metrics log, in the order written (a resumed trainer appends)."""
        return [record["step"] for record in self.records()]

    def wait_steps(self, count: int, timeout_s: float = 600.0) -> list[int]:
        """Waits until the metrics log holds `count` steps; fails at once when a service the test did not kill exits."""
        def logged() -> bool:
            dead = [name for name, proc in self.procs.items() if name not in self.killed and proc.poll() is not None]
            # the logs' tails in the message: CI keeps the report, not the test's directory
            assert not dead, f"died while waiting for step {count}: " + "; ".join(
                f"{name} (exit {self.procs[name].returncode}), the end of its log:\n" + "\n".join(self.log(name).splitlines()[-40:])
                for name in dead)
            return len(self.steps()) >= count

        wait_for(logged, timeout_s, f"{count} logged steps")
        return self.steps()

    def checkpoint_step(self) -> int | None:
        from services.trainer.modeling.checkpoint import latest_step

        return latest_step(self.save_dir)

    def address(self, name: str) -> str:
        """The gRPC address of server `name`, from the ready file it writes once serving (it binds port 0)."""
        ready = self.specs[name].ready_file
        wait_for(lambda: read_ready_file(ready) is not None, 300, f"{name}'s ready file", self.procs[name])
        return f"127.0.0.1:{read_ready_file(ready)['grpc_port']}"

    def replica_id(self, name: str) -> str:
        """The id service `name` registered under (its gRPC address identifies it)."""
        kind = name.rsplit("-", 1)[0].replace("-", "_")  # reward-model-0 registers as reward_model
        registry = ReplicaRegistry(self.redis(), self.dock().keys, self.cfg.rollout.heartbeat_ttl_s)
        deadline = time.monotonic() + 120
        while True:
            found = [r.replica_id for r in registry.live(kind) if r.address == self.address(name)]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"{name} did not appear in the replica registry"
            time.sleep(0.5)

    def served_version(self, name: str) -> int:
        """The policy version rollout replica `name` serves (gRPC GetInfo)."""
        return self._info(name).version

    def weights_incomplete(self, name: str) -> str:
        """Why rollout replica `name` holds generation after a weight transfer broke off mid-way; empty when it does not."""
        return self._info(name).weights_incomplete

    def _info(self, name: str) -> rollout_pb2.InfoResponse:
        with grpc.insecure_channel(self.address(name)) as channel:
            return rollout_pb2_grpc.RolloutStub(channel).GetInfo(rollout_pb2.GetInfoRequest(), timeout=30)

    def generated_version(self, name: str, timeout_s: float = 120.0) -> int:
        """The policy version that answered a short Generate call on rollout replica `name`."""
        request = rollout_pb2.GenerateRequest(token_ids=rollout_pb2.TokenIds(ids=[49, 43, 50, 61]),
                                              sampling=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=2))
        with grpc.insecure_channel(self.address(name)) as channel:
            return rollout_pb2_grpc.RolloutStub(channel).Generate(request, timeout=timeout_s).policy_version

    def log(self, name: str) -> str:
        """A service's whole log."""
        return (self.log_dir / "services" / f"{name}.log").read_text(errors="replace")


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass

