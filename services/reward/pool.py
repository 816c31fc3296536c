"""Runs verifiers in worker processes with a per-verifier deadline; a worker past it is killed and replaced.

concurrent.futures cannot stop a running task, and a sympy simplification can run for hours inside
C code, so each worker is a plain process with its own pipe and a small shared-memory board. The
pool sends a worker samples (response, label, verifier names), two at a time so it never idles
between them; the worker posts on the board which verifier it runs since when and the scores so
far, and answers all of a sample's scores at once. A worker whose current verifier has run for
`timeout_s` is SIGKILLed: that verifier gets its timeout score, the scores before it are kept, a
fresh worker takes its place and the rest goes back in the queue. Several threads (gRPC handlers,
the dock worker) may call `run` at once; they borrow idle workers from one queue, and a call
stops refilling the workers it holds while another call waits for one.

`InProcessRunner` is the same interface without processes or deadlines, for unit tests, the
benchmark's baseline and a person trying a rule.
"""
from __future__ import annotations

import logging
import multiprocessing
import queue
import itertools
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from services.common.log import log_event
from services.common.metrics import counter
from services.reward.code_tests import CodeSandbox
from services.reward.code_tests import configure as configure_code
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
    """Runs verifiers in the calling thread: no isolation, no deadline; `code`: the code verifier's sandbox."""

    def __init__(self, code: CodeSandbox | None = None):
        configure_code(code)

    def run(self, tasks: Sequence[VerifyTask]) -> list[list[VerifierOutcome]]:
        """Outcomes per task, one per verifier, in the order given."""
        return [[VerifierOutcome(run_verifier(name, t.response, t.label)) for name in t.verifiers] for t in tasks]


_READY = "ready"
_MAX_PARTS = 32  # verifiers per message; a longer list is sent in several
_PIPELINE_DEPTH = 2  # samples queued on a worker, so it never waits for the parent between two
# A worker's progress board (shared memory, written by the worker, read by the pool):
# [0] sequence number of the message it runs, [1] index of the verifier it runs within it,
# [2] when that verifier started (time.monotonic, one clock for all processes), [3:] scores so far.
_SEQ, _PART, _STARTED, _SCORES = 0, 1, 2, 3


