from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("response", "response_token_ids", "label", "response_length", "prompt")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    response: str
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    label: str
    response_length: int
    prompt: str
    def __init__(self, response: _Optional[str] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., label: _Optional[str] = ..., response_length: _Optional[int] = ..., prompt: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "verifier_function", "verifier_weight")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    verifier_function: _containers.RepeatedScalarFieldContainer[str]
    verifier_weight: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., verifier_function: _Optional[_Iterable[str]] = ..., verifier_weight: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifierPart(_message.Message):
    __slots__ = ("name", "score", "timed_out")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    score: float
    timed_out: bool
    def __init__(self, name: _Optional[str] = ..., score: _Optional[float] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("score", "parts", "overlong_penalty")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_PENALTY_FIELD_NUMBER: _ClassVar[int]
    score: float
    parts: _containers.RepeatedCompositeFieldContainer[VerifierPart]
    overlong_penalty: float
    def __init__(self, score: _Optional[float] = ..., parts: _Optional[_Iterable[_Union[VerifierPart, _Mapping]]] = ..., overlong_penalty: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ListVerifiersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("name", "description", "timeout_score")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SCORE_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    timeout_score: float
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., timeout_score: _Optional[float] = ...) -> None: ...

class ListVerifiersResponse(_message.Message):
    __slots__ = ("verifiers",)
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    verifiers: _containers.RepeatedCompositeFieldContainer[VerifierInfo]
    def __init__(self, verifiers: _Optional[_Iterable[_Union[VerifierInfo, _Mapping]]] = ...) -> None: ...
