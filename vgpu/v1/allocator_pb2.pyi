from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobConfig(_message.Message):
    __slots__ = ("model_type", "param_count", "batch_size", "input_size", "num_layers", "precision", "optimizer", "mode")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAM_COUNT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    param_count: int
    batch_size: int
    input_size: int
    num_layers: int
    precision: str
    optimizer: str
    mode: str
    def __init__(self, model_type: _Optional[str] = ..., param_count: _Optional[int] = ..., batch_size: _Optional[int] = ..., input_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., precision: _Optional[str] = ..., optimizer: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class ResourceRequest(_message.Message):
    __slots__ = ("app_id", "device_id", "memory_mib", "sm_pct", "priority", "deadline_s", "critical", "job", "pid")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_PCT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    device_id: str
    memory_mib: float
    sm_pct: float
    priority: int
    deadline_s: float
    critical: bool
    job: JobConfig
    pid: int
    def __init__(self, app_id: _Optional[str] = ..., device_id: _Optional[str] = ..., memory_mib: _Optional[float] = ..., sm_pct: _Optional[float] = ..., priority: _Optional[int] = ..., deadline_s: _Optional[float] = ..., critical: _Optional[bool] = ..., job: _Optional[_Union[JobConfig, _Mapping]] = ..., pid: _Optional[int] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("grant_id", "app_id", "device_id", "memory_mib", "sm_pct", "priority", "created_at_s", "updated_at_s", "source", "pid", "cold_start_mib")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_PCT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COLD_START_MIB_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    app_id: str
    device_id: str
    memory_mib: float
    sm_pct: float
    priority: int
    created_at_s: float
    updated_at_s: float
    source: str
    pid: int
    cold_start_mib: float
    def __init__(self, grant_id: _Optional[str] = ..., app_id: _Optional[str] = ..., device_id: _Optional[str] = ..., memory_mib: _Optional[float] = ..., sm_pct: _Optional[float] = ..., priority: _Optional[int] = ..., created_at_s: _Optional[float] = ..., updated_at_s: _Optional[float] = ..., source: _Optional[str] = ..., pid: _Optional[int] = ..., cold_start_mib: _Optional[float] = ...) -> None: ...

class RequestResourceAllocationRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: ResourceRequest
    def __init__(self, request: _Optional[_Union[ResourceRequest, _Mapping]] = ...) -> None: ...

class RequestResourceAllocationResponse(_message.Message):
    __slots__ = ("grant", "mem_limit")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    MEM_LIMIT_FIELD_NUMBER: _ClassVar[int]
    grant: Grant
    mem_limit: str
    def __init__(self, grant: _Optional[_Union[Grant, _Mapping]] = ..., mem_limit: _Optional[str] = ...) -> None: ...

class ReleaseResourcesRequest(_message.Message):
    __slots__ = ("grant_id",)
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    def __init__(self, grant_id: _Optional[str] = ...) -> None: ...

class ReleaseResourcesResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: Grant
    def __init__(self, released: _Optional[_Union[Grant, _Mapping]] = ...) -> None: ...

class MigInstance(_message.Message):
    __slots__ = ("instance_id", "profile", "start", "size", "mem_total_mib", "gpu_instance_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    profile: str
    start: int
    size: int
    mem_total_mib: float
    gpu_instance_id: int
    def __init__(self, instance_id: _Optional[str] = ..., profile: _Optional[str] = ..., start: _Optional[int] = ..., size: _Optional[int] = ..., mem_total_mib: _Optional[float] = ..., gpu_instance_id: _Optional[int] = ...) -> None: ...

class DeviceResources(_message.Message):
    __slots__ = ("device_id", "name", "mem_total_mib", "mem_granted_mib", "mem_available_mib", "sm_granted_pct", "sm_available_pct", "power_limit_mw", "power_min_mw", "power_max_mw", "power_default_mw", "mig_enabled", "mig_instances", "index", "pci_bus_id", "mem_used_mib", "power_draw_mw", "temperature_c", "sm_clock_mhz", "sm_util_pct", "mem_bw_util_pct", "dry_run", "profiler_streams", "newest_signature_age_s", "processes")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEM_GRANTED_MIB_FIELD_NUMBER: _ClassVar[int]
    MEM_AVAILABLE_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_GRANTED_PCT_FIELD_NUMBER: _ClassVar[int]
    SM_AVAILABLE_PCT_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_MW_FIELD_NUMBER: _ClassVar[int]
    POWER_MIN_MW_FIELD_NUMBER: _ClassVar[int]
    POWER_MAX_MW_FIELD_NUMBER: _ClassVar[int]
    POWER_DEFAULT_MW_FIELD_NUMBER: _ClassVar[int]
    MIG_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MIG_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    POWER_DRAW_MW_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    SM_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    MEM_BW_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PROFILER_STREAMS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_SIGNATURE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    name: str
    mem_total_mib: float
    mem_granted_mib: float
    mem_available_mib: float
    sm_granted_pct: float
    sm_available_pct: float
    power_limit_mw: int
    power_min_mw: int
    power_max_mw: int
    power_default_mw: int
    mig_enabled: bool
    mig_instances: _containers.RepeatedCompositeFieldContainer[MigInstance]
    index: int
    pci_bus_id: str
    mem_used_mib: float
    power_draw_mw: int
    temperature_c: int
    sm_clock_mhz: int
    sm_util_pct: float
    mem_bw_util_pct: float
    dry_run: bool
    profiler_streams: int
    newest_signature_age_s: float
    processes: _containers.RepeatedCompositeFieldContainer[DeviceProcess]
    def __init__(self, device_id: _Optional[str] = ..., name: _Optional[str] = ..., mem_total_mib: _Optional[float] = ..., mem_granted_mib: _Optional[float] = ..., mem_available_mib: _Optional[float] = ..., sm_granted_pct: _Optional[float] = ..., sm_available_pct: _Optional[float] = ..., power_limit_mw: _Optional[int] = ..., power_min_mw: _Optional[int] = ..., power_max_mw: _Optional[int] = ..., power_default_mw: _Optional[int] = ..., mig_enabled: _Optional[bool] = ..., mig_instances: _Optional[_Iterable[_Union[MigInstance, _Mapping]]] = ..., index: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., mem_used_mib: _Optional[float] = ..., power_draw_mw: _Optional[int] = ..., temperature_c: _Optional[int] = ..., sm_clock_mhz: _Optional[int] = ..., sm_util_pct: _Optional[float] = ..., mem_bw_util_pct: _Optional[float] = ..., dry_run: _Optional[bool] = ..., profiler_streams: _Optional[int] = ..., newest_signature_age_s: _Optional[float] = ..., processes: _Optional[_Iterable[_Union[DeviceProcess, _Mapping]]] = ...) -> None: ...

class DeviceProcess(_message.Message):
    __slots__ = ("pid", "used_mib", "gpu_instance_id", "user", "command")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MIB_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_mib: float
    gpu_instance_id: int
    user: str
    command: str
    def __init__(self, pid: _Optional[int] = ..., used_mib: _Optional[float] = ..., gpu_instance_id: _Optional[int] = ..., user: _Optional[str] = ..., command: _Optional[str] = ...) -> None: ...

class GetAvailableResourcesRequest(_message.Message):
    __slots__ = ("device_id",)
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    def __init__(self, device_id: _Optional[str] = ...) -> None: ...

class GetAvailableResourcesResponse(_message.Message):
    __slots__ = ("devices", "dry_run", "profiler_streams_open", "backend")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PROFILER_STREAMS_OPEN_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceResources]
    dry_run: bool
    profiler_streams_open: int
    backend: str
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceResources, _Mapping]]] = ..., dry_run: _Optional[bool] = ..., profiler_streams_open: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class AppLimits(_message.Message):
    __slots__ = ("app_id", "max_memory_mib", "max_sm_pct", "priority")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    MAX_SM_PCT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    max_memory_mib: float
    max_sm_pct: float
    priority: int
    def __init__(self, app_id: _Optional[str] = ..., max_memory_mib: _Optional[float] = ..., max_sm_pct: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class SetResourceLimitsRequest(_message.Message):
    __slots__ = ("limits",)
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    limits: AppLimits
    def __init__(self, limits: _Optional[_Union[AppLimits, _Mapping]] = ...) -> None: ...

class SetResourceLimitsResponse(_message.Message):
    __slots__ = ("limits",)
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    limits: AppLimits
    def __init__(self, limits: _Optional[_Union[AppLimits, _Mapping]] = ...) -> None: ...

class ListApplicationsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ApplicationInfo(_message.Message):
    __slots__ = ("app_id", "grants", "limits", "mem_used_mib", "sm_util_pct", "forecast_mem_p90_mib", "forecast_sm_p90_pct", "last_seen_s", "device_id", "forecast_mem_p50_mib", "forecast_sm_p50_pct", "processes", "mem_limit", "mem_limit_reason", "claimed", "claimed_at_s", "plan_memory_mib", "plan_sm_pct", "plan_mem_rule", "plan_sm_rule", "claimed_by_uid")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    FORECAST_MEM_P90_MIB_FIELD_NUMBER: _ClassVar[int]
    FORECAST_SM_P90_PCT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    FORECAST_MEM_P50_MIB_FIELD_NUMBER: _ClassVar[int]
    FORECAST_SM_P50_PCT_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MEM_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MEM_LIMIT_REASON_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_AT_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    PLAN_SM_PCT_FIELD_NUMBER: _ClassVar[int]
    PLAN_MEM_RULE_FIELD_NUMBER: _ClassVar[int]
    PLAN_SM_RULE_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BY_UID_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    grants: _containers.RepeatedCompositeFieldContainer[Grant]
    limits: AppLimits
    mem_used_mib: float
    sm_util_pct: float
    forecast_mem_p90_mib: float
    forecast_sm_p90_pct: float
    last_seen_s: float
    device_id: str
    forecast_mem_p50_mib: float
    forecast_sm_p50_pct: float
    processes: _containers.RepeatedCompositeFieldContainer[AppProcess]
    mem_limit: str
    mem_limit_reason: str
    claimed: bool
    claimed_at_s: float
    plan_memory_mib: float
    plan_sm_pct: float
    plan_mem_rule: str
    plan_sm_rule: str
    claimed_by_uid: int
    def __init__(self, app_id: _Optional[str] = ..., grants: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ..., limits: _Optional[_Union[AppLimits, _Mapping]] = ..., mem_used_mib: _Optional[float] = ..., sm_util_pct: _Optional[float] = ..., forecast_mem_p90_mib: _Optional[float] = ..., forecast_sm_p90_pct: _Optional[float] = ..., last_seen_s: _Optional[float] = ..., device_id: _Optional[str] = ..., forecast_mem_p50_mib: _Optional[float] = ..., forecast_sm_p50_pct: _Optional[float] = ..., processes: _Optional[_Iterable[_Union[AppProcess, _Mapping]]] = ..., mem_limit: _Optional[str] = ..., mem_limit_reason: _Optional[str] = ..., claimed: _Optional[bool] = ..., claimed_at_s: _Optional[float] = ..., plan_memory_mib: _Optional[float] = ..., plan_sm_pct: _Optional[float] = ..., plan_mem_rule: _Optional[str] = ..., plan_sm_rule: _Optional[str] = ..., claimed_by_uid: _Optional[int] = ...) -> None: ...

class AppProcess(_message.Message):
    __slots__ = ("pid", "user", "command")
    PID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    pid: int
    user: str
    command: str
    def __init__(self, pid: _Optional[int] = ..., user: _Optional[str] = ..., command: _Optional[str] = ...) -> None: ...

class ListApplicationsResponse(_message.Message):
    __slots__ = ("apps",)
    APPS_FIELD_NUMBER: _ClassVar[int]
    apps: _containers.RepeatedCompositeFieldContainer[ApplicationInfo]
    def __init__(self, apps: _Optional[_Iterable[_Union[ApplicationInfo, _Mapping]]] = ...) -> None: ...

class WatchAllocationsRequest(_message.Message):
    __slots__ = ("app_id",)
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    def __init__(self, app_id: _Optional[str] = ...) -> None: ...

class AllocationEvent(_message.Message):
    __slots__ = ("kind", "grant", "at_s", "detail", "mem_limit")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[AllocationEvent.Kind]
        GRANTED: _ClassVar[AllocationEvent.Kind]
        RESIZED: _ClassVar[AllocationEvent.Kind]
        RELEASED: _ClassVar[AllocationEvent.Kind]
        LIMITS_CHANGED: _ClassVar[AllocationEvent.Kind]
        POWER_LIMIT_CHANGED: _ClassVar[AllocationEvent.Kind]
        MIG_CHANGED: _ClassVar[AllocationEvent.Kind]
    KIND_UNSPECIFIED: AllocationEvent.Kind
    GRANTED: AllocationEvent.Kind
    RESIZED: AllocationEvent.Kind
    RELEASED: AllocationEvent.Kind
    LIMITS_CHANGED: AllocationEvent.Kind
    POWER_LIMIT_CHANGED: AllocationEvent.Kind
    MIG_CHANGED: AllocationEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MEM_LIMIT_FIELD_NUMBER: _ClassVar[int]
    kind: AllocationEvent.Kind
    grant: Grant
    at_s: float
    detail: str
    mem_limit: str
    def __init__(self, kind: _Optional[_Union[AllocationEvent.Kind, str]] = ..., grant: _Optional[_Union[Grant, _Mapping]] = ..., at_s: _Optional[float] = ..., detail: _Optional[str] = ..., mem_limit: _Optional[str] = ...) -> None: ...

class GetAppHistoryRequest(_message.Message):
    __slots__ = ("app_id", "device_id", "since_s")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_S_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    device_id: str
    since_s: float
    def __init__(self, app_id: _Optional[str] = ..., device_id: _Optional[str] = ..., since_s: _Optional[float] = ...) -> None: ...

class HistoryEvent(_message.Message):
    __slots__ = ("t_unix_s", "kind", "detail", "mem_granted_mib")
    T_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MEM_GRANTED_MIB_FIELD_NUMBER: _ClassVar[int]
    t_unix_s: float
    kind: str
    detail: str
    mem_granted_mib: float
    def __init__(self, t_unix_s: _Optional[float] = ..., kind: _Optional[str] = ..., detail: _Optional[str] = ..., mem_granted_mib: _Optional[float] = ...) -> None: ...

class AppHistory(_message.Message):
    __slots__ = ("app_id", "device_id", "t_unix_s", "mem_used_mib", "mem_p50_mib", "mem_p90_mib", "mem_granted_mib", "sm_used_pct", "sm_p90_pct", "sm_granted_pct", "events")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    T_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    MEM_P50_MIB_FIELD_NUMBER: _ClassVar[int]
    MEM_P90_MIB_FIELD_NUMBER: _ClassVar[int]
    MEM_GRANTED_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_USED_PCT_FIELD_NUMBER: _ClassVar[int]
    SM_P90_PCT_FIELD_NUMBER: _ClassVar[int]
    SM_GRANTED_PCT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    device_id: str
    t_unix_s: _containers.RepeatedScalarFieldContainer[float]
    mem_used_mib: _containers.RepeatedScalarFieldContainer[float]
    mem_p50_mib: _containers.RepeatedScalarFieldContainer[float]
    mem_p90_mib: _containers.RepeatedScalarFieldContainer[float]
    mem_granted_mib: _containers.RepeatedScalarFieldContainer[float]
    sm_used_pct: _containers.RepeatedScalarFieldContainer[float]
    sm_p90_pct: _containers.RepeatedScalarFieldContainer[float]
    sm_granted_pct: _containers.RepeatedScalarFieldContainer[float]
    events: _containers.RepeatedCompositeFieldContainer[HistoryEvent]
    def __init__(self, app_id: _Optional[str] = ..., device_id: _Optional[str] = ..., t_unix_s: _Optional[_Iterable[float]] = ..., mem_used_mib: _Optional[_Iterable[float]] = ..., mem_p50_mib: _Optional[_Iterable[float]] = ..., mem_p90_mib: _Optional[_Iterable[float]] = ..., mem_granted_mib: _Optional[_Iterable[float]] = ..., sm_used_pct: _Optional[_Iterable[float]] = ..., sm_p90_pct: _Optional[_Iterable[float]] = ..., sm_granted_pct: _Optional[_Iterable[float]] = ..., events: _Optional[_Iterable[_Union[HistoryEvent, _Mapping]]] = ...) -> None: ...

class GetAppHistoryResponse(_message.Message):
    __slots__ = ("apps", "now_unix_s")
    APPS_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    apps: _containers.RepeatedCompositeFieldContainer[AppHistory]
    now_unix_s: float
    def __init__(self, apps: _Optional[_Iterable[_Union[AppHistory, _Mapping]]] = ..., now_unix_s: _Optional[float] = ...) -> None: ...

class ForgetApplicationsRequest(_message.Message):
    __slots__ = ("app_ids", "claimed_by_uid")
    APP_IDS_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BY_UID_FIELD_NUMBER: _ClassVar[int]
    app_ids: _containers.RepeatedScalarFieldContainer[str]
    claimed_by_uid: int
    def __init__(self, app_ids: _Optional[_Iterable[str]] = ..., claimed_by_uid: _Optional[int] = ...) -> None: ...

class KeptClaim(_message.Message):
    __slots__ = ("app_id", "reason")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    reason: str
    def __init__(self, app_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ForgetApplicationsResponse(_message.Message):
    __slots__ = ("forgotten", "kept")
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    forgotten: _containers.RepeatedScalarFieldContainer[str]
    kept: _containers.RepeatedCompositeFieldContainer[KeptClaim]
    def __init__(self, forgotten: _Optional[_Iterable[str]] = ..., kept: _Optional[_Iterable[_Union[KeptClaim, _Mapping]]] = ...) -> None: ...
