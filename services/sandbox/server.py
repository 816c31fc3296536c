"""gRPC `Sandbox` (Execute, ExecuteBatch) and grpc.health.v1 over a bounded pool of sandbox workers; `serve` runs
it until a signal, listed in the run's replica registry (kind "sandbox") with `--dock`."""
from __future__ import annotations

import itertools
import logging
import math
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from services.common.auth import TokenInterceptor
from services.common.config import Config, SandboxConfig
from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.common.grpc_serving import start_with_health
from services.common.grpc_status import StatusInterceptor
from services.common.log import log_event
from services.common.pb import sandbox_pb2, sandbox_pb2_grpc
from services.sandbox.runner import Execution, Limits, SandboxRunner, Status, become_subreaper

logger = logging.getLogger("dockrl.sandbox.server")

SERVICE_NAME = sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name
PROTECTED_METHODS = (f"/{SERVICE_NAME}/Execute", f"/{SERVICE_NAME}/ExecuteBatch")  # running code needs the token
LANGUAGES = ("python",)
SPARE_THREADS = 2  # gRPC threads beyond the admitted programs: health checks and refusals are answered at once


class WorkerPool:
    """`workers` threads that run programs, each with its own slot (so its own host uid), and admission of at most
    `workers + queue` programs at once: more is ResourceExhausted, never an unbounded wait; a batch larger than that
    could never run and is InvalidArgument."""

    def __init__(self, runner: SandboxRunner, workers: int, queue: int, first_slot: int = 0):
        self._runner = runner
        self._capacity = workers + queue
        self._admitted = 0
        self._lock = threading.Lock()
        slots = itertools.count(first_slot)
        self._local = threading.local()
        self._executor = futures.ThreadPoolExecutor(
            workers, thread_name_prefix="sandbox-worker", initializer=lambda: setattr(self._local, "slot", next(slots)))

    def run(self, programs: list[tuple[str, bytes, Limits]]) -> list[Execution]:
        """Runs `programs` on the workers (all admitted or none) and returns their results in order."""
        if len(programs) > self._capacity:  # would never fit: the request's fault, not the load's
            raise InvalidArgument("items", f"{len(programs)} programs; at most sandbox.workers + sandbox.queue = {self._capacity} "
                                           "run or wait at once on a replica")
        with self._lock:
            if self._admitted + len(programs) > self._capacity:
                raise ResourceExhausted(
                    f"{self._admitted} programs running or waiting; {len(programs)} more would pass sandbox.workers + "
                    f"sandbox.queue = {self._capacity}; retry later")
            self._admitted += len(programs)
        try:
            pending = [self._executor.submit(self._run_one, *program) for program in programs]
            return [p.result() for p in pending]
        finally:
            with self._lock:
                self._admitted -= len(programs)

    def _run_one(self, code: str, stdin: bytes, limits: Limits) -> Execution:
        return self._runner.run(code, stdin, limits, self._local.slot)

    def close(self) -> None:
        """Waits for the programs under way (each ends by its wall limit), then stops the threads."""
        self._executor.shutdown()


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    """Checks each request against the sandbox config, runs it on the pool, answers how it ended."""

    def __init__(self, cfg: SandboxConfig, pool: WorkerPool):
        self._cfg = cfg
        self._pool = pool

    def Execute(self, request: sandbox_pb2.ExecuteRequest, context) -> sandbox_pb2.ExecuteResponse:
        (result,) = self._pool.run([self._program(request, "")])
        return _response_pb(result)

    def ExecuteBatch(self, request: sandbox_pb2.ExecuteBatchRequest, context) -> sandbox_pb2.ExecuteBatchResponse:
        if not request.items:
            raise InvalidArgument("items", "is empty; give at least one program")
        if len(request.items) > self._cfg.max_batch:
            raise InvalidArgument("items", f"{len(request.items)} programs; at most {self._cfg.max_batch} per request (sandbox.max_batch)")
        programs = [self._program(item, f"items[{i}].") for i, item in enumerate(request.items)]
        return sandbox_pb2.ExecuteBatchResponse(results=[_response_pb(r) for r in self._pool.run(programs)])

    def _program(self, request: sandbox_pb2.ExecuteRequest, where: str) -> tuple[str, bytes, Limits]:
        """The request's program and its limits: each 0 limit the config's default, each within the config's maximum."""
        cfg = self._cfg
        if request.language not in ("", *LANGUAGES):
            raise InvalidArgument(f"{where}language", f"{request.language!r} is not one of {', '.join(LANGUAGES)}")
        if not request.code.strip():
            raise InvalidArgument(f"{where}code", "is empty; give the program's source")
        size = len(request.code.encode())
        if size > cfg.max_code_bytes:
            raise InvalidArgument(f"{where}code", f"{size} bytes; at most {cfg.max_code_bytes} (sandbox.max_code_bytes)")
        if len(request.stdin) > cfg.max_stdin_bytes:
            raise InvalidArgument(f"{where}stdin", f"{len(request.stdin)} bytes; at most {cfg.max_stdin_bytes} (sandbox.max_stdin_bytes)")
        if not math.isfinite(request.wall_s):
            raise InvalidArgument(f"{where}wall_s", f"must be a finite number, got {request.wall_s}")
        limits = Limits(
            wall_s=_within(f"{where}wall_s", request.wall_s, cfg.wall_s, cfg.max_wall_s, "max_wall_s"),
            memory_mb=_within(f"{where}memory_mb", request.memory_mb, cfg.memory_mb, cfg.max_memory_mb, "max_memory_mb"),
            output_bytes=_within(f"{where}output_bytes", request.output_bytes, cfg.output_bytes, cfg.max_output_bytes, "max_output_bytes"),
            processes=cfg.processes, file_size_mb=cfg.file_size_mb, tmpfs_mb=cfg.tmpfs_mb,
        )
        return request.code, request.stdin, limits


