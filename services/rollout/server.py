"""One rollout replica: a vLLM engine, the gRPC service and the HTTP API on one event loop."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from dataclasses import dataclass

import psutil
import uvicorn

from services.common.auth import resolve_token
from services.common.config import Config
from services.common.grpc_serving import advertised_address
from services.common.log import log_event
from services.common.ready_file import write_ready_file
from services.rollout.core_claims import bind_engine_cores
from services.rollout.engine import RolloutEngine
from services.rollout.eplb import ExpertMapError, check_map_against_checkpoint
from services.rollout.grpc_server import start_grpc_server
from services.rollout.http_server import build_http_app
from services.rollout.collective_receiver import CollectiveReceiver
from services.rollout.weight_receiver import WeightReceiver, served_weight_spec

log = logging.getLogger("dockrl.rollout")

DEAD_ENGINE_STOP_S = 5.0  # a dead engine has nothing to drain; vLLM's own wait before it kills the processes
DRAIN_POLL_S = 0.05
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupInterrupted(Exception):
    """SIGTERM or SIGINT while the engine starts."""


def _interrupt_start(signum, frame) -> None:
    """While vLLM's engine starts (a blocking call of tens of seconds): kill the engine's processes, stop the start.

    Killed, not terminated: vLLM's engine core defers SIGTERM until its own start-up (model load, KV cache,
    warm-up) is done, and vLLM's shutdown then waits 5 s before it kills it; a start that is called off has
    nothing to save. multiprocessing's resource tracker is left to remove vLLM's shared memory as it exits.
    """
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not any("resource_tracker" in part for part in child.cmdline()):
                child.kill()
    raise StartupInterrupted(signal.Signals(signum).name)


@dataclass(frozen=True)
class ServeOptions:
    """Where this replica listens and what it serves (the CLI's flags over the config)."""

    model: str
    host: str
    grpc_port: int
    http_port: int
    served_model_name: str = ""
    ready_file: str | None = None
    dock_url: str = ""  # non-empty: also run the dock worker against this Redis; "config": the one the config names (URL or sentinels)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own SIGTERM / SIGINT handling: the replica drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(cfg: Config, options: ServeOptions) -> int:
    """Serves until SIGTERM / SIGINT (then drains) or the engine's death; returns the exit status."""
    from vllm.utils.gc_utils import freeze_gc_heap

    if cfg.generate_config.expert_map_path:
        try:
            check_map_against_checkpoint(cfg.generate_config.expert_map_path, options.model)
        except ExpertMapError as exc:
            log_event(log, "bad expert map; not starting this replica", level=logging.ERROR,
                      error=f"generate_config.expert_map_path: {exc}")
            return 2
    # 1. the ports, before the engine's tens of seconds of start-up: one that is taken is said now, naming it
    try:
        trying = "--grpc-port / rollout.grpc_port", options.grpc_port
        _bind(options.host, options.grpc_port).close()  # gRPC binds its own socket in step 3
        trying = "--http-port / rollout.http_port", options.http_port
        http_socket = _bind(options.host, options.http_port)
    except OSError as exc:
        log_event(log, "port unavailable; not starting this replica", level=logging.ERROR,
                  error=f"{trying[0]}: {options.host}:{trying[1]}: {exc.strerror}; give another port, or 0 for a free one")
        return 2
    # 2. the engine's cores (agreed with the host's other replicas), then the engine (vLLM spawns its
    # engine-core and worker processes here). The start blocks this loop for tens of seconds, so until it
    # returns a signal interrupts it where it is (see _interrupt_start); from then on it sets `stop`.
    stop = asyncio.Event()
    engine = None
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt_start)
    try:
        cores = bind_engine_cores(cfg.rollout.omp_threads_bind)
        engine = RolloutEngine.start(options.model, cfg, options.served_model_name)
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
    except StartupInterrupted as exc:
        if engine is not None:  # started just before the signal
            engine.shutdown(timeout_s=0.0)
        log_event(log, "stopped while the engine started", signal=str(exc))
        return 0
    try:
        await engine.start_expert_counting()
    except ExpertMapError as exc:
        log_event(log, "bad expert map; stopping this replica", level=logging.ERROR, error=str(exc))
        engine.shutdown(timeout_s=DEAD_ENGINE_STOP_S)
        return 2
    if cfg.rl_config.routing_replay:
        await engine.start_routing_record()
    token = resolve_token(cfg.auth)
    spec = served_weight_spec(engine.model_path, cfg.generate_config.dtype)
    receiver, collective = WeightReceiver(engine, spec, token), CollectiveReceiver(engine, spec)
    # 3. gRPC and HTTP (vLLM's OpenAI app) on this loop
    grpc_server, grpc_port, health = await start_grpc_server(engine, receiver, collective, options.host, options.grpc_port, token)
    http_port = http_socket.getsockname()[1]
    app = await build_http_app(engine, token)
    # As `vllm serve` does once started: the start-up heap leaves the GC's scans. Fewer pauses, and a
    # faster exit: interpreter shutdown collects the heap several times over (~4.5 s with vLLM's app loaded).
    freeze_gc_heap()
    http = _Uvicorn(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    # 4. the dock worker, when asked for (registered before we say we are ready)
    worker = worker_task = None
    if options.dock_url:
        worker = _dock_worker(engine, cfg, token, options.dock_url, advertised_address(options.host, grpc_port))
        # A dock that does not answer keeps the registration retrying; a signal meanwhile stops the replica now.
        registering, signalled = asyncio.create_task(worker.register()), asyncio.create_task(stop.wait())
        await asyncio.wait([registering, signalled], return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if registering.done():
            registering.result()
            worker_task = asyncio.create_task(worker.run(stop))
    if options.ready_file:  # before the log line: whoever reads the line may look for the file at once
        write_ready_file(options.ready_file, grpc_port=grpc_port, http_port=http_port)
    log_event(log, "serving", model=engine.model_name, grpc_port=grpc_port, http_port=http_port, max_queue=engine.max_queue)
    # A replica whose engine died must not keep answering: it exits non-zero, so that `dockrl up`,
    # compose or k8s sees it and the dock worker's claims go back to the pool now.
    engine_died = asyncio.create_task(engine.wait_dead())
    signalled = asyncio.create_task(stop.wait())
    # 5. until a signal, the engine's death, or the HTTP server's end
    await asyncio.wait([signalled, engine_died, http_task], return_when=asyncio.FIRST_COMPLETED)
    died = engine_died.done()
    stop.set()
    if died:
        log_event(log, "the vLLM engine died; stopping this replica", level=logging.ERROR, error=engine_died.result())
        deadline = time.monotonic() + DEAD_ENGINE_STOP_S
    else:
        engine_died.cancel()
        deadline = await _drain(engine, health, worker_task, cfg.rollout.drain_s)
    # 6. stop the servers, then the engine with what is left of the drain's time
    http.should_exit = True
    await asyncio.gather(http_task, *([worker_task] if worker_task else []), return_exceptions=died)
    await grpc_server.stop(grace=1.0)
    remaining = max(deadline - time.monotonic(), 0.0)
    log_event(log, "stopping the engine", timeout_s=round(remaining, 1))
    engine.shutdown(timeout_s=remaining)
    cores.keep_only([])
    log_event(log, "stopped")
    return 1 if died else 0


async def _drain(engine: RolloutEngine, health, worker_task: asyncio.Task | None, drain_s: float) -> float:
    """Stops taking work and ends what is held within `drain_s`; returns the deadline left for the engine.

    New API requests are refused (503 / UNAVAILABLE, health NOT_SERVING) and the dock worker claims
    no more rows (it was told by `stop`); what runs may finish in the first half of `drain_s`. Then
    every request still in the engine is aborted, and the dock worker puts its rows back with the
    tokens generated so far. The second half (at least) is the engine's, to exit: on a loaded 2-core
    CPU vLLM's engine took 6 s to well over 17 s to stop (its processes' exits are mostly GC passes).
    """
    began = time.monotonic()
    deadline = began + drain_s
    engine.draining = True
    await health.enter_graceful_shutdown()
    log_event(log, "draining", requests=engine.queue_depth, drain_s=drain_s)
    work_deadline = began + drain_s / 2
    while time.monotonic() < work_deadline and (engine.queue_depth or (worker_task and not worker_task.done())):
        await asyncio.sleep(DRAIN_POLL_S)
    aborted = engine.queue_depth
    while time.monotonic() < deadline and (engine.queue_depth or (worker_task and not worker_task.done())):
        await engine.abort_all()  # again until nothing runs: see abort_all
        await asyncio.sleep(DRAIN_POLL_S)
    log_event(log, "drained", seconds=round(time.monotonic() - began, 2), aborted_requests=aborted)
    return deadline


def _dock_worker(engine: RolloutEngine, cfg: Config, token: str, redis_url: str, address: str):
    from services.dock.client import Dock
    import zlib

    from services.rollout.agent.tools import CODE_INTERPRETER, connect_sandbox
    from services.rollout.dock_worker import DockWorker

    dock = Dock.from_config(cfg, token=token, redis_url=None if redis_url == "config" else redis_url, holder=engine.replica_id)
    registry = dock.registry(cfg.rollout.heartbeat_ttl_s)
    mtc = cfg.rollout.multi_turn
    if mtc.environment and CODE_INTERPRETER.name in mtc.tools:
        # the run's own sandbox replicas: each rollout replica takes one by its id, which spreads them
        connect_sandbox(mtc.sandbox_address or cfg.sandbox.address(zlib.crc32(engine.replica_id.encode())), token, mtc.tool_timeout_s)
    return DockWorker(engine, dock, registry, cfg, address)
