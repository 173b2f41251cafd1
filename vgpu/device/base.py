"""The device layer's interface: one `Backend` of `Device`s, implemented by NVML and the simulator.

Values are frozen dataclasses with units in their names. Reads that a device cannot serve raise
`NotSupported`; callers that sample (the profiler) turn that into a missing field. Writes raise
typed errors from `vgpu.device.errors` and never fail silently.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class MemoryInfo:
    total_mib: float
    used_mib: float
    free_mib: float


@dataclass(frozen=True)
class Utilization:
    """nvmlDeviceGetUtilizationRates: share of the last sample period the SMs / memory were busy."""

    sm_pct: float
    mem_bw_pct: float


@dataclass(frozen=True)
class PowerConstraints:
    min_mw: int
    max_mw: int
    default_mw: int


@dataclass(frozen=True)
class ProcessInfo:
    """A process with a context on the device (nvmlDeviceGetComputeRunningProcesses)."""

    pid: int
    used_mib: float | None
    # GPU instance the process runs in, on a MIG-enabled device; None otherwise.
    gpu_instance_id: int | None = None


@dataclass(frozen=True)
class ProcessUtilization:
    """One nvmlDeviceGetProcessUtilization sample."""

    pid: int
    timestamp_us: int
    sm_pct: float
    mem_bw_pct: float


@dataclass(frozen=True)
class Placement:
    """Where a GPU instance sits, in memory slices (`nvidia-smi mig -lgipp`)."""

    start: int
    size: int


@dataclass(frozen=True)
class GpuInstanceProfile:
    """A MIG GPU-instance profile as the device reports it."""

    profile_id: int  # the id nvidia-smi shows (e.g. 19 = 1g.5gb on A100-40GB)
    name: str  # "1g.10gb"
    slice_count: int  # compute slices (1, 2, 3, 4 or 7)
    mem_mib: float
    sm_count: int
    max_count: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class GpuInstance:
    instance_id: int
    profile_id: int
    profile_name: str
    placement: Placement
    uuid: str  # "MIG-..."
    mem_total_mib: float


class MemoryLimitMib(NamedTuple):
    """A namespace's GPU memory limits (nvmlDeviceGetMemoryLimits_v1); `math.inf`: no limit."""

    soft_mib: float
    hard_mib: float
    used_mib: float  # what the namespace's processes use now


def check_memory_limit_namespace(namespace: str) -> None:
    """InvalidArgument unless `namespace` is an absolute cgroup path."""
    from vgpu.device.errors import InvalidArgument

    if not isinstance(namespace, str) or not namespace.startswith("/") or "\0" in namespace:
        raise InvalidArgument(f"a memory-limit namespace is an absolute cgroup path like '/system.slice/x', not {namespace!r}")


def check_memory_limit(namespace: str, soft_mib: float, hard_mib: float) -> None:
    """InvalidArgument unless the namespace is an absolute cgroup path and 0 < soft <= hard (inf: none)."""
    from vgpu.device.errors import InvalidArgument

    check_memory_limit_namespace(namespace)
    for what, mib in (("soft", soft_mib), ("hard", hard_mib)):
        if math.isnan(mib) or mib <= 0:
            raise InvalidArgument(f"{what} memory limit must be > 0 MiB (inf: no limit), not {mib}")
    if soft_mib > hard_mib:
        raise InvalidArgument(f"soft memory limit {soft_mib} MiB is above the hard limit {hard_mib} MiB")


class Device(abc.ABC):
    """One physical GPU."""

    @property
    @abc.abstractmethod
    def index(self) -> int: ...

    @property
    @abc.abstractmethod
    def uuid(self) -> str: ...

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    # --- reads -----------------------------------------------------------------------------
    @abc.abstractmethod
    def memory(self) -> MemoryInfo: ...

    @abc.abstractmethod
    def utilization(self) -> Utilization: ...

    @abc.abstractmethod
    def power_usage_mw(self) -> int: ...

    @abc.abstractmethod
    def power_limit_mw(self) -> int: ...

    @abc.abstractmethod
    def power_constraints(self) -> PowerConstraints: ...

    @abc.abstractmethod
    def sm_clock_mhz(self) -> int: ...

    @abc.abstractmethod
    def pcie_throughput_kbps(self) -> tuple[float, float]:
        """(tx, rx) in KB/s."""

    @abc.abstractmethod
    def processes(self) -> Sequence[ProcessInfo]: ...

    @abc.abstractmethod
    def process_utilization(self, since_us: int) -> Sequence[ProcessUtilization]:
        """Samples newer than `since_us` (the last-seen timestamp of the previous call)."""

    @abc.abstractmethod
    def mig_enabled(self) -> bool: ...

    @abc.abstractmethod
    def gpu_instance_profiles(self) -> Sequence[GpuInstanceProfile]: ...

    @abc.abstractmethod
    def gpu_instances(self) -> Sequence[GpuInstance]: ...

    # --- writes (typed errors on failure) --------------------------------------------------
    @abc.abstractmethod
    def set_power_limit_mw(self, limit_mw: int) -> None: ...

    @abc.abstractmethod
    def create_gpu_instance(self, profile_id: int, start: int) -> GpuInstance: ...

    @abc.abstractmethod
    def destroy_gpu_instance(self, instance_id: int) -> None: ...

    # --- optional: backends that cannot do these keep the defaults -------------------------
    @property
    def mig_reconfig_s(self) -> float:
        """Seconds a MIG reconfiguration takes before new instances are usable (a planning figure;
        no public source states it, a third-party report gives about 6 s)."""
        return 6.0

    def pci_bus_id(self) -> str:
        """The PCI bus id as nvidia-smi prints it ("00000000:17:00.0"); NotSupported where unknown."""
        from vgpu.device.errors import NotSupported

        raise NotSupported(f"{type(self).__name__} does not report a PCI bus id")

    def temperature_c(self) -> int:
        """GPU core temperature (degrees Celsius); NotSupported where the device does not report it."""
        from vgpu.device.errors import NotSupported

        raise NotSupported(f"{type(self).__name__} does not report a temperature")

    def set_mig_mode(self, enabled: bool) -> None:
        """Enable or disable MIG mode (a write: typed errors on failure)."""
        from vgpu.device.errors import NotSupported

        raise NotSupported(f"{type(self).__name__} cannot change MIG mode")

    def memory_limit_mib(self, namespace: str) -> MemoryLimitMib:
        """GPU memory limits of the processes in `namespace` (the cgroup path of an application's
        process; see the NVML backend), NVML's per-cgroup limits (driver R615+)."""
        from vgpu.device.errors import NotSupported

        raise NotSupported(f"{type(self).__name__} has no per-cgroup memory limits")

    def set_memory_limit_mib(self, namespace: str, soft_mib: float, hard_mib: float) -> None:
        """Cap the GPU memory of `namespace`'s processes (a write: typed errors on failure); `math.inf`
        removes a limit. A set to the current limits writes nothing."""
        from vgpu.device.errors import NotSupported

        raise NotSupported(f"{type(self).__name__} has no per-cgroup memory limits")


class Backend(abc.ABC):
    """A set of devices behind one vendor library (or the simulator)."""

    name: str

    @abc.abstractmethod
    def devices(self) -> Sequence[Device]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def device(self, device_id: str) -> Device:
        """The device with this UUID; NotFound otherwise."""
        from vgpu.device.errors import NotFound

        for dev in self.devices():
            if dev.uuid == device_id:
                return dev
        raise NotFound(f"no device {device_id!r}")