def _within(field: str, asked, default, maximum, key: str):
    """`asked` when it is in (0, maximum], the default when 0; InvalidArgument otherwise."""
    if asked == 0:
        return default
    if asked < 0 or asked > maximum:
        raise InvalidArgument(field, f"must be in (0, {_num(maximum)}] (sandbox.{key}), or 0 for the default {_num(default)}; "
                                     f"got {_num(asked)}")
    return asked


def _num(value: int | float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)  # a float32 field's 0.3 reads 0.3, an int in full


_STATUS = {status: sandbox_pb2.Status.Value(status.name) for status in Status}


def _response_pb(result: Execution) -> sandbox_pb2.ExecuteResponse:
    return sandbox_pb2.ExecuteResponse(
        status=_STATUS[result.status], reason=result.reason, exit_code=result.exit_code, stdout=result.stdout,
        stderr=result.stderr, stdout_truncated=result.stdout_truncated, stderr_truncated=result.stderr_truncated,
        wall_ms=result.wall_ms)


@dataclass
class SandboxServer:
    """A started gRPC server, the port it bound and its worker pool."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    pool: WorkerPool

    def stop(self, grace_s: float = 2.0) -> None:
        """Reports NOT_SERVING, stops within `grace_s`, then waits for the programs under way."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        self.pool.close()


def start_server(cfg: Config, host: str, port: int, token: str = "", replica_index: int = 0) -> SandboxServer:
    """Starts Sandbox and health on host:port (0: a free port); with `token`, Execute and ExecuteBatch need it."""
    sb = cfg.sandbox
    become_subreaper()
    runner = SandboxRunner(sb.interpreter, sb.ro_paths, sb.uid_base)
    pool = WorkerPool(runner, sb.workers, sb.queue, first_slot=replica_index * sb.workers)
    threads = sb.workers + sb.queue + SPARE_THREADS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sandbox-grpc"),
        interceptors=[TokenInterceptor(token, PROTECTED_METHODS), StatusInterceptor()],
        options=[("grpc.max_receive_message_length", sb.max_request_mb * 1024 * 1024)],
        maximum_concurrent_rpcs=threads,
    )
    sandbox_pb2_grpc.add_SandboxServicer_to_server(SandboxServicer(sb, pool), server)
    bound, health_servicer = start_with_health(server, host, port, SERVICE_NAME, "sandbox.grpc_port")
    log_event(logger, "sandbox server listening", host=host, port=bound, workers=sb.workers, interpreter=sb.interpreter)
    return SandboxServer(server, bound, health_servicer, pool)


def serve(cfg: Config, host: str | None, port: int | None, replica_index: int, dock: bool, ready_file: str | None) -> int:
    """`dockrl sandbox serve`: the server until SIGINT / SIGTERM; with `dock`, listed in the run's registry meanwhile."""
    import signal
    import uuid

    from services.common.auth import resolve_token
    from services.common.grpc_serving import advertised_address
    from services.common.log import setup_logging
    from services.common.ready_file import write_ready_file

    if not 0 <= replica_index < cfg.sandbox.replicas:
        raise InvalidArgument("--replica-index", f"{replica_index} must be in [0, {cfg.sandbox.replicas}) (sandbox.replicas)")
    run_log = setup_logging("sandbox")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    token = resolve_token(cfg.auth)
    host = host or cfg.sandbox.host
    entry = _registry_entry(cfg, token, f"sandbox-{uuid.uuid4().hex[:8]}") if dock else None  # a bad dock config fails first
    server = start_server(cfg, host, cfg.sandbox.port(replica_index) if port is None else port, token, replica_index)
    if ready_file:
        write_ready_file(ready_file, grpc_port=server.port)
    print(f"sandbox server listening on {host}:{server.port}", flush=True)
    if entry is not None:
        entry.address = advertised_address(host, server.port)
        entry.register()
    while not stop.wait(entry.period_s if entry is not None else None):
        try:
            entry.renew()
        except Unavailable as exc:  # Redis away: keep serving, listed again once it answers
            log_event(run_log, "registry heartbeat failed", logging.WARNING, reason=str(exc))
    log_event(run_log, "sandbox server stopping")
    if entry is not None:
        entry.deregister()
    server.stop()
    return 0


def _registry_entry(cfg: Config, token: str, replica_id: str):
    from services.dock.client import Dock
    from services.dock.worker_loop import RegistryEntry

    registry = Dock.from_config(cfg, token=token).registry(cfg.rollout.heartbeat_ttl_s)
    return RegistryEntry(registry, replica_id, "", "sandbox")
