"""A minimal in-memory Device/Backend for allocator and manager tests (no simulator needed).

It keeps the real constraints that matter to the allocator: the power range (a write outside it is
InvalidArgument, as NVML does), privilege (NoPermission), support (NotSupported) and it counts writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from vgpu.device.base import (
    Backend,
    Device,
    GpuInstance,
    GpuInstanceProfile,
    MemoryInfo,
    PowerConstraints,
    ProcessInfo,
    ProcessUtilization,
    Utilization,
)
from vgpu.device.errors import InvalidArgument, NoPermission, NotSupported

H100_CONSTRAINTS = PowerConstraints(200_000, 700_000, 700_000)


class FakeDevice(Device):
    def __init__(
        self,
        uuid: str = "GPU-fake-0",
        *,
        mem_total_mib: float = 81559.0,
        power_limit_mw: int = 700_000,
        constraints: PowerConstraints = H100_CONSTRAINTS,
        write_error: type[Exception] | None = None,
        readback_offset_mw: int = 0,
    ) -> None:
        self._uuid = uuid
        self.mem_total_mib = mem_total_mib
        self.limit_mw = power_limit_mw
        self.constraints = constraints
        self.write_error = write_error
        self.readback_offset_mw = readback_offset_mw
        self.writes: list[int] = []

    @property
    def index(self) -> int:
        return 0

    @property
    def uuid(self) -> str:
        return self._uuid

    @property
    def name(self) -> str:
        return "Fake H100"

    def memory(self) -> MemoryInfo:
        return MemoryInfo(self.mem_total_mib, 0.0, self.mem_total_mib)

    def utilization(self) -> Utilization:
        return Utilization(0.0, 0.0)

    def power_usage_mw(self) -> int:
        return 100_000

    def power_limit_mw(self) -> int:
        return self.limit_mw

    def power_constraints(self) -> PowerConstraints:
        return self.constraints

    def sm_clock_mhz(self) -> int:
        return 1980

    def pcie_throughput_kbps(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def processes(self) -> Sequence[ProcessInfo]:
        return []

    def process_utilization(self, since_us: int) -> Sequence[ProcessUtilization]:
        return []

    def mig_enabled(self) -> bool:
        return False

    def gpu_instance_profiles(self) -> Sequence[GpuInstanceProfile]:
        raise NotSupported("no MIG on the fake")

    def gpu_instances(self) -> Sequence[GpuInstance]:
        return []

    def set_power_limit_mw(self, limit_mw: int) -> None:
        self.writes.append(limit_mw)
        if self.write_error is not None:
            raise self.write_error("fake refusal")
        if not self.constraints.min_mw <= limit_mw <= self.constraints.max_mw:
            raise InvalidArgument(f"{limit_mw} outside the range")
        self.limit_mw = limit_mw + self.readback_offset_mw

    def create_gpu_instance(self, profile_id: int, start: int) -> GpuInstance:
        raise NotSupported("no MIG on the fake")

    def destroy_gpu_instance(self, instance_id: int) -> None:
        raise NotSupported("no MIG on the fake")


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, devices: Sequence[FakeDevice] | None = None) -> None:
        self._devices = list(devices) if devices is not None else [FakeDevice()]

    def devices(self) -> Sequence[Device]:
        return self._devices

    def close(self) -> None:
        pass


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# Keep NoPermission importable from here for parametrised failure scenarios.
__all__ = ["FakeBackend", "FakeClock", "FakeDevice", "NoPermission", "NotSupported"]
