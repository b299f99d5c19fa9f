from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Criticality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CRITICALITY_UNSPECIFIED: _ClassVar[Criticality]
    CRITICAL: _ClassVar[Criticality]
    STANDARD: _ClassVar[Criticality]
    SHEDDABLE: _ClassVar[Criticality]

class CompletionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[CompletionStatus]
    ERROR: _ClassVar[CompletionStatus]
    CANCELLED: _ClassVar[CompletionStatus]
CRITICALITY_UNSPECIFIED: Criticality
CRITICAL: Criticality
STANDARD: Criticality
SHEDDABLE: Criticality
OK: CompletionStatus
ERROR: CompletionStatus
CANCELLED: CompletionStatus

class PickRequest(_message.Message):
    __slots__ = ("request_id", "model", "adapter", "prompt", "criticality", "seed", "explain", "headers", "cache_salt", "pin_endpoint", "priority", "fairness_id", "slo_ttft_ms", "slo_tpot_ms", "session_id", "prompt_tokens")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CRITICALITY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PIN_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_ID_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    adapter: str
    prompt: str
    criticality: Criticality
    seed: int
    explain: bool
    headers: _containers.ScalarMap[str, str]
    cache_salt: str
    pin_endpoint: str
    priority: int
    fairness_id: str
    slo_ttft_ms: int
    slo_tpot_ms: int
    session_id: str
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., adapter: _Optional[str] = ..., prompt: _Optional[str] = ..., criticality: _Optional[_Union[Criticality, str]] = ..., seed: _Optional[int] = ..., explain: _Optional[bool] = ..., headers: _Optional[_Mapping[str, str]] = ..., cache_salt: _Optional[str] = ..., pin_endpoint: _Optional[str] = ..., priority: _Optional[int] = ..., fairness_id: _Optional[str] = ..., slo_ttft_ms: _Optional[int] = ..., slo_tpot_ms: _Optional[int] = ..., session_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("endpoint", "fallbacks", "decision_id", "explanation")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    decision_id: str
    explanation: Explanation
    def __init__(self, endpoint: _Optional[str] = ..., fallbacks: _Optional[_Iterable[str]] = ..., decision_id: _Optional[str] = ..., explanation: _Optional[_Union[Explanation, _Mapping]] = ...) -> None: ...

class Explanation(_message.Message):
    __slots__ = ("candidates", "snapshot_version", "skipped_policies", "queue_wait_ms", "queue_reason")
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_POLICIES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_REASON_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateExplanation]
    snapshot_version: int
    skipped_policies: _containers.RepeatedScalarFieldContainer[str]
    queue_wait_ms: float
    queue_reason: str
    def __init__(self, candidates: _Optional[_Iterable[_Union[CandidateExplanation, _Mapping]]] = ..., snapshot_version: _Optional[int] = ..., skipped_policies: _Optional[_Iterable[str]] = ..., queue_wait_ms: _Optional[float] = ..., queue_reason: _Optional[str] = ...) -> None: ...

class CandidateExplanation(_message.Message):
    __slots__ = ("endpoint", "total", "scores", "filtered_by", "rank", "shadow_scores", "reason", "in_flight", "picked_since_scrape", "prefix_blocks", "prefix_matched")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ShadowScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    FILTERED_BY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHADOW_SCORES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PICKED_SINCE_SCRAPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MATCHED_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    total: float
    scores: _containers.ScalarMap[str, float]
    filtered_by: str
    rank: int
    shadow_scores: _containers.ScalarMap[str, float]
    reason: str
    in_flight: int
    picked_since_scrape: int
    prefix_blocks: int
    prefix_matched: int
    def __init__(self, endpoint: _Optional[str] = ..., total: _Optional[float] = ..., scores: _Optional[_Mapping[str, float]] = ..., filtered_by: _Optional[str] = ..., rank: _Optional[int] = ..., shadow_scores: _Optional[_Mapping[str, float]] = ..., reason: _Optional[str] = ..., in_flight: _Optional[int] = ..., picked_since_scrape: _Optional[int] = ..., prefix_blocks: _Optional[int] = ..., prefix_matched: _Optional[int] = ...) -> None: ...

class CompletionReport(_message.Message):
    __slots__ = ("decision_id", "request_id", "endpoint", "status", "prompt_tokens", "completion_tokens", "ttft_seconds")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    request_id: str
    endpoint: str
    status: CompletionStatus
    prompt_tokens: int
    completion_tokens: int
    ttft_seconds: float
    def __init__(self, decision_id: _Optional[str] = ..., request_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., status: _Optional[_Union[CompletionStatus, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_seconds: _Optional[float] = ...) -> None: ...

class CompletionAck(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PickStreamRequest(_message.Message):
    __slots__ = ("id", "pick", "completion")
    ID_FIELD_NUMBER: _ClassVar[int]
    PICK_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    id: int
    pick: PickRequest
    completion: CompletionReport
    def __init__(self, id: _Optional[int] = ..., pick: _Optional[_Union[PickRequest, _Mapping]] = ..., completion: _Optional[_Union[CompletionReport, _Mapping]] = ...) -> None: ...

class PickStreamResponse(_message.Message):
    __slots__ = ("id", "pick", "completion", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    PICK_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    pick: PickResponse
    completion: CompletionAck
    error: StreamError
    def __init__(self, id: _Optional[int] = ..., pick: _Optional[_Union[PickResponse, _Mapping]] = ..., completion: _Optional[_Union[CompletionAck, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("model", "adapter", "criticality")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CRITICALITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    adapter: str
    criticality: Criticality
    def __init__(self, model: _Optional[str] = ..., adapter: _Optional[str] = ..., criticality: _Optional[_Union[Criticality, str]] = ...) -> None: ...

class EndpointWeight(_message.Message):
    __slots__ = ("endpoint", "weight", "filtered_by", "total")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    FILTERED_BY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    weight: float
    filtered_by: str
    total: float
    def __init__(self, endpoint: _Optional[str] = ..., weight: _Optional[float] = ..., filtered_by: _Optional[str] = ..., total: _Optional[float] = ...) -> None: ...

class WeightsTable(_message.Message):
    __slots__ = ("endpoints", "snapshot_version", "timestamp_ms", "snapshot_timestamp_ms", "reason")
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointWeight]
    snapshot_version: int
    timestamp_ms: int
    snapshot_timestamp_ms: int
    reason: str
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointWeight, _Mapping]]] = ..., snapshot_version: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., snapshot_timestamp_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...
