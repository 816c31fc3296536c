"""A grpc.health.v1 probe for container health checks (`dockrl health HOST:PORT`)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def probe(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The serving status of `service` ('' = the whole server) at `address`, e.g. 'SERVING'."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(address: str, timeout_s: float, service: str = "") -> bool:
    """True once `address` answers SERVING within `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if probe(address, service, timeout_s=2.0) == "SERVING":
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    return False
