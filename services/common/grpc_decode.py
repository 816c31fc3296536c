"""Undecodable request bytes answer INVALID_ARGUMENT instead of grpcio's INTERNAL.

grpcio parses each request with the method's deserializer before the servicer runs and answers
INTERNAL ("Exception deserializing request!") when that fails, which reads as a server bug. These
interceptors take the parsing over: the handler gets raw bytes, parses them itself and aborts with
INVALID_ARGUMENT naming the method when the bytes are not a valid message.
"""
from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError

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

    if handler.request_streaming:
        def parsed(request_iterator, context):
            return behavior((decode(raw, context) for raw in request_iterator), context)
    else:
        def parsed(raw, context):
            return behavior(decode(raw, context), context)
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
            async for item in behavior(await request_of(raw_or_iterator, context), context):
                yield item
    else:
        # Unary responses, and streaming handlers that are coroutines writing through
        # `context.write` (grpc.health.v1's Watch): awaited, not iterated. grpc.aio tells the two
        # kinds apart by the handler's type, so the wrapper must be the same kind as `behavior`.
        async def parsed(raw_or_iterator, context):
            return await behavior(await request_of(raw_or_iterator, context), context)
    return _FACTORY[kind](parsed, request_deserializer=None, response_serializer=handler.response_serializer)


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """For grpc.server: a request that does not parse is INVALID_ARGUMENT."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _sync_handler(handler, handler_call_details.method)


class AsyncDecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """For grpc.aio.server: a request that does not parse is INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _async_handler(handler, handler_call_details.method)
