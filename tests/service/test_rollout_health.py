"""grpc.health.v1 Check and Watch with grpcio-health-checking's own client (what Kubernetes' gRPC
probes and `grpc_health_probe [--watch]` send), through the interceptors every dockrl server uses;
and server reflection on every dockrl gRPC server, read with grpcio-reflection's client (what
`grpcurl list` / `describe` read)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rollout_harness import shared_servers
from services.common.grpc_status import AsyncStatusInterceptor

pytestmark = pytest.mark.service

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_watch_streams_status_changes_through_the_decode_interceptor():
    """Watch is a coroutine that writes through its context: the interceptor must await it, not iterate it."""
    async def main():
        server = grpc.aio.server(interceptors=[AsyncStatusInterceptor()])
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


def _reflected_services(target: str) -> tuple[list[str], list[str]]:
    """What `grpcurl TARGET list` and `grpcurl TARGET describe` read: the services the server reflects, and the
    methods of the first dockrl one, from the server's own descriptors (no .proto files on this side)."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(database.get_services())
        dockrl = next(s for s in services if s.startswith("dockrl."))
        methods = sorted(m.name for m in DescriptorPool(database).FindServiceByName(dockrl).methods)
    return services, methods


def test_replica_lists_its_services_by_reflection(request):
    replica = shared_servers(request).a
    services, methods = _reflected_services(replica.grpc_target)
    assert services == ["dockrl.rollout.v1.Rollout", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
    assert {"Generate", "GenerateStream", "Abort", "UpdateWeights", "GetInfo"} <= set(methods), methods


def test_reward_and_trainer_servers_list_their_services_by_reflection(tmp_path):
    from services.common.config import config_from_dict
    from services.reward.pool import VerifierPool
    from services.reward.server import start_server
    from services.trainer.loop.control import TrainerControl
    from services.trainer.loop.server import start_server as start_trainer_server

    cfg = config_from_dict({"rl_config": {"n_samples_per_prompt": 2}})
    with VerifierPool(1, 5.0) as pool:
        reward = start_server(cfg, pool, "127.0.0.1", 0)
        try:
            services, methods = _reflected_services(f"127.0.0.1:{reward.port}")
        finally:
            reward.stop()
    assert services == ["dockrl.reward.v1.Reward", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
    assert "Score" in methods
    trainer, port = start_trainer_server(TrainerControl(train_iters=1), "127.0.0.1", 0)
    try:
        services, methods = _reflected_services(f"127.0.0.1:{port}")
    finally:
        trainer.stop(grace=None)
    assert "dockrl.trainer.v1.Trainer" in services and "Status" in methods
