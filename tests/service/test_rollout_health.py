"""grpc.health.v1 Check and Watch with grpcio-health-checking's own client (what Kubernetes' gRPC
probes and `grpc_health_probe [--watch]` send), through the interceptors every dockrl server uses."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rollout_harness import shared_servers
from services.common.grpc_decode import AsyncDecodeErrorInterceptor

pytestmark = pytest.mark.service

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_watch_streams_status_changes_through_the_decode_interceptor():
    """Watch is a coroutine that writes through its context: the interceptor must await it, not iterate it."""
    async def main():
        server = grpc.aio.server(interceptors=[AsyncDecodeErrorInterceptor()])
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("svc", SERVING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            checked = (await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=10)).status
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
            first = (await watch.read()).status
            await servicer.enter_graceful_shutdown()
            second = (await watch.read()).status
            watch.cancel()
        await server.stop(grace=None)
        return checked, first, second

    assert asyncio.run(main()) == (SERVING, SERVING, NOT_SERVING)


def test_replica_answers_check_and_watch(request):
    replica = shared_servers(request).a
    with grpc.insecure_channel(replica.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "dockrl.rollout.v1.Rollout"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert next(watch).status == SERVING
            watch.cancel()
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
