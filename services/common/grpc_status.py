"""One place where every gRPC service's errors become statuses: the server interceptors.

- Undecodable request bytes answer INVALID_ARGUMENT naming the method. grpcio parses each request
  with the method's deserializer before the servicer runs and answers INTERNAL ("Exception
  deserializing request!") when that fails, which reads as a server bug; these interceptors take
  the parsing over.
- A DockrlError the servicer raises, before its reply or in the middle of a streamed one (a vLLM
  engine that dies mid-stream raises Unavailable), ends the call with the error's own code
  (services/common/errors.py: INVALID_ARGUMENT, UNAVAILABLE, ...) instead of grpcio's UNKNOWN,
  so servicers raise and never catch to abort.
"""
from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import DockrlError

_BEHAVIOR = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary", (True, True): "stream_stream"}
_FACTORY = {
    (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
}


def _message(method: str, exc: Exception) -> str:
    return f"{method}: the request is not a valid protobuf message of this method ({exc})"


def _parts(handler):
    kind = (handler.request_streaming, handler.response_streaming)
    return kind, getattr(handler, _BEHAVIOR[kind]), handler.request_deserializer


def _sync_handler(handler, method: str):
    kind, behavior, deserialize = _parts(handler)

    def decode(raw: bytes, context):
        try:
            return deserialize(raw)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, exc))

    def request_of(raw_or_iterator, context):
        if handler.request_streaming:
            return (decode(raw, context) for raw in raw_or_iterator)
        return decode(raw_or_iterator, context)

    if handler.response_streaming:
        def parsed(raw_or_iterator, context):
            try:
                yield from behavior(request_of(raw_or_iterator, context), context)
            except DockrlError as exc:
                context.abort(exc.grpc_code, str(exc))
    else:
        def parsed(raw_or_iterator, context):
            try:
                return behavior(request_of(raw_or_iterator, context), context)
            except DockrlError as exc:
                context.abort(exc.grpc_code, str(exc))
    return _FACTORY[kind](parsed, request_deserializer=None, response_serializer=handler.response_serializer)


def _async_handler(handler, method: str):
    kind, behavior, deserialize = _parts(handler)

    async def decode(raw: bytes, context):
        try:
            return deserialize(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, exc))

    async def request_of(raw_or_iterator, context):
        if handler.request_streaming:
            return (await decode(raw, context) async for raw in raw_or_iterator)
        return await decode(raw_or_iterator, context)

    if handler.response_streaming and inspect.isasyncgenfunction(behavior):
        async def parsed(raw_or_iterator, context):
            try:
                async for item in behavior(await request_of(raw_or_iterator, context), context):
                    yield item
            except DockrlError as exc:
                await context.abort(exc.grpc_code, str(exc))
    else:
        # Unary responses, and streaming handlers that are coroutines writing through
        # `context.write` (grpc.health.v1's Watch): awaited, not iterated. grpc.aio tells the two
        # kinds apart by the handler's type, so the wrapper must be the same kind as `behavior`.
        async def parsed(raw_or_iterator, context):
            try:
                return await behavior(await request_of(raw_or_iterator, context), context)
            except DockrlError as exc:
                await context.abort(exc.grpc_code, str(exc))
    return _FACTORY[kind](parsed, request_deserializer=None, response_serializer=handler.response_serializer)


class StatusInterceptor(grpc.ServerInterceptor):
    """For grpc.server: a request that does not parse is INVALID_ARGUMENT; a DockrlError its own code."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _sync_handler(handler, handler_call_details.method)


class AsyncStatusInterceptor(grpc.aio.ServerInterceptor):
    """For grpc.aio.server: a request that does not parse is INVALID_ARGUMENT; a DockrlError its own code."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _async_handler(handler, handler_call_details.method)
