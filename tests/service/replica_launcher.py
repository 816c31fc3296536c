"""Runs a rollout replica as a local subprocess (`python -m services.rollout serve`) on free ports.

For tests, benchmarks and local launchers: `spawn_replica(...)` starts it, `.wait()` returns a
`LocalReplica` once both servers accept calls, and `.stop()` ends it with SIGTERM.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclass
class LocalReplica:
    """A started replica and where it listens."""

    proc: subprocess.Popen
    grpc_port: int
    http_port: int
    log_path: pathlib.Path

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def freeze_engine(self) -> None:
        """SIGSTOPs the replica's vLLM engine processes (its API process keeps serving): nothing is generated
        until `thaw_engine`, so a test can look at a generation's state without racing it."""
        self._signal_engine("suspend")

    def thaw_engine(self) -> None:
        """SIGCONTs what `freeze_engine` stopped."""
        self._signal_engine("resume")

    def _signal_engine(self, action: str) -> None:
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:  # the replica has exited
            return
        for proc in children:
            try:
                getattr(proc, action)()
            except psutil.NoSuchProcess:  # a short-lived helper process that has ended meanwhile
                pass

    def step_engine_until(self, reached, step_s: float = 0.02, timeout_s: float = 60.0) -> None:
        """With the engine frozen: lets it run `step_s` at a time until `reached()` is true, checked while it is
        frozen (so what `reached` sees cannot run past it meanwhile); leaves it frozen."""
        deadline = time.monotonic() + timeout_s
        while not reached():
            assert time.monotonic() < deadline, f"not reached in {timeout_s} s of engine steps"
            self.thaw_engine()
            time.sleep(step_s)
            self.freeze_engine()

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM, then SIGKILL of its process group if it does not end in `timeout_s` (the default rollout.drain_s is 30)."""
        if self.proc.poll() is None:
            self.thaw_engine()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass
class PendingReplica:
    """A replica process that is still starting."""

    proc: subprocess.Popen
    ready_file: pathlib.Path
    log_path: pathlib.Path

    def wait(self, timeout_s: float = 240.0) -> LocalReplica:
        """Blocks until the replica serves; raises RuntimeError with its log tail if it does not."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"rollout replica did not start; log {self.log_path}:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        ports = json.loads(self.ready_file.read_text())
        return LocalReplica(self.proc, ports["grpc_port"], ports["http_port"], self.log_path)


def spawn_replica(
    model_dir: str | pathlib.Path,
    work_dir: str | pathlib.Path,
    name: str = "rollout",
    overrides: Sequence[str] = (),
    served_model_name: str = "",
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> PendingReplica:
    """Starts `python -m services.rollout serve` on 127.0.0.1 with OS-chosen ports; log in `work_dir`.

    `overrides` are `section.key=value` config overrides; `extra_args` more serve flags (e.g. --dock URL).
    """
    work = pathlib.Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ready = work / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log_path = work / f"{name}.log"
    cmd = [
        sys.executable, "-m", "services.rollout", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
        "--grpc-port", "0", "--http-port", "0", "--ready-file", str(ready),
    ]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    for override in overrides:
        cmd += ["--set", override]
    cmd += list(extra_args)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return PendingReplica(proc, ready, log_path)