def _worker_main(conn: Connection, board, code: CodeSandbox | None) -> None:
    """A worker's loop: say ready, then score each message's verifiers in turn, posting progress on
    `board`, and answer all of a message's scores at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which then kills us
    configure_code(code)
    conn.send(_READY)
    while True:
        try:
            seq, response, label, names = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        scores = []
        for i, name in enumerate(names):
            board[_STARTED] = time.monotonic()
            board[_PART] = i
            board[_SEQ] = seq
            scores.append(run_verifier(name, response, label))
            board[_SCORES + i] = scores[-1]
        conn.send((seq, scores))


@dataclass(eq=False)  # identity: a worker is one process
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    board: Any  # RawArray('d', _SCORES + _MAX_PARTS)


@dataclass
class _Message:
    """Verifiers `first`..`first + count - 1` of task `task`, sent as message `seq`."""

    task: int
    first: int
    count: int
    seq: int


@dataclass
class _Lease:
    """A worker borrowed by one `run` call, the messages it holds in order, and since when the
    oldest of them is the one it works on."""

    worker: _Worker
    messages: deque[_Message] = field(default_factory=deque)
    head_since: float = 0.0
    dead: bool = False  # its pipe broke: the worker exited


class VerifierPool:
    """`parallel` worker processes; each verifier call on a sample gets `timeout_s` seconds; `code`: the sandbox the
    code verifier calls."""

    def __init__(self, parallel: int, timeout_s: float, code: CodeSandbox | None = None):
        if parallel < 1 or timeout_s <= 0:
            raise ValueError(f"VerifierPool needs parallel >= 1 and timeout_s > 0, got {parallel}, {timeout_s}")
        self.timeout_s = timeout_s
        self._code = code
        # forkserver: forking a process that runs gRPC threads is unsafe; the preloaded server
        # forks workers with math-verify and sympy imported and warm, so a replacement starts fast.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["services.reward.preload"])
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._seq = itertools.count(1)
        self._waiters = 0  # run calls blocked waiting for an idle worker
        self.replaced = 0
        for _ in range(parallel):
            self._idle.put(self._start_worker())

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        board = self._ctx.RawArray("d", _SCORES + _MAX_PARTS)
        process = self._ctx.Process(target=_worker_main, args=(child, board, self._code), daemon=True, name="reward-verifier")
        process.start()
        child.close()
        try:
            ready = parent.poll(60) and parent.recv() == _READY
        except EOFError:  # it died while starting (its traceback is on stderr)
            ready = False
        if not ready:
            process.kill()
            process.join(5)
            raise RuntimeError(f"a verifier worker did not start within 60 s (exit code {process.exitcode})")
        worker = _Worker(process, parent, board)
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
        """An idle worker; with `block`, waits for one (and counts as waiting, so holders share)."""
        if self._closed:
            raise RuntimeError("the verifier pool is closed")
        if not block:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                return None
        with self._lock:
            self._waiters += 1
        try:
            while True:
                if self._closed:
                    raise RuntimeError("the verifier pool is closed")
                try:
                    return self._idle.get(timeout=0.5)
                except queue.Empty:
                    pass
        finally:
            with self._lock:
                self._waiters -= 1

    def _deadline(self, lease: _Lease) -> float:
        """When the verifier the worker runs now must be done: its start (as posted), or since its
        message became the oldest one, whichever is later, plus the timeout."""
        if lease.dead:
            return 0.0
        head, board = lease.messages[0], lease.worker.board
        started = board[_STARTED] if board[_SEQ] == head.seq else 0.0
        return max(started, lease.head_since) + self.timeout_s

    def run(self, tasks: Sequence[VerifyTask]) -> list[list[VerifierOutcome]]:
        """Outcomes per task, one per verifier, in the order given; blocks until all are in."""
        results: list[list[VerifierOutcome | None]] = [[None] * len(t.verifiers) for t in tasks]
        pending = deque((i, 0) for i, t in enumerate(tasks) if t.verifiers)  # (task, first verifier to run)
        leases: dict[Connection, _Lease] = {}

        def send(lease: _Lease) -> None:
            index, first = pending.popleft()
            task = tasks[index]
            names = task.verifiers[first:first + _MAX_PARTS]
            message = _Message(index, first, len(names), next(self._seq))
            lease.worker.conn.send((message.seq, task.response, task.label, names))
            if not lease.messages:
                lease.head_since = time.monotonic()
            lease.messages.append(message)

        def top_up(lease: _Lease) -> None:
            while pending and len(lease.messages) < _PIPELINE_DEPTH:
                send(lease)

        while pending or leases:
            # 1. one sample to each idle worker (wait for one only when holding none), then queue
            #    a second on each held worker
            while pending:
                worker = self._borrow(block=not leases)
                if worker is None:
                    break
                lease = leases[worker.conn] = _Lease(worker)
                send(lease)
            if not self._waiters:
                for lease in leases.values():
                    top_up(lease)
            # 2. collect answers until the nearest deadline
            nearest = min(self._deadline(lease) for lease in leases.values())
            for conn in wait(list(leases), timeout=max(0.0, nearest - time.monotonic())):
                lease = leases[conn]
                try:
                    seq, scores = conn.recv()
                except (EOFError, OSError):  # the worker died (e.g. out of memory): as a timeout
                    lease.dead = True
                    continue
                message = lease.messages.popleft()
                for offset, score in enumerate(scores):
                    results[message.task][message.first + offset] = VerifierOutcome(score)
                if message.first + message.count < len(tasks[message.task].verifiers):
                    pending.appendleft((message.task, message.first + message.count))
                lease.head_since = time.monotonic()
                if not self._waiters:  # when other calls wait for a worker, let this one drain
                    top_up(lease)
                if not lease.messages:
                    del leases[conn]
                    self._idle.put(lease.worker)
            # 3. kill workers past their deadline: the verifier they were on scores as timed out,
            #    what they had not done goes back in the queue
            now = time.monotonic()
            for conn, lease in [(c, lease) for c, lease in leases.items() if self._deadline(lease) <= now]:
                del leases[conn]
                self._time_out(lease, tasks, results, pending)
        return results  # type: ignore[return-value]  # every slot is filled above

    def _time_out(self, lease: _Lease, tasks, results, pending: deque) -> None:
        """Scores the hung verifier with its timeout score, keeps what the worker finished before it,
        requeues the rest and the worker's queued messages, and replaces the worker."""
        head, board = lease.messages.popleft(), lease.worker.board
        done = int(board[_PART]) if board[_SEQ] == head.seq else 0
        for offset in range(done):
            results[head.task][head.first + offset] = VerifierOutcome(board[_SCORES + offset])
        name = tasks[head.task].verifiers[head.first + done]
        results[head.task][head.first + done] = VerifierOutcome(REGISTRY[name].timeout_score, timed_out=True)
        VERIFIER_TIMEOUTS.labels(name).inc()
        for message in reversed(lease.messages):
            pending.appendleft((message.task, message.first))
        if head.first + done + 1 < len(tasks[head.task].verifiers):
            pending.appendleft((head.task, head.first + done + 1))
        log_event(logger, "verifier timed out; worker replaced", logging.WARNING,
                  verifier=name, timeout_s=self.timeout_s, response_chars=len(tasks[head.task].response))
        self._replace(lease.worker)

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
