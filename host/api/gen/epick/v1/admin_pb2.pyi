from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadPolicyRequest(_message.Message):
    __slots__ = ("name", "wasm", "params_json", "weight", "shadow")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WASM_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    name: str
    wasm: bytes
    params_json: str
    weight: float
    shadow: bool
    def __init__(self, name: _Optional[str] = ..., wasm: _Optional[bytes] = ..., params_json: _Optional[str] = ..., weight: _Optional[float] = ..., shadow: _Optional[bool] = ...) -> None: ...

class RemovePolicyRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemovePolicyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetWeightRequest(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class ListPoliciesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("name", "version", "sha256", "weight", "shadow", "calls", "errors", "p50_us", "p99_us", "kind", "breaker", "shadow_agreement", "origin", "recoveries", "timeout_retries", "breaker_opens", "breakers", "smoke_fuel", "recovering_skips")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    P50_US_FIELD_NUMBER: _ClassVar[int]
    P99_US_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    SHADOW_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_RETRIES_FIELD_NUMBER: _ClassVar[int]
    BREAKER_OPENS_FIELD_NUMBER: _ClassVar[int]
    BREAKERS_FIELD_NUMBER: _ClassVar[int]
    SMOKE_FUEL_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_SKIPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    sha256: str
    weight: float
    shadow: bool
    calls: int
    errors: int
    p50_us: float
    p99_us: float
    kind: str
    breaker: str
    shadow_agreement: float
    origin: str
    recoveries: int
    timeout_retries: int
    breaker_opens: int
    breakers: str
    smoke_fuel: int
    recovering_skips: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., sha256: _Optional[str] = ..., weight: _Optional[float] = ..., shadow: _Optional[bool] = ..., calls: _Optional[int] = ..., errors: _Optional[int] = ..., p50_us: _Optional[float] = ..., p99_us: _Optional[float] = ..., kind: _Optional[str] = ..., breaker: _Optional[str] = ..., shadow_agreement: _Optional[float] = ..., origin: _Optional[str] = ..., recoveries: _Optional[int] = ..., timeout_retries: _Optional[int] = ..., breaker_opens: _Optional[int] = ..., breakers: _Optional[str] = ..., smoke_fuel: _Optional[int] = ..., recovering_skips: _Optional[int] = ...) -> None: ...

class ListPoliciesResponse(_message.Message):
    __slots__ = ("policies",)
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[PolicyInfo]
    def __init__(self, policies: _Optional[_Iterable[_Union[PolicyInfo, _Mapping]]] = ...) -> None: ...
