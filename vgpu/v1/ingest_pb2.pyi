from vgpu.v1 import signature_pb2 as _signature_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SignatureBatch(_message.Message):
    __slots__ = ("profiler_id", "tick", "sent_at_s", "signatures", "dropped_since_last", "columns")
    PROFILER_ID_FIELD_NUMBER: _ClassVar[int]
    TICK_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SINCE_LAST_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    profiler_id: str
    tick: int
    sent_at_s: float
    signatures: _containers.RepeatedCompositeFieldContainer[_signature_pb2.BehavioralSignature]
    dropped_since_last: int
    columns: SignatureColumns
    def __init__(self, profiler_id: _Optional[str] = ..., tick: _Optional[int] = ..., sent_at_s: _Optional[float] = ..., signatures: _Optional[_Iterable[_Union[_signature_pb2.BehavioralSignature, _Mapping]]] = ..., dropped_since_last: _Optional[int] = ..., columns: _Optional[_Union[SignatureColumns, _Mapping]] = ...) -> None: ...

class SignatureColumns(_message.Message):
    __slots__ = ("app_ids", "device_ids", "app_index_u32", "device_index_u32", "seq_u64", "timestamp_s_f64", "pid_u32", "column_names", "values_f64")
    APP_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    APP_INDEX_U32_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_U32_FIELD_NUMBER: _ClassVar[int]
    SEQ_U64_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_F64_FIELD_NUMBER: _ClassVar[int]
    PID_U32_FIELD_NUMBER: _ClassVar[int]
    COLUMN_NAMES_FIELD_NUMBER: _ClassVar[int]
    VALUES_F64_FIELD_NUMBER: _ClassVar[int]
    app_ids: _containers.RepeatedScalarFieldContainer[str]
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    app_index_u32: bytes
    device_index_u32: bytes
    seq_u64: bytes
    timestamp_s_f64: bytes
    pid_u32: bytes
    column_names: _containers.RepeatedScalarFieldContainer[str]
    values_f64: bytes
    def __init__(self, app_ids: _Optional[_Iterable[str]] = ..., device_ids: _Optional[_Iterable[str]] = ..., app_index_u32: _Optional[bytes] = ..., device_index_u32: _Optional[bytes] = ..., seq_u64: _Optional[bytes] = ..., timestamp_s_f64: _Optional[bytes] = ..., pid_u32: _Optional[bytes] = ..., column_names: _Optional[_Iterable[str]] = ..., values_f64: _Optional[bytes] = ...) -> None: ...

class HorizonForecast(_message.Message):
    __slots__ = ("horizon_s", "mem_p50_mib", "mem_p90_mib", "sm_p50_pct", "sm_p90_pct")
    HORIZON_S_FIELD_NUMBER: _ClassVar[int]
    MEM_P50_MIB_FIELD_NUMBER: _ClassVar[int]
    MEM_P90_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_P50_PCT_FIELD_NUMBER: _ClassVar[int]
    SM_P90_PCT_FIELD_NUMBER: _ClassVar[int]
    horizon_s: int
    mem_p50_mib: float
    mem_p90_mib: float
    sm_p50_pct: float
    sm_p90_pct: float
    def __init__(self, horizon_s: _Optional[int] = ..., mem_p50_mib: _Optional[float] = ..., mem_p90_mib: _Optional[float] = ..., sm_p50_pct: _Optional[float] = ..., sm_p90_pct: _Optional[float] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("app_id", "device_id", "forecasts", "recommended_mem_mib", "recommended_sm_pct", "source", "for_seq", "decided_at_s")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    FORECASTS_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_MEM_MIB_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_SM_PCT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FOR_SEQ_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_S_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    device_id: str
    forecasts: _containers.RepeatedCompositeFieldContainer[HorizonForecast]
    recommended_mem_mib: float
    recommended_sm_pct: float
    source: str
    for_seq: int
    decided_at_s: float
    def __init__(self, app_id: _Optional[str] = ..., device_id: _Optional[str] = ..., forecasts: _Optional[_Iterable[_Union[HorizonForecast, _Mapping]]] = ..., recommended_mem_mib: _Optional[float] = ..., recommended_sm_pct: _Optional[float] = ..., source: _Optional[str] = ..., for_seq: _Optional[int] = ..., decided_at_s: _Optional[float] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("index", "app_id", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    app_id: str
    reason: str
    def __init__(self, index: _Optional[int] = ..., app_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class IngestReply(_message.Message):
    __slots__ = ("tick", "accepted", "rejected", "decisions")
    TICK_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    tick: int
    accepted: int
    rejected: _containers.RepeatedCompositeFieldContainer[Rejection]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    def __init__(self, tick: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ...) -> None: ...
