"""Typed errors of every service, mapped to gRPC status codes and HTTP statuses in one place."""
from __future__ import annotations

import grpc


class DockrlError(Exception):
    """Base of the errors a caller is meant to see; the message names the field and the limit."""

    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


class InvalidArgument(DockrlError):
    """The request is malformed: a field is missing, of the wrong type or out of range."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class NotFound(DockrlError):
    """The named thing (model, request, replica) does not exist."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class ResourceExhausted(DockrlError):
    """The service is at its queue bound; retry later."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unauthenticated(DockrlError):
    """The call changes state and the shared token is missing or wrong."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class FailedPrecondition(DockrlError):
    """The call is valid but the state forbids it now (e.g. a stale lease, a push in progress)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class Unavailable(DockrlError):
    """A dependency (Redis, a replica, the engine) cannot be reached."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


def http_status(exc: Exception) -> int:
    """The HTTP status for `exc`."""
    return exc.http_status if isinstance(exc, DockrlError) else 500
