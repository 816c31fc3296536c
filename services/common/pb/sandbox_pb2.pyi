from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    OK: _ClassVar[Status]
    RUNTIME_ERROR: _ClassVar[Status]
    TIMEOUT: _ClassVar[Status]
    MEMORY: _ClassVar[Status]
    PROCESS_LIMIT: _ClassVar[Status]
    OUTPUT_LIMIT: _ClassVar[Status]
    KILLED: _ClassVar[Status]
    SANDBOX_ERROR: _ClassVar[Status]
STATUS_UNSPECIFIED: Status
OK: Status
RUNTIME_ERROR: Status
TIMEOUT: Status
MEMORY: Status
PROCESS_LIMIT: Status
OUTPUT_LIMIT: Status
KILLED: Status
SANDBOX_ERROR: Status

class ExecuteRequest(_message.Message):
    __slots__ = ("code", "stdin", "language", "wall_s", "memory_mb", "output_bytes")
    CODE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    code: str
    stdin: bytes
    language: str
    wall_s: float
    memory_mb: int
    output_bytes: int
    def __init__(self, code: _Optional[str] = ..., stdin: _Optional[bytes] = ..., language: _Optional[str] = ..., wall_s: _Optional[float] = ..., memory_mb: _Optional[int] = ..., output_bytes: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("status", "reason", "exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "wall_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: str
    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_ms: float
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., wall_ms: _Optional[float] = ...) -> None: ...

class ExecuteBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ExecuteRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ExecuteRequest, _Mapping]]] = ...) -> None: ...

class ExecuteBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ExecuteResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[ExecuteResponse, _Mapping]]] = ...) -> None: ...
