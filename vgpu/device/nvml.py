"""The NVML backend: real GPUs through nvidia-ml-py (`pynvml`).

NVML is thread-safe (NVML reference: simultaneous calls from several threads are safe), and this module
keeps no state per call, so a backend may be read from several threads. What a device shares between
calls (its MIG-profile cache, its handle after a lost GPU answers again) is replaced whole, never
updated in place.

The module is injected (`NvmlBackend(nvml=fake)` in tests; the real `pynvml`, imported lazily, by
default). This is the only file that imports pynvml. Every `pynvml.NVMLError` becomes a typed error
through `vgpu.device.errors.from_nvml_code`.

GPU instances are created the way `nvidia-smi mig -cgi P -C` does: the GPU instance at the requested
placement, then one compute instance spanning it (so a MIG device with a UUID exists for applications);
destroying removes the compute instances first. A failed compute-instance creation rolls the GPU
instance back.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vgpu.device.base import (
    Backend,
    Device,
    GpuInstance,
    GpuInstanceProfile,
    MemoryInfo,
    MemoryLimitMib,
    Placement,
    PowerConstraints,
    ProcessInfo,
    ProcessUtilization,
    Utilization,
    check_memory_limit,
    check_memory_limit_namespace,
)
from vgpu.device.errors import (
    DeviceError,
    DriverNotLoaded,
    GpuLost,
    InvalidArgument,
    LibraryNotFound,
    NoPermission,
    NotFound,
    NotSupported,
    Uninitialized,
    UnknownDeviceError,
    from_nvml_code,
)
from vgpu.device.skus import CI_PROFILE_FOR_SLICES

_MIB = 1024 * 1024
_NO_ID = 0xFFFFFFFF
# NVML_VALUE_NOT_AVAILABLE as an unsigned long long (usedGpuMemory's "not available").
_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
DEFAULT_MIG_RECONFIG_S = 6.0
# Compute slices of each NVML_COMPUTE_INSTANCE_PROFILE_* constant (nvml.h: 1, 2, 3, 4, 7, 8, 6, 1-rev1,
# 7-NVL); a constant not listed here is probed anyway.
_CI_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6, 7: 1, 8: 7}
# nvmlDevice{Set,Get}MemoryLimits_v1 (nvidia-ml-py 13.615+, driver R615+): their ctypes structures and
# the value meaning "no limit" (NVML_DEVICE_MEMORY_LIMIT_MAX, all bits set).
_LIMIT_FUNCTIONS = ("nvmlDeviceSetMemoryLimits_v1", "nvmlDeviceGetMemoryLimits_v1")
_NO_LIMIT = 0xFFFFFFFFFFFFFFFF


def _limit_mib(value: int) -> float:
    return math.inf if value >= _NO_LIMIT else value / _MIB


def _limit_bytes(mib: float) -> int:
    return _NO_LIMIT if math.isinf(mib) else min(_NO_LIMIT - 1, int(round(mib * _MIB)))


def _message(exc: Exception) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - str() of an unknown code asks the library, which may be absent
        return repr(exc)


class _Nvml:
    """The injected module plus the one place NVMLError is caught."""

    def __init__(self, module: Any) -> None:
        self.m = module

    def call(self, name: str, *args: Any) -> Any:
        fn: Callable[..., Any] = getattr(self.m, name)
        try:
            return fn(*args)
        except self.m.NVMLError as exc:
            code = int(getattr(exc, "value", -1))
            detail = f": {exc.__cause__}" if exc.__cause__ is not None else ""
            raise from_nvml_code(code, f"{name}: {_message(exc)} (NVML code {code}){detail}") from exc


class NvmlDevice(Device):
    """One GPU behind NVML."""

    def __init__(self, nvml: _Nvml, index: int, handle: Any, *, mig_reconfig_s: float) -> None:
        self._n = nvml
        self._index = index
        self._h = handle
        self._uuid = self._text(nvml.call("nvmlDeviceGetUUID", handle))
        self._name = self._text(nvml.call("nvmlDeviceGetName", handle))
        self._mig_reconfig_s = mig_reconfig_s
        self._profiles: list[tuple[int, GpuInstanceProfile]] | None = None  # (NVML constant, profile)
        self._lost = False  # a call answered GPU_IS_LOST: the handle is asked for again (`reopen`)

    @staticmethod
    def _text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    @property
    def index(self) -> int:
        return self._index

    @property
    def uuid(self) -> str:
        return self._uuid

    @property
    def name(self) -> str:
        return self._name

    @property
    def mig_reconfig_s(self) -> float:
        return self._mig_reconfig_s

    def _call(self, name: str, *args: Any) -> Any:
        """An NVML function on this GPU's handle."""
        return self._any(name, self._h, *args)

    def _any(self, name: str, *args: Any) -> Any:
        """An NVML function on any of this GPU's objects (its handle, MIG devices, instances); a lost GPU
        is noted so that `reopen` asks for a fresh handle."""
        try:
            return self._n.call(name, *args)
        except GpuLost:
            self._lost = True
            raise

    def reopen(self) -> bool:
        """After GPU_IS_LOST, ask NVML for the device's handle again by its UUID (a reset may leave the
        old handle stale: the NVML reference, nvmlDeviceSetMigMode, says a reset can change the device's
        attributes and callers should query them again). True when the device answers again; False
        while it is still gone. A device never lost keeps its handle."""
        if not self._lost:
            return True
        try:
            handle = self._n.call("nvmlDeviceGetHandleByUUID", self._uuid)
        except DeviceError:
            return False
        self._h, self._lost, self._profiles = handle, False, None
        return True

    # --- reads -----------------------------------------------------------------------------
    def memory(self) -> MemoryInfo:
        m = self._call("nvmlDeviceGetMemoryInfo")
        return MemoryInfo(total_mib=m.total / _MIB, used_mib=m.used / _MIB, free_mib=m.free / _MIB)

    def utilization(self) -> Utilization:
        u = self._call("nvmlDeviceGetUtilizationRates")
        return Utilization(sm_pct=float(u.gpu), mem_bw_pct=float(u.memory))

    def power_usage_mw(self) -> int:
        return int(self._call("nvmlDeviceGetPowerUsage"))

    def pci_bus_id(self) -> str:
        return self._text(self._call("nvmlDeviceGetPciInfo").busId)

    def temperature_c(self) -> int:
        return int(self._call("nvmlDeviceGetTemperature", self._n.m.NVML_TEMPERATURE_GPU))

    def power_limit_mw(self) -> int:
        return int(self._call("nvmlDeviceGetPowerManagementLimit"))

    def power_constraints(self) -> PowerConstraints:
        lo, hi = self._call("nvmlDeviceGetPowerManagementLimitConstraints")
        default = self._call("nvmlDeviceGetPowerManagementDefaultLimit")
        return PowerConstraints(min_mw=int(lo), max_mw=int(hi), default_mw=int(default))

    def sm_clock_mhz(self) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", self._n.m.NVML_CLOCK_SM))

    def pcie_throughput_kbps(self) -> tuple[float, float]:
        tx = self._call("nvmlDeviceGetPcieThroughput", self._n.m.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._call("nvmlDeviceGetPcieThroughput", self._n.m.NVML_PCIE_UTIL_RX_BYTES)
        return float(tx), float(rx)

    def _process_list(self, handle: Any, gi_of_handle: int | None) -> dict[tuple[int, int | None], ProcessInfo]:
        """The processes with a compute or graphics context on one handle (the GPU's, or a MIG device's
        whose instance is `gi_of_handle`), keyed by (pid, GPU instance id). The two lists are separate
        in NVML and a process with both contexts is in both (NVML reference,
        nvmlDeviceGetComputeRunningProcesses: graphics applications are not listed by it; nvitop merges
        them by pid): it is kept once, with the memory of whichever list reports it. A process whose
        memory NVML cannot give (usedGpuMemory NVML_VALUE_NOT_AVAILABLE, None in pynvml) has
        `used_mib` None."""
        listed = list(self._any("nvmlDeviceGetComputeRunningProcesses", handle))
        try:
            listed += self._any("nvmlDeviceGetGraphicsRunningProcesses", handle)
        except NotSupported:
            pass  # no graphics contexts on this device: the compute list is the whole answer
        out: dict[tuple[int, int | None], ProcessInfo] = {}
        for p in listed:
            used = getattr(p, "usedGpuMemory", None)
            if used is not None and int(used) >= _NOT_AVAILABLE:
                used = None  # the raw sentinel, where a pynvml does not turn it into None
            gi = getattr(p, "gpuInstanceId", _NO_ID)
            gi_id = gi_of_handle if gi is None or int(gi) == _NO_ID else int(gi)
            info = ProcessInfo(pid=int(p.pid), used_mib=None if used is None else int(used) / _MIB, gpu_instance_id=gi_id)
            key = (info.pid, info.gpu_instance_id)
            if key not in out or out[key].used_mib is None:
                out[key] = info
        return out

    def processes(self) -> Sequence[ProcessInfo]:
        """Every process with a context on the GPU. On a MIG-enabled GPU the GPU's own handle lists the
        processes of every instance only for a privileged caller, and may not give their memory; the
        NVML reference (nvmlDeviceGetComputeRunningProcesses) says per-instance information comes from
        the MIG device handles, so those fill in what the GPU's list lacks."""
        try:
            procs = self._process_list(self._h, None)
        except NoPermission:
            if not self._mig_on():
                raise
            procs, need_instances = {}, True
        else:
            need_instances = any(p.used_mib is None and p.gpu_instance_id is not None for p in procs.values())
        if need_instances:
            try:
                for gi_id, mig in self._mig_devices():
                    for key, info in self._process_list(mig, gi_id).items():
                        have = procs.get(key)
                        if have is None or have.used_mib is None:
                            procs[key] = info
            except GpuLost:
                raise
            except DeviceError:
                if not procs:
                    raise  # nothing listed at all: the read failed
                # the GPU's own list stands; the memory it lacks stays unknown until the next read
        return sorted(procs.values(), key=lambda p: (p.pid, -1 if p.gpu_instance_id is None else p.gpu_instance_id))

    def process_utilization(self, since_us: int) -> Sequence[ProcessUtilization]:
        """Samples newer than `since_us` (CPU timestamps in microseconds). What NVML answers is checked:
        NOT_FOUND means no sample is newer (NVML reference, nvmlDeviceGetProcessUtilization); pynvml
        raises NVMLError(NVML_SUCCESS) when the sizing call answers SUCCESS, which also means none; and a
        sample with pid 0, a utilization above 100 % or a timestamp not newer than `since_us` is dropped,
        as nvtop drops them (its issue #110: drivers have answered such samples)."""
        try:
            samples = self._call("nvmlDeviceGetProcessUtilization", int(since_us))
        except NotFound:
            return []  # NVML's answer when no sample is newer than since_us
        except UnknownDeviceError as exc:
            if exc.nvml_code == int(self._n.m.NVML_SUCCESS):
                return []
            raise
        out = [
            ProcessUtilization(
                pid=int(s.pid), timestamp_us=int(s.timeStamp), sm_pct=float(s.smUtil), mem_bw_pct=float(s.memUtil)
            )
            for s in samples
            if int(s.timeStamp) > since_us and int(s.pid) > 0 and 0 <= int(s.smUtil) <= 100 and 0 <= int(s.memUtil) <= 100
        ]
        out.sort(key=lambda u: (u.timestamp_us, u.pid))
        return out

    def _mig_on(self) -> bool:
        """MIG mode is on now; False on a GPU without MIG."""
        try:
            return self.mig_enabled()
        except NotSupported:
            return False

    def mig_enabled(self) -> bool:
        current, _pending = self._call("nvmlDeviceGetMigMode")
        return int(current) == int(self._n.m.NVML_DEVICE_MIG_ENABLE)

    def _require_mig(self, what: str) -> None:
        if not self.mig_enabled():
            raise NotSupported(f"{what}: MIG is disabled on GPU {self._index}")

    def _profile_table(self) -> list[tuple[int, GpuInstanceProfile]]:
        if self._profiles is not None:
            return self._profiles
        m = self._n.m
        table = []
        for const in range(int(m.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            try:
                info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", const)
            except (NotSupported, InvalidArgument):
                continue
            count = ctypes.c_uint(0)
            self._call("nvmlDeviceGetGpuInstancePossiblePlacements", info.id, None, ctypes.byref(count))
            array = (m.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
            self._call("nvmlDeviceGetGpuInstancePossiblePlacements", info.id, array, ctypes.byref(count))
            name = getattr(info, "name", b"")
            table.append(
                (
                    const,
                    GpuInstanceProfile(
                        profile_id=int(info.id),
                        name=self._text(name) or f"{info.sliceCount}g.{info.memorySizeMB // 1024}gb",
                        slice_count=int(info.sliceCount),
                        mem_mib=float(info.memorySizeMB),
                        sm_count=int(info.multiprocessorCount),
                        max_count=int(info.instanceCount),
                        placements=tuple(
                            Placement(start=int(array[i].start), size=int(array[i].size)) for i in range(count.value)
                        ),
                    ),
                )
            )
        if table:  # every query failing leaves nothing worth keeping: ask again next time
            self._profiles = table
        return table

    def gpu_instance_profiles(self) -> Sequence[GpuInstanceProfile]:
        self._require_mig("gpu_instance_profiles")
        return [p for _, p in self._profile_table()]

    def _profile(self, profile_id: int) -> GpuInstanceProfile:
        """The profile with this id (the table is static: read once, after a MIG check)."""
        table = self._profiles if self._profiles is not None else [(0, p) for p in self.gpu_instance_profiles()]
        for _, prof in table:
            if prof.profile_id == profile_id:
                return prof
        known = ", ".join(f"{p.profile_id} ({p.name})" for _, p in table)
        raise InvalidArgument(f"GPU {self._index} has no GPU-instance profile id {profile_id}; known: {known}")

    def _mig_devices(self) -> Iterator[tuple[int, Any]]:
        """(GPU instance id, MIG device handle) of each MIG device (one per compute instance); an index
        with no MIG device answers NOT_FOUND (NVML reference, nvmlDeviceGetMigDeviceHandleByIndex)."""
        for i in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount"))):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", i)
            except (NotFound, InvalidArgument):
                continue
            yield int(self._any("nvmlDeviceGetGpuInstanceId", mig)), mig

    def _mig_uuids(self, wanted: set[int]) -> dict[int, str]:
        """GPU instance id -> UUID of its MIG device, for the `wanted` instances (only an instance
        with a compute instance has one); the scan stops once all are found."""
        out: dict[int, str] = {}
        if not wanted:
            return out
        for gi_id, mig in self._mig_devices():
            if gi_id in wanted and gi_id not in out:
                out[gi_id] = self._text(self._any("nvmlDeviceGetUUID", mig))
                if len(out) == len(wanted):
                    break
        return out

    def _gi_value(self, info: Any, uuids: dict[int, str]) -> GpuInstance:
        """A GpuInstance from nvmlGpuInstanceGetInfo's answer."""
        prof = self._profile(int(info.profileId))
        return GpuInstance(
            instance_id=int(info.id),
            profile_id=int(info.profileId),
            profile_name=prof.name,
            placement=Placement(start=int(info.placement.start), size=int(info.placement.size)),
            uuid=uuids.get(int(info.id), ""),
            mem_total_mib=prof.mem_mib,
        )

    def gpu_instances(self) -> Sequence[GpuInstance]:
        self._require_mig("gpu_instances")
        m = self._n.m
        infos: list[Any] = []  # pynvml's c_nvmlGpuInstanceInfo_t, untyped
        for _, prof in self._profile_table():
            array = (m.c_nvmlGpuInstance_t * max(1, prof.max_count))()
            count = ctypes.c_uint(len(array))
            self._call("nvmlDeviceGetGpuInstances", prof.profile_id, array, ctypes.byref(count))
            infos.extend(self._any("nvmlGpuInstanceGetInfo", array[i]) for i in range(count.value))
        uuids = self._mig_uuids({int(info.id) for info in infos})
        return sorted((self._gi_value(info, uuids) for info in infos), key=lambda g: g.instance_id)

    # --- per-cgroup memory limits ----------------------------------------------------------
    # nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1 take a `nameSpace` string. No public
    # NVIDIA document we could find says what it holds beyond "cgroup"; we pass the cgroup path of the
    # application's process (the path in /proc/<pid>/cgroup, e.g. "/system.slice/job.scope"). Limits
    # are bytes; NVML_DEVICE_MEMORY_LIMIT_MAX means none (math.inf here).
    def _limits_struct(self, kind: str, namespace: str) -> Any:
        m = self._n.m
        struct_t = getattr(m, f"c_nvml{kind}MemoryLimits_v1_t", None)
        if struct_t is None or not all(hasattr(m, name) for name in _LIMIT_FUNCTIONS):
            raise NotSupported("per-cgroup memory limits need nvidia-ml-py 13.615 or newer (nvmlDeviceSetMemoryLimits_v1)")
        limits = struct_t()
        limits.nameSpace = namespace.encode()
        return limits

    def memory_limit_mib(self, namespace: str) -> MemoryLimitMib:
        check_memory_limit_namespace(namespace)
        limits = self._limits_struct("Get", namespace)
        self._call("nvmlDeviceGetMemoryLimits_v1", limits)  # FUNCTION_NOT_FOUND (older driver) -> NotSupported
        return MemoryLimitMib(_limit_mib(int(limits.softLimit)), _limit_mib(int(limits.hardLimit)),
                              int(limits.currentUsed) / _MIB)

    def set_memory_limit_mib(self, namespace: str, soft_mib: float, hard_mib: float) -> None:
        check_memory_limit(namespace, soft_mib, hard_mib)
        before = self.memory_limit_mib(namespace)
        if (before.soft_mib, before.hard_mib) == (_limit_mib(_limit_bytes(soft_mib)), _limit_mib(_limit_bytes(hard_mib))):
            return
        limits = self._limits_struct("Set", namespace)
        limits.softLimit = _limit_bytes(soft_mib)
        limits.hardLimit = _limit_bytes(hard_mib)
        self._call("nvmlDeviceSetMemoryLimits_v1", limits)

    # --- writes ----------------------------------------------------------------------------
    def set_power_limit_mw(self, limit_mw: int) -> None:
        """Set the power limit; a set to the current limit writes nothing."""
        if not isinstance(limit_mw, int) or isinstance(limit_mw, bool):
            raise InvalidArgument(f"power limit must be an int in mW, not {limit_mw!r}")
        if self.power_limit_mw() == limit_mw:
            return
        self._call("nvmlDeviceSetPowerManagementLimit", limit_mw)

    def set_mig_mode(self, enabled: bool) -> None:
        """Enable or disable MIG. NVML answers a change it could not activate in the call's activation
        status, not as a failed call (NVML reference, nvmlDeviceSetMigMode: IN_USE while the GPU is
        busy, RESET_REQUIRED where only a GPU reset or VM reboot activates it); the mode is then only
        pending, and that status is raised as its typed error (InUse, ResetRequired)."""
        m = self._n.m
        if self.mig_enabled() == enabled:
            return
        status = int(self._call("nvmlDeviceSetMigMode", m.NVML_DEVICE_MIG_ENABLE if enabled else m.NVML_DEVICE_MIG_DISABLE))
        self._profiles = None
        if status != int(m.NVML_SUCCESS):
            want = "enabling" if enabled else "disabling"
            raise from_nvml_code(
                status,
                f"{want} MIG on GPU {self._index} is pending, not active (activation status: NVML code {status}); "
                "IN_USE: stop the GPU's processes and retry; RESET_REQUIRED: reset the GPU (nvidia-smi -r) or reboot",
            )

    def create_gpu_instance(self, profile_id: int, start: int) -> GpuInstance:
        m = self._n.m
        prof = self._profile(profile_id)  # NotSupported without MIG (the first time; later, the driver says so)
        place = next((p for p in prof.placements if p.start == start), None)
        if place is None:
            starts = ", ".join(str(p.start) for p in prof.placements)
            raise InvalidArgument(f"{prof.name} cannot start at memory slice {start}; valid starts: {starts}")
        c_place = m.c_nvmlGpuInstancePlacement_t()
        c_place.start = place.start
        c_place.size = place.size
        gi = self._call("nvmlDeviceCreateGpuInstanceWithPlacement", profile_id, ctypes.byref(c_place))
        try:
            ci_const = CI_PROFILE_FOR_SLICES[prof.slice_count]
            ci_info = self._any(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, ci_const, m.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            self._any("nvmlGpuInstanceCreateComputeInstance", gi, ci_info.id)
        except (DeviceError, KeyError):
            try:
                self._any("nvmlGpuInstanceDestroy", gi)
            except DeviceError:
                pass  # the original error is the one to report
            raise
        info = self._any("nvmlGpuInstanceGetInfo", gi)
        return self._gi_value(info, self._mig_uuids({int(info.id)}))

    def destroy_gpu_instance(self, instance_id: int) -> None:
        m = self._n.m
        gi = self._call("nvmlDeviceGetGpuInstanceById", instance_id)  # NotSupported without MIG
        gi_slices = self._profile(int(self._any("nvmlGpuInstanceGetInfo", gi).profileId)).slice_count
        for const in range(int(m.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
            if _CI_PROFILE_SLICES.get(const, 0) > gi_slices:
                continue  # a compute instance never has more slices than its GPU instance
            try:
                info = self._any(
                    "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, const, m.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except (NotSupported, InvalidArgument):
                continue
            array = (m.c_nvmlComputeInstance_t * max(1, int(info.instanceCount)))()
            count = ctypes.c_uint(len(array))
            self._any("nvmlGpuInstanceGetComputeInstances", gi, info.id, array, ctypes.byref(count))
            for i in range(count.value):
                self._any("nvmlComputeInstanceDestroy", array[i])
        self._any("nvmlGpuInstanceDestroy", gi)


class NvmlBackend(Backend):
    """All GPUs NVML sees. `nvml` is the pynvml module (or a fake of it); default: the real one."""

    name = "nvml"

    def __init__(self, nvml: object | None = None, *, mig_reconfig_s: float = DEFAULT_MIG_RECONFIG_S) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._n = _Nvml(nvml)
        try:
            self._n.call("nvmlInit")
        except LibraryNotFound as exc:
            raise LibraryNotFound(
                "NVML (libnvidia-ml.so) was not found: no NVIDIA driver is installed here. Install the driver, "
                "or use a simulated GPU (backend spec 'sim:h100-80gb')."
            ) from exc
        except DriverNotLoaded as exc:
            raise DriverNotLoaded(
                "the NVIDIA driver is not loaded (nvmlInit failed): load it (modprobe nvidia) or check "
                "`nvidia-smi`; or use a simulated GPU (backend spec 'sim:h100-80gb')."
            ) from exc
        self._open = True
        try:
            count = int(self._n.call("nvmlDeviceGetCount"))
            self._devices = [
                NvmlDevice(self._n, i, self._n.call("nvmlDeviceGetHandleByIndex", i), mig_reconfig_s=mig_reconfig_s)
                for i in range(count)
            ]
        except DeviceError:
            self.close()
            raise

    def devices(self) -> Sequence[NvmlDevice]:
        """The GPUs; one that answered GPU_IS_LOST gets a fresh handle here when it answers again
        (callers rediscover through this: the profiler's sampler every 30 s)."""
        for dev in self._devices:
            dev.reopen()
        return list(self._devices)

    def close(self) -> None:
        """nvmlShutdown, once for the nvmlInit of this backend: NVML counts initialisations and shuts
        down when the count reaches zero (NVML reference, Initialization and Cleanup), so backends and
        other users of the library in one process do not close each other's. UNINITIALIZED (some other
        user shut it down once too often) leaves nothing to release and is not an error here."""
        if self._open:
            self._open = False
            try:
                self._n.call("nvmlShutdown")
            except Uninitialized:
                pass
