"""Runs verifiers in worker processes with a per-verifier deadline; a worker past it is killed and replaced.

concurrent.futures cannot stop a running task, and a sympy simplification can run for hours inside
C code, so each worker is a plain process with its own pipe: the pool sends it one sample (response,
label, verifier names) and the worker answers one score per verifier as each finishes. A worker
silent for `timeout_s` is SIGKILLed, the verifier it was on gets its timeout score, a fresh worker
takes its place and the sample's remaining verifiers run on the next free worker. Several threads
(gRPC handlers, the dock worker) may call `run` at once; each borrows idle workers from one queue.

`InProcessRunner` is the same interface without processes or deadlines, for unit tests, the
benchmark's baseline and a person trying a rule.
"""
from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Protocol

from services.common.log import log_event
from services.common.metrics import counter
from services.reward.verifiers import REGISTRY, run_verifier

logger = logging.getLogger("dockrl.reward.pool")

VERIFIER_TIMEOUTS = counter("reward_verifier_timeouts_total", "verifier calls that ran past verifier_timeout", ("verifier",))
WORKERS_REPLACED = counter("reward_pool_workers_replaced_total", "verifier worker processes killed and restarted")


@dataclass(frozen=True)
class VerifyTask:
    """One sample to verify with several verifiers."""

    response: str
    label: str
    verifiers: tuple[str, ...]


@dataclass(frozen=True)
class VerifierOutcome:
    """One verifier's score on one sample; `timed_out` when the score is the verifier's timeout score."""

    score: float
    timed_out: bool = False


class VerifierRunner(Protocol):
    """Anything that scores tasks: the process pool or the in-process runner."""

    def run(self, tasks: Sequence[VerifyTask]) -> list[list[VerifierOutcome]]:
        """Outcomes per task, one per verifier, in the order given."""
        ...


class InProcessRunner:
    """Runs verifiers in the calling thread: no isolation, no deadline."""

    def run(self, tasks: Sequence[VerifyTask]) -> list[list[VerifierOutcome]]:
        """Outcomes per task, one per verifier, in the order given."""
        return [[VerifierOutcome(run_verifier(name, t.response, t.label)) for name in t.verifiers] for t in tasks]


_READY = "ready"


def _worker_main(conn: Connection) -> None:
    """A worker's loop: warm the parsers, say ready, then answer one score per verifier of each sample."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which then kills us
    for name in REGISTRY:
        run_verifier(name, "<think>x</think><answer>\\boxed{1}</answer>", "1")
    conn.send(_READY)
    while True:
        try:
            response, label, names = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        for name in names:
            conn.send(run_verifier(name, response, label))


@dataclass(eq=False)  # identity: a worker is one process
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection


@dataclass
class _Lease:
    """A worker busy on one task from verifier `part` on, and when it must have answered."""

    worker: _Worker
    task: int
    part: int = 0
    deadline: float = field(default=0.0)


class VerifierPool:
    """`parallel` worker processes; each verifier call on a sample gets `timeout_s` seconds."""

    def __init__(self, parallel: int, timeout_s: float):
        if parallel < 1 or timeout_s <= 0:
            raise ValueError(f"VerifierPool needs parallel >= 1 and timeout_s > 0, got {parallel}, {timeout_s}")
        self.timeout_s = timeout_s
        # forkserver: forking a process that runs gRPC threads is unsafe; the preloaded server
        # forks workers with math-verify and sympy already imported, so a replacement starts fast.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["services.reward.verifiers"])
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.replaced = 0
        for _ in range(parallel):
            self._idle.put(self._start_worker())

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="reward-verifier")
        process.start()
        child.close()
        if not parent.poll(60) or parent.recv() != _READY:
            process.kill()
            raise RuntimeError("a verifier worker did not start within 60 s")
        worker = _Worker(process, parent)
        with self._lock:
            self._all.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        """Kills a hung or dead worker and puts a fresh one in the idle queue."""
        worker.process.kill()
        worker.process.join(5)
        worker.conn.close()
        with self._lock:
            self._all.discard(worker)
            if self._closed:
                return
        self.replaced += 1
        WORKERS_REPLACED.inc()
        self._idle.put(self._start_worker())

    def _borrow(self, block: bool) -> _Worker | None:
        while True:
            if self._closed:
                raise RuntimeError("the verifier pool is closed")
            try:
                return self._idle.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if not block:
                    return None

    def run(self, tasks: Sequence[VerifyTask]) -> list[list[VerifierOutcome]]:
        """Outcomes per task, one per verifier, in the order given; blocks until all are in."""
        results: list[list[VerifierOutcome | None]] = [[None] * len(t.verifiers) for t in tasks]
        pending = deque((i, 0) for i, t in enumerate(tasks) if t.verifiers)  # (task, first verifier to run)
        leases: dict[Connection, _Lease] = {}
        while pending or leases:
            # 1. hand pending tasks to idle workers (wait for one only when holding none)
            while pending:
                worker = self._borrow(block=not leases)
                if worker is None:
                    break
                index, part = pending.popleft()
                task = tasks[index]
                worker.conn.send((task.response, task.label, task.verifiers[part:]))
                leases[worker.conn] = _Lease(worker, index, part, deadline=time.monotonic() + self.timeout_s)
            # 2. collect scores until the nearest deadline
            nearest = min(lease.deadline for lease in leases.values())
            for conn in wait(list(leases), timeout=max(0.0, nearest - time.monotonic())):
                lease = leases[conn]
                try:
                    score = conn.recv()
                except (EOFError, OSError):  # the worker died (e.g. out of memory): as a timeout
                    lease.deadline = 0.0
                    continue
                results[lease.task][lease.part] = VerifierOutcome(score)
                lease.part += 1
                lease.deadline = time.monotonic() + self.timeout_s
                if lease.part == len(tasks[lease.task].verifiers):
                    del leases[conn]
                    self._idle.put(lease.worker)
            # 3. kill workers past their deadline: the verifier they were on scores as timed out,
            #    the sample's later verifiers go back in the queue
            now = time.monotonic()
            for conn, lease in [(c, lease) for c, lease in leases.items() if lease.deadline <= now]:
                del leases[conn]
                names = tasks[lease.task].verifiers
                name = names[lease.part]
                results[lease.task][lease.part] = VerifierOutcome(REGISTRY[name].timeout_score, timed_out=True)
                VERIFIER_TIMEOUTS.labels(name).inc()
                if lease.part + 1 < len(names):
                    pending.appendleft((lease.task, lease.part + 1))
                log_event(logger, "verifier timed out; worker replaced", logging.WARNING,
                          verifier=name, timeout_s=self.timeout_s, response_chars=len(tasks[lease.task].response))
                self._replace(lease.worker)
        return results  # type: ignore[return-value]  # every slot is filled above

    def close(self) -> None:
        """Kills every worker; `run` fails afterwards."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.process.kill()
        for worker in workers:
            worker.process.join(5)
            worker.conn.close()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
