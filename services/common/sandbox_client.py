"""A typed client of the Sandbox gRPC service, for any service that runs untrusted code (the reward service's code
verifiers, the agent's Python tool): it lives here, in the shared layer, since services never import each other."""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.common.auth import bearer_metadata
from services.common.pb import sandbox_pb2, sandbox_pb2_grpc


class ExecStatus(str, enum.Enum):
    """How a program ended, as the service reports it (proto/sandbox.proto's Status)."""

    OK = "ok"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    PROCESS_LIMIT = "process_limit"
    OUTPUT_LIMIT = "output_limit"
    KILLED = "killed"
    SANDBOX_ERROR = "sandbox_error"


@dataclass(frozen=True)
class Program:
    """One program to run; each limit 0 takes the server's default."""

    code: str
    stdin: bytes = b""
    wall_s: float = 0.0
    memory_mb: int = 0
    output_bytes: int = 0


@dataclass(frozen=True)
class ExecResult:
    """How one program ended and what it wrote."""

    status: ExecStatus
    reason: str
    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_ms: float


class SandboxClient:
    """Runs programs on the sandbox server at `target` ("host:port"); `token`: the shared token, when it has one."""

    def __init__(self, target: str, token: str = "", timeout_s: float = 600.0):
        self._channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024),
                                                               ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self._stub = sandbox_pb2_grpc.SandboxStub(self._channel)
        self._metadata = bearer_metadata(token)
        self._timeout_s = timeout_s

    def execute(self, program: Program) -> ExecResult:
        """Runs one program; grpc.RpcError on a refused request (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAUTHENTICATED)."""
        return _result(self._stub.Execute(_request(program), metadata=self._metadata, timeout=self._timeout_s))

    def execute_batch(self, programs: Sequence[Program]) -> list[ExecResult]:
        """Runs `programs` at once on the server's workers; results in order."""
        request = sandbox_pb2.ExecuteBatchRequest(items=[_request(p) for p in programs])
        response = self._stub.ExecuteBatch(request, metadata=self._metadata, timeout=self._timeout_s)
        return [_result(r) for r in response.results]

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> "SandboxClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _request(program: Program) -> sandbox_pb2.ExecuteRequest:
    return sandbox_pb2.ExecuteRequest(code=program.code, stdin=program.stdin, language="python", wall_s=program.wall_s,
                                      memory_mb=program.memory_mb, output_bytes=program.output_bytes)


def _result(response: sandbox_pb2.ExecuteResponse) -> ExecResult:
    return ExecResult(ExecStatus(sandbox_pb2.Status.Name(response.status).lower()), response.reason, response.exit_code,
                      response.stdout, response.stderr, response.stdout_truncated, response.stderr_truncated, response.wall_ms)
