from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceCounters(_message.Message):
    __slots__ = ("mem_used_mib", "mem_total_mib", "sm_util_pct", "mem_bw_util_pct", "power_mw", "power_limit_mw", "sm_clock_mhz", "pcie_tx_kbps", "pcie_rx_kbps")
    MEM_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    MEM_BW_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    POWER_MW_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_MW_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    PCIE_TX_KBPS_FIELD_NUMBER: _ClassVar[int]
    PCIE_RX_KBPS_FIELD_NUMBER: _ClassVar[int]
    mem_used_mib: float
    mem_total_mib: float
    sm_util_pct: float
    mem_bw_util_pct: float
    power_mw: int
    power_limit_mw: int
    sm_clock_mhz: int
    pcie_tx_kbps: float
    pcie_rx_kbps: float
    def __init__(self, mem_used_mib: _Optional[float] = ..., mem_total_mib: _Optional[float] = ..., sm_util_pct: _Optional[float] = ..., mem_bw_util_pct: _Optional[float] = ..., power_mw: _Optional[int] = ..., power_limit_mw: _Optional[int] = ..., sm_clock_mhz: _Optional[int] = ..., pcie_tx_kbps: _Optional[float] = ..., pcie_rx_kbps: _Optional[float] = ...) -> None: ...

class ProcessCounters(_message.Message):
    __slots__ = ("gpu_mem_used_mib", "sm_util_pct")
    GPU_MEM_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    SM_UTIL_PCT_FIELD_NUMBER: _ClassVar[int]
    gpu_mem_used_mib: float
    sm_util_pct: float
    def __init__(self, gpu_mem_used_mib: _Optional[float] = ..., sm_util_pct: _Optional[float] = ...) -> None: ...

class HostCounters(_message.Message):
    __slots__ = ("cpu_pct", "rss_mib", "io_read_kbps", "io_write_kbps")
    CPU_PCT_FIELD_NUMBER: _ClassVar[int]
    RSS_MIB_FIELD_NUMBER: _ClassVar[int]
    IO_READ_KBPS_FIELD_NUMBER: _ClassVar[int]
    IO_WRITE_KBPS_FIELD_NUMBER: _ClassVar[int]
    cpu_pct: float
    rss_mib: float
    io_read_kbps: float
    io_write_kbps: float
    def __init__(self, cpu_pct: _Optional[float] = ..., rss_mib: _Optional[float] = ..., io_read_kbps: _Optional[float] = ..., io_write_kbps: _Optional[float] = ...) -> None: ...

class InAppCounters(_message.Message):
    __slots__ = ("torch_allocated_mib", "torch_reserved_mib", "torch_active_mib", "alloc_retries", "oom_count", "step", "applied_mem_limit_mib", "requests_running", "requests_waiting", "kv_used_mib", "kv_total_mib", "tokens_in_flight")
    TORCH_ALLOCATED_MIB_FIELD_NUMBER: _ClassVar[int]
    TORCH_RESERVED_MIB_FIELD_NUMBER: _ClassVar[int]
    TORCH_ACTIVE_MIB_FIELD_NUMBER: _ClassVar[int]
    ALLOC_RETRIES_FIELD_NUMBER: _ClassVar[int]
    OOM_COUNT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_MEM_LIMIT_MIB_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    torch_allocated_mib: float
    torch_reserved_mib: float
    torch_active_mib: float
    alloc_retries: int
    oom_count: int
    step: int
    applied_mem_limit_mib: float
    requests_running: int
    requests_waiting: int
    kv_used_mib: float
    kv_total_mib: float
    tokens_in_flight: int
    def __init__(self, torch_allocated_mib: _Optional[float] = ..., torch_reserved_mib: _Optional[float] = ..., torch_active_mib: _Optional[float] = ..., alloc_retries: _Optional[int] = ..., oom_count: _Optional[int] = ..., step: _Optional[int] = ..., applied_mem_limit_mib: _Optional[float] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., kv_used_mib: _Optional[float] = ..., kv_total_mib: _Optional[float] = ..., tokens_in_flight: _Optional[int] = ...) -> None: ...

class BehavioralSignature(_message.Message):
    __slots__ = ("app_id", "pid", "device_id", "timestamp_s", "seq", "device", "process", "host", "in_app")
    APP_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_S_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    IN_APP_FIELD_NUMBER: _ClassVar[int]
    app_id: str
    pid: int
    device_id: str
    timestamp_s: float
    seq: int
    device: DeviceCounters
    process: ProcessCounters
    host: HostCounters
    in_app: InAppCounters
    def __init__(self, app_id: _Optional[str] = ..., pid: _Optional[int] = ..., device_id: _Optional[str] = ..., timestamp_s: _Optional[float] = ..., seq: _Optional[int] = ..., device: _Optional[_Union[DeviceCounters, _Mapping]] = ..., process: _Optional[_Union[ProcessCounters, _Mapping]] = ..., host: _Optional[_Union[HostCounters, _Mapping]] = ..., in_app: _Optional[_Union[InAppCounters, _Mapping]] = ...) -> None: ...
