"""Starting a gRPC server the same way everywhere: health and reflection, bind, start, report SERVING."""
from __future__ import annotations

import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def add_reflection(server: grpc.Server | grpc.aio.Server, service_name: str) -> None:
    """Server reflection (grpc.reflection.v1alpha) over `service_name`, health and itself, so that
    grpcurl and other generic clients list and call the services without the .proto files."""
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)


def _add_health_and_bind(server: grpc.Server | grpc.aio.Server, health_servicer, host: str, port: int,
                         service_name: str, what: str) -> int:
    """Adds `health_servicer` and reflection and binds host:port (0: a free port); returns the bound port."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_reflection(server, service_name)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"{what}: cannot bind {host}:{port}")
    return bound


def start_with_health(server: grpc.Server, host: str, port: int, service_name: str, what: str) -> tuple[int, health.HealthServicer]:
    """Adds grpc.health.v1 and reflection, binds host:port (0: a free port), starts, and marks the
    server and `service_name` SERVING; returns the bound port and the health servicer. `what`
    names the config key for the bind error."""
    health_servicer = health.HealthServicer()
    bound = _add_health_and_bind(server, health_servicer, host, port, service_name, what)
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound, health_servicer


async def start_aio_with_health(server: grpc.aio.Server, host: str, port: int, service_name: str,
                                what: str) -> tuple[int, health.aio.HealthServicer]:
    """`start_with_health` for a grpc.aio server, on its event loop."""
    health_servicer = health.aio.HealthServicer()
    bound = _add_health_and_bind(server, health_servicer, host, port, service_name, what)
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound, health_servicer


def advertised_address(host: str, port: int) -> str:
    """The host:port other machines reach a server at: the bind address, or this machine's host
    name when it binds a wildcard (0.0.0.0 means nothing to a peer, which would dial itself)."""
    reachable = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"{reachable}:{port}"
