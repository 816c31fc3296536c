"""Child processes started together and stopped together: no orphans, first failure wins."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProcessSpec:
    """One service process: a name for logs, its command line and extra environment."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    essential: bool = True  # its exit (any code) ends the run; non-essential ones may exit 0 early
    ready_file: str = ""  # where the service writes the ports it bound once serving ('' = it writes none)
    stops_last: bool = False  # others stop before it (Redis: the services put, release and log through it as they stop)


@dataclass
class _Running:
    spec: ProcessSpec
    popen: subprocess.Popen
    log_path: pathlib.Path


class ProcessGroup:
    """Starts processes in their own sessions with logs under `log_dir`; stops all on exit."""

    def __init__(self, log_dir: str | pathlib.Path):
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._running: list[_Running] = []

    def start(self, spec: ProcessSpec) -> subprocess.Popen:
        """Starts `spec`; stdout and stderr go to log_dir/<name>.log."""
        if spec.ready_file:
            pathlib.Path(spec.ready_file).unlink(missing_ok=True)  # a previous run's ports would be read as this one's
        log_path = self.log_dir / f"{spec.name}.log"
        log = log_path.open("ab")
        popen = subprocess.Popen(
            list(spec.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **spec.env}, start_new_session=True,
        )
        log.close()
        self._running.append(_Running(spec, popen, log_path))
        return popen

    def first_exit(self) -> tuple[ProcessSpec, int] | None:
        """The first essential process that has exited (or any that failed), with its code."""
        for r in self._running:
            code = r.popen.poll()
            if code is not None and (r.spec.essential or code != 0):
                return r.spec, code
        return None

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines of a process's log, for error reports."""
        for r in self._running:
            if r.spec.name == name and r.log_path.exists():
                return "\n".join(r.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every process group, then SIGKILL to what is left after `grace_s`; processes that
        `stops_last` get their SIGTERM once the others have exited (or their grace ran out)."""
        deadline = time.monotonic() + grace_s
        for last in (False, True):
            wave = [r for r in self._running if r.spec.stops_last == last]
            for r in reversed(wave):
                if r.popen.poll() is None:
                    _signal_group(r.popen, signal.SIGTERM)
            for r in wave:
                remaining = max(2.0 if last else 0.0, deadline - time.monotonic())
                try:
                    r.popen.wait(remaining)
                except subprocess.TimeoutExpired:
                    pass
        for r in self._running:
            # The group may hold engine workers even after the leader exited.
            _signal_group(r.popen, signal.SIGKILL)
            if r.popen.poll() is None:
                r.popen.wait()

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass
