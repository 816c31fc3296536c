"""The shared bearer token: its check and the gRPC server interceptors that apply it (the rollout's HTTP
server applies it in services/rollout/http_server.py).

Calls that change weights or data require `authorization: Bearer <token>` when a token is
configured; with no token configured every call passes (the local default).
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Collection

import grpc

from services.common.config import AuthConfig


def resolve_token(cfg: AuthConfig) -> str:
    """The configured token: `auth.token`, else the environment variable named by `auth.token_env`."""
    return cfg.token or os.environ.get(cfg.token_env, "")


def token_matches(expected: str, header: str | None) -> bool:
    """True when `header` is `Bearer <expected>` (constant-time compare) or no token is set."""
    if not expected:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].encode(), expected.encode())


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata that carries `token` (empty when no token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _deny(message: str) -> Callable:
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return abort


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses the `protected` methods (full names, '/pkg.Service/Method') without the token."""

    def __init__(self, token: str, protected: Collection[str]):
        self._token = token
        self._protected = frozenset(protected)

    def intercept_service(self, continuation, handler_call_details):
        if not self._token or handler_call_details.method not in self._protected:
            return continuation(handler_call_details)
        header = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if token_matches(self._token, header):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        message = f"{handler_call_details.method} changes state and needs 'authorization: Bearer <token>'"
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny(message))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny(message))
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny(message))
        return grpc.unary_unary_rpc_method_handler(_deny(message))


class AsyncTokenInterceptor(grpc.aio.ServerInterceptor):
    """The grpc.aio form of TokenInterceptor."""

    def __init__(self, token: str, protected: Collection[str]):
        self._sync = TokenInterceptor(token, protected)

    async def intercept_service(self, continuation, handler_call_details):
        if not self._sync._token or handler_call_details.method not in self._sync._protected:
            return await continuation(handler_call_details)
        header = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if token_matches(self._sync._token, header):
            return await continuation(handler_call_details)
        message = f"{handler_call_details.method} changes state and needs 'authorization: Bearer <token>'"

        async def deny(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
