"""The gRPC `Rollout` service (proto/rollout.proto) and grpc.health.v1 on one grpc.aio server."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2

from services.common.auth import AsyncTokenInterceptor
from services.common.errors import InvalidArgument
from services.common.grpc_status import AsyncStatusInterceptor
from services.common.grpc_serving import start_aio_with_health
from services.common.pb import rollout_pb2, rollout_pb2_grpc
from services.rollout.chain import MAX_MESSAGE_BYTES
from services.rollout.collective_receiver import CollectiveReceiver
from services.rollout.engine import RolloutEngine
from services.rollout.sampling import NO_LOGPROBS, SamplingOverrides
from services.rollout.weight_receiver import WeightReceiver

SERVICE = "dockrl.rollout.v1.Rollout"
PROTECTED_METHODS = tuple(f"/{SERVICE}/{m}" for m in (
    "UpdateWeights", "Abort", "JoinWeightGroup", "OpenWeightTransfer", "FinishWeightTransfer"))


def overrides_from_proto(sp: rollout_pb2.SamplingParams) -> SamplingOverrides:
    """SamplingOverrides from the proto's optional fields (unset -> server default)."""
    def opt(name):
        return getattr(sp, name) if sp.HasField(name) else None

    logprobs = opt("logprobs")
    if logprobs is not None and logprobs < 0:
        raise InvalidArgument("sampling.logprobs", f"must be 0 (none) or >= 1 (the sampled token's), got {logprobs}")
    return SamplingOverrides(
        temperature=opt("temperature"),
        top_p=opt("top_p"),
        top_k=opt("top_k"),
        min_p=opt("min_p"),
        max_tokens=opt("max_tokens"),
        logprobs=None if logprobs is None else (0 if logprobs >= 1 else NO_LOGPROBS),
        n=opt("n"),
        stop=tuple(sp.stop) or None,
        stop_token_ids=tuple(sp.stop_token_ids),
        seed=opt("seed"),
        ignore_eos=sp.ignore_eos,
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Generate / GenerateStream / Abort / UpdateWeights / GetInfo and the collective weight path over one RolloutEngine."""

    def __init__(self, engine: RolloutEngine, receiver: WeightReceiver, collective: CollectiveReceiver):
        self.engine = engine
        self.receiver = receiver
        self.collective = collective

    def _open(self, request: rollout_pb2.GenerateRequest):
        self.engine.ensure_generating()
        self.engine.check_model(request.model)
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidArgument("prompt", "give text or token_ids")
        prompt_ids = self.engine.encode_text(request.text) if kind == "text" else list(request.token_ids.ids)
        detokenize = kind == "text" or bool(request.sampling.stop)
        return self.engine.open(prompt_ids, overrides_from_proto(request.sampling), request.request_id, detokenize=detokenize)

    async def Generate(self, request, context):
        stream = self._open(request)
        completions = await stream.collect()
        return rollout_pb2.GenerateResponse(
            request_id=stream.request_id,
            completions=[
                rollout_pb2.Completion(
                    index=i, token_ids=c.token_ids, text=c.text, logprobs=c.logprobs,
                    finish_reason=c.finish_reason, versions=c.versions,
                )
                for i, c in sorted(completions.items())
            ],
            policy_version=self.engine.version,
            prompt_tokens=len(stream.prompt_ids),
        )

    async def GenerateStream(self, request, context):
        stream = self._open(request)
        async for delta in stream.deltas():
            yield rollout_pb2.GenerateChunk(
                request_id=stream.request_id, index=delta.index, token_ids=delta.token_ids, text=delta.text,
                logprobs=delta.logprobs, finish_reason=delta.finish_reason or "", policy_version=delta.version,
            )

    async def Abort(self, request, context):
        return rollout_pb2.AbortResponse(aborted=await self.engine.abort(request.request_id))

    async def UpdateWeights(self, request_iterator, context):
        self.engine.ensure_accepting()
        return await self.receiver.receive(request_iterator)

    async def JoinWeightGroup(self, request, context):
        self.engine.ensure_accepting()
        return await self.collective.join(request)

    async def OpenWeightTransfer(self, request, context):
        self.engine.ensure_accepting()
        return await self.collective.open(request)

    async def FinishWeightTransfer(self, request, context):
        return await self.collective.finish(request)

    async def GetInfo(self, request, context):
        return rollout_pb2.InfoResponse(
            model=self.engine.model_name, version=self.engine.version, queue_depth=self.engine.queue_depth,
            max_queue=self.engine.max_queue, tokens_per_second=self.engine.tokens_per_second(),
            replica_id=self.engine.replica_id, max_model_len=self.engine.max_model_len,
            weight_group_ranks=self.collective.ranks, weights_incomplete=self.engine.weights_incomplete,
        )


async def start_grpc_server(
    engine: RolloutEngine, receiver: WeightReceiver, collective: CollectiveReceiver, host: str, port: int, token: str,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts the Rollout and health services; returns the server, the port it bound and the health servicer."""
    server = grpc.aio.server(
        interceptors=[AsyncTokenInterceptor(token, PROTECTED_METHODS), AsyncStatusInterceptor()],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(engine, receiver, collective), server)
    bound, health_servicer = await start_aio_with_health(server, host, port, SERVICE, "rollout.grpc_port")
    loop = asyncio.get_running_loop()

    def generation_changed(generating: bool) -> None:
        # The Rollout service is NOT_SERVING while a broken transfer holds generation; the server ("") stays SERVING,
        # since the replica is alive and waits for the push that mends it (a liveness probe must not restart it).
        status = health_pb2.HealthCheckResponse.SERVING if generating else health_pb2.HealthCheckResponse.NOT_SERVING
        loop.call_soon_threadsafe(lambda: loop.create_task(health_servicer.set(SERVICE, status)))

    engine.generation_listeners.append(generation_changed)
    return server, bound, health_servicer
