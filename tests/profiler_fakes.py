"""Small fakes for the profiler's tests: a Device whose every read can be made to fail, a psutil module."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vgpu.device.base import (
    Backend,
    Device,
    GpuInstance,
    GpuInstanceProfile,
    MemoryInfo,
    Placement,
    PowerConstraints,
    ProcessInfo,
    ProcessUtilization,
    Utilization,
)
from vgpu.device.errors import DeviceError


class FakeDevice(Device):
    """Serves fixed values; `fail[method] = error` makes that read raise; `calls` counts reads."""

    def __init__(self, index: int = 0, procs: Sequence[ProcessInfo] = (), uuid: str | None = None) -> None:
        self._index = index
        self._uuid = uuid or f"GPU-fake-{index}"
        self.procs = list(procs)
        self.util_samples: list[ProcessUtilization] = []
        self.instances: list[GpuInstance] = []
        self.fail: dict[str, DeviceError] = {}
        self.calls: Counter[str] = Counter()
        self.since_args: list[int] = []

    def _enter(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.fail:
            raise self.fail[name]

    @property
    def index(self) -> int:
        return self._index

    @property
    def uuid(self) -> str:
        return self._uuid

    @property
    def name(self) -> str:
        return "Fake GPU"

    def memory(self) -> MemoryInfo:
        self._enter("memory")
        return MemoryInfo(total_mib=81559.0, used_mib=1000.0, free_mib=80559.0)

    def utilization(self) -> Utilization:
        self._enter("utilization")
        return Utilization(sm_pct=42.0, mem_bw_pct=17.0)

    def power_usage_mw(self) -> int:
        self._enter("power_usage_mw")
        return 250_000

    def power_limit_mw(self) -> int:
        self._enter("power_limit_mw")
        return 700_000

    def power_constraints(self) -> PowerConstraints:
        self._enter("power_constraints")
        return PowerConstraints(200_000, 700_000, 700_000)

    def sm_clock_mhz(self) -> int:
        self._enter("sm_clock_mhz")
        return 1980

    def pcie_throughput_kbps(self) -> tuple[float, float]:
        self._enter("pcie_throughput_kbps")
        return (1200.0, 3400.0)

    def processes(self) -> Sequence[ProcessInfo]:
        self._enter("processes")
        return list(self.procs)

    def process_utilization(self, since_us: int) -> Sequence[ProcessUtilization]:
        self._enter("process_utilization")
        self.since_args.append(since_us)
        return [s for s in self.util_samples if s.timestamp_us > since_us]

    def mig_enabled(self) -> bool:
        self._enter("mig_enabled")
        return bool(self.instances)

    def gpu_instance_profiles(self) -> Sequence[GpuInstanceProfile]:
        return []

    def gpu_instances(self) -> Sequence[GpuInstance]:
        self._enter("gpu_instances")
        return list(self.instances)

    def set_power_limit_mw(self, limit_mw: int) -> None:
        raise NotImplementedError

    def create_gpu_instance(self, profile_id: int, start: int) -> GpuInstance:
        raise NotImplementedError

    def destroy_gpu_instance(self, instance_id: int) -> None:
        raise NotImplementedError


def mig_instance(instance_id: int, mem_total_mib: float = 9856.0) -> GpuInstance:
    return GpuInstance(
        instance_id=instance_id,
        profile_id=19,
        profile_name="1g.10gb",
        placement=Placement(start=instance_id, size=1),
        uuid=f"MIG-fake-{instance_id}",
        mem_total_mib=mem_total_mib,
    )


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, devices: Sequence[FakeDevice]) -> None:
        self._devices = list(devices)
        self.devices_calls = 0

    def devices(self) -> Sequence[Device]:
        self.devices_calls += 1
        return list(self._devices)

    def close(self) -> None:
        pass


# --- psutil -----------------------------------------------------------------------------------------


class NoSuchProcess(Exception):
    pass


class AccessDenied(Exception):
    pass


@dataclass
class _Mem:
    rss: int


@dataclass
class _Io:
    read_bytes: int
    write_bytes: int


@dataclass
class _Uids:
    real: int


@dataclass
class FakeProc:
    pid: int
    name_: str = "python"
    start: float = 1000.0
    cpu: float = 55.0
    rss_bytes: int = 512 * 1024 * 1024
    read_bytes: int = 0
    write_bytes: int = 0
    uid: int = 0
    gone: bool = False
    # method -> exception to raise
    fail: dict[str, Exception] = field(default_factory=dict)

    def _check(self, method: str) -> None:
        if self.gone:
            raise NoSuchProcess(self.pid)
        if method in self.fail:
            raise self.fail[method]

    def name(self) -> str:
        self._check("name")
        return self.name_

    def create_time(self) -> float:
        self._check("create_time")
        return self.start

    def uids(self) -> _Uids:
        self._check("uids")
        return _Uids(self.uid)

    def cpu_percent(self) -> float:
        self._check("cpu_percent")
        return self.cpu

    def memory_info(self) -> _Mem:
        self._check("memory_info")
        return _Mem(self.rss_bytes)

    def io_counters(self) -> _Io:
        self._check("io_counters")
        return _Io(self.read_bytes, self.write_bytes)


class FakePsutil:
    """Enough of psutil's module surface for the sampler."""

    NoSuchProcess = NoSuchProcess
    AccessDenied = AccessDenied

    def __init__(self, procs: Sequence[FakeProc] = ()) -> None:
        self.procs: dict[int, FakeProc] = {p.pid: p for p in procs}

    def Process(self, pid: int) -> FakeProc:  # noqa: N802 - psutil's name
        proc = self.procs.get(pid)
        if proc is None or proc.gone:
            raise NoSuchProcess(pid)
        return proc


class RecordingLogger:
    """A structlog-like logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def _rec(self, level: str, event: str, **kw: Any) -> None:
        self.records.append((level, event, kw))

    def info(self, event: str, **kw: Any) -> None:
        self._rec("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._rec("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._rec("error", event, **kw)

    def matching(self, text: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [r for r in self.records if text in r[1]]


class ManualClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
