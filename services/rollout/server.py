"""One rollout replica: a vLLM engine, the gRPC service and the HTTP API on one event loop."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass

import uvicorn

from services.common.auth import resolve_token
from services.common.config import Config
from services.common.log import log_event
from services.common.ready_file import write_ready_file
from services.rollout.engine import RolloutEngine
from services.rollout.grpc_server import start_grpc_server
from services.rollout.http_server import build_app
from services.rollout.weight_receiver import WeightReceiver, served_weight_spec

log = logging.getLogger("dockrl.rollout")


@dataclass(frozen=True)
class ServeOptions:
    """Where this replica listens and what it serves (the CLI's flags over the config)."""

    model: str
    host: str
    grpc_port: int
    http_port: int
    served_model_name: str = ""
    ready_file: str | None = None
    dock_url: str = ""  # non-empty: also run the dock worker against this Redis


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def serve(cfg: Config, options: ServeOptions) -> int:
    """Serves until SIGTERM / SIGINT; returns the exit status."""
    # 1. the engine (vLLM spawns its engine-core and worker processes here)
    engine = RolloutEngine.start(options.model, cfg, options.served_model_name)
    token = resolve_token(cfg.auth)
    receiver = WeightReceiver(engine, served_weight_spec(engine.model_path, cfg.generate_config.dtype), token)
    # 2. gRPC and HTTP on this loop
    grpc_server, grpc_port = await start_grpc_server(engine, receiver, options.host, options.grpc_port, token)
    http_socket = _bind(options.host, options.http_port)
    http_port = http_socket.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning", lifespan="off", access_log=False))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
    http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    # 3. the dock worker, when asked for (registered before we say we are ready)
    worker = None
    if options.dock_url:
        worker = _dock_worker(engine, cfg, token, options.dock_url, f"{_advertised(options.host)}:{grpc_port}")
        await worker.register()
    if options.ready_file:  # before the log line: whoever reads the line may look for the file at once
        write_ready_file(options.ready_file, grpc_port=grpc_port, http_port=http_port)
    log_event(log, "serving", model=engine.model_name, grpc_port=grpc_port, http_port=http_port, max_queue=engine.max_queue)
    tasks = [http_task, asyncio.create_task(stop.wait())]
    if worker is not None:
        tasks.append(asyncio.create_task(worker.run(stop)))
    # A replica whose engine died must not keep answering: it exits non-zero, so that `dockrl up`,
    # compose or k8s sees it and the dock worker's claims go back to the pool now.
    engine_died = asyncio.create_task(engine.wait_dead())
    # 4. until a signal (uvicorn sees it first, ends its server, then re-raises it to us) or the engine's death
    await asyncio.wait([*tasks, engine_died], return_when=asyncio.FIRST_COMPLETED)
    died = engine_died.done()
    if died:
        log_event(log, "the vLLM engine died; stopping this replica", level=logging.ERROR, error=engine_died.result())
    else:
        engine_died.cancel()
    log_event(log, "stopping")
    stop.set()
    http.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=died)
    await grpc_server.stop(grace=2.0)
    engine.shutdown()
    return 1 if died else 0


def _advertised(host: str) -> str:
    """The address other machines reach this one at (the bind address unless it is a wildcard)."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def _dock_worker(engine: RolloutEngine, cfg: Config, token: str, redis_url: str, address: str):
    from services.dock.client import Dock
    from services.dock.registry import ReplicaRegistry
    from services.rollout.dock_worker import DockWorker

    dock = Dock.from_config(cfg, token=token, redis_url=redis_url, holder=engine.replica_id)
    registry = ReplicaRegistry(dock.client, dock.keys, cfg.rollout.heartbeat_ttl_s)
    return DockWorker(engine, dock, registry, cfg, address)
