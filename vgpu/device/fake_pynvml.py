"""A fake `pynvml` for tests, backed by the simulator's state.

`FakePynvml(sim_backend)` has the functions `vgpu.device.nvml.NvmlBackend` calls, with nvidia-ml-py's
names and signatures (tests/test_device_fake_contract.py checks them against the real module). Failures
are real `pynvml.NVMLError(code)` instances: the simulator's typed errors are turned back into their NVML
codes, so constraint checks live in one place (the simulator). Constants, ctypes structures and error
classes are the real module's. `pynvml` is imported here only for those.

Test hooks: `inject(function, code, times=1)` makes the next calls of one NVML function fail with an
NVML code (any int: an unknown code gives the bare `NVMLError`); `calls` counts calls per function;
`FakePynvml(..., init_error=12)` makes `nvmlInit` fail as on a machine without the driver.

Per-cgroup memory limits (nvmlDevice{Set,Get}MemoryLimits_v1): kept by the simulator per namespace
(`SimDevice.set_memory_limit_mib`), in bytes here; `SimBackend(memory_limits=False)` answers
FUNCTION_NOT_FOUND, as a driver older than the functions does.

Compute instances: each GPU instance holds at most one compute instance spanning all its slices; asking
for a smaller compute-instance profile gives NOT_SUPPORTED (the simulator does not model them).

Where real NVML answers in ways a caller must cope with, the fake answers the same way:

- Process lists: compute processes (`nvmlDeviceGetComputeRunningProcesses`) and graphics processes
  (`nvmlDeviceGetGraphicsRunningProcesses`) are separate lists, and a process with both kinds of context is
  in both (`contexts[pid] = "C"`, `"G"` or `"C+G"`; default "C"). On a MIG-enabled GPU the GPU's own handle
  lists every process with its GPU-instance id but without its memory (`usedGpuMemory` None, pynvml's
  value for NVML_VALUE_NOT_AVAILABLE), and only for a privileged caller (NO_PERMISSION otherwise); a MIG
  device handle lists the processes of its instance with their memory. The GPU handle's memory figures
  (`nvmlDeviceGetMemoryInfo`) are likewise refused to an unprivileged caller in MIG mode. NVML reference,
  nvmlDeviceGetComputeRunningProcesses: "In MIG mode, if device handle is provided, the API returns
  aggregate information, only if the caller has appropriate privileges. Per-instance information can be
  queried by using specific MIG device handles"; nvitop (nvitop/api/device.py, `Device.processes`) reads
  the memory as N/A on MIG-enabled GPUs.
- Per-process utilization: a sample only for a process with some non-zero utilization in the sample
  period, and NOT_FOUND when no sample is newer than the timestamp given (NVML reference,
  nvmlDeviceGetProcessUtilization). `extra_utilization_samples` (pid, timeStamp, smUtil, memUtil) are added
  to every answer, to model what nvtop documents (issue #110; `gpuinfo_nvidia_get_process_utilization` in
  src/extract_gpuinfo_nvidia.c): samples of processes that do not run, utilization above 100 and timestamps
  older than the one asked for.
- MIG mode: `nvmlDeviceSetMigMode` returns the activation status rather than failing when the mode cannot
  be activated now (IN_USE while processes run); the requested mode is then pending
  (`nvmlDeviceGetMigMode` answers [current, pending]). `mig_activation_status = code` makes every mode
  change answer that code and stay pending (e.g. RESET_REQUIRED, what a pass-through VM answers). NVML
  reference, nvmlDeviceSetMigMode.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import pynvml

from vgpu.device.errors import DeviceError, InUse
from vgpu.device.sim import SimBackend, SimDevice
from vgpu.device.skus import CI_PROFILE_FOR_SLICES, MigProfile

_P = ParamSpec("_P")
_R = TypeVar("_R")
_NO_ID = 0xFFFFFFFF  # NVML's "not applicable" for gpuInstanceId / computeInstanceId
_MIB = 1024 * 1024
_SUCCESS: int = pynvml.NVML_SUCCESS


@dataclass(frozen=True)
class _DeviceHandle:
    index: int
    gpu_instance_id: int | None = None  # set on a MIG device handle
    generation: int = 0  # the device's reset count when the handle was given out (`reset_gpu`)


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _faked(fn: Callable[Concatenate[FakePynvml, _P], _R]) -> Callable[Concatenate[FakePynvml, _P], _R]:
    """Count the call, check nvmlInit, fire injected faults, turn typed errors into NVMLError."""

    @functools.wraps(fn)
    def wrapper(self: FakePynvml, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        name = fn.__name__
        self.calls[name] += 1
        if not self._initialised and name != "nvmlInit":
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        fault = self._faults.get(name)
        if fault is not None:
            code, remaining = fault
            if remaining is not None:
                if remaining <= 1:
                    del self._faults[name]
                else:
                    self._faults[name] = (code, remaining - 1)
            raise _error(code)
        try:
            return fn(self, *args, **kwargs)
        except DeviceError as exc:
            code = exc.nvml_code if exc.nvml_code is not None else pynvml.NVML_ERROR_UNKNOWN
            raise _error(code) from exc

    wrapper.__dict__["__faked__"] = True  # FakePynvml.faked_functions() lists these
    return wrapper


def _target(ref: Any) -> Any:
    """The ctypes object behind `byref(x)`, `pointer(x)` or `x` itself."""
    obj = getattr(ref, "_obj", None)  # byref()
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def _address(handle: Any) -> int:
    value = ctypes.cast(handle, ctypes.c_void_p).value
    if value is None:
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return value


class FakePynvml:
    """Stands in for the `pynvml` module; pass it to `NvmlBackend(nvml=...)`."""

    NVMLError = pynvml.NVMLError

    def __init__(self, backend: SimBackend, *, init_error: int | None = None) -> None:
        self.backend = backend
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        self._initialised = False
        self._faults: dict[str, tuple[int, int | None]] = {}
        # opaque handles for GPU / compute instances: keep the structures alive, map address -> key
        self._gi_structs: dict[tuple[int, int], Any] = {}
        self._ci_structs: dict[tuple[int, int], Any] = {}
        self._by_address: dict[int, tuple[str, int, int]] = {}
        # real-NVML behaviours a test may turn on (see the module doc)
        self.contexts: dict[int, str] = {}
        self.extra_utilization_samples: list[tuple[int, int, int, int]] = []
        self.mig_activation_status: int | None = None
        self._pending_mig: dict[int, bool] = {}
        self._generation: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        # constants, ctypes structures and error classes come from the real module; an NVML
        # *function* that is not faked stays missing, so a backend calling it fails in tests
        if name.startswith(("NVML_", "c_nvml", "struct_c_nvml", "NVMLError", "nvmlFriendlyObject")):
            return getattr(pynvml, name)
        if hasattr(pynvml, name):
            raise AttributeError(f"pynvml.{name} is not faked by FakePynvml")
        raise AttributeError(name)

    # --- test hooks ------------------------------------------------------------------------
    @classmethod
    def faked_functions(cls) -> list[str]:
        return sorted(n for n, v in vars(cls).items() if getattr(v, "__faked__", False))

    def inject(self, function: str, code: int, times: int | None = 1) -> None:
        """The next `times` calls of `function` raise `pynvml.NVMLError(code)`; None: until cleared."""
        if function not in self.faked_functions():
            raise ValueError(f"{function!r} is not a faked NVML function")
        self._faults[function] = (code, times)

    def clear_faults(self) -> None:
        self._faults.clear()

    def reset_gpu(self, index: int) -> None:
        """The GPU is reset (`nvidia-smi -r`, or a MIG mode change that resets it): handles given out
        before answer GPU_IS_LOST, a handle asked for afterwards works. The NVML reference says a reset
        may change the device's attributes and that callers should query them again
        (nvmlDeviceSetMigMode); whether an old handle keeps working is not documented, so this models
        the case where it does not."""
        self._generation[index] = self._generation.get(index, 0) + 1

    # --- helpers ---------------------------------------------------------------------------
    def _dev(self, handle: Any, *, mig_ok: bool = False) -> SimDevice:
        if not isinstance(handle, _DeviceHandle):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.gpu_instance_id is not None and not mig_ok:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        devices = self.backend.devices()
        if not 0 <= handle.index < len(devices):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.generation != self._generation.get(handle.index, 0):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)  # a handle from before `reset_gpu`
        return devices[handle.index]

    def _handle(self, kind: str, index: int, gi_id: int) -> Any:
        structs = self._gi_structs if kind == "gi" else self._ci_structs
        struct_type = pynvml.struct_c_nvmlGpuInstance_t if kind == "gi" else pynvml.struct_c_nvmlComputeInstance_t
        key = (index, gi_id)
        struct = structs.get(key)
        if struct is None:
            struct = structs[key] = struct_type()
            self._by_address[ctypes.addressof(struct)] = (kind, index, gi_id)
        return ctypes.pointer(struct)

    def _resolve(self, kind: str, handle: Any) -> tuple[SimDevice, int]:
        found = self._by_address.get(_address(handle))
        if found is None or found[0] != kind:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        _, index, gi_id = found
        dev = self.backend.devices()[index]
        if gi_id not in dev._mig_state("gpu_instances"):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # a handle of a destroyed instance
        return dev, gi_id

    @staticmethod
    def _profile_by_id(dev: SimDevice, profile_id: int) -> MigProfile:
        dev._mig_state("gpu_instance_profiles")  # NotSupported without MIG
        prof = dev.sku.profile(profile_id)
        if prof is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return prof

    # --- library ---------------------------------------------------------------------------
    @_faked
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _error(self.init_error)
        self._initialised = True

    @_faked
    def nvmlShutdown(self) -> None:
        self._initialised = False

    @_faked
    def nvmlDeviceGetCount(self) -> int:
        return len(self.backend.devices())

    @_faked
    def nvmlDeviceGetHandleByIndex(self, index: int) -> _DeviceHandle:
        if not 0 <= index < len(self.backend.devices()):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _DeviceHandle(index, generation=self._generation.get(index, 0))

    @_faked
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _DeviceHandle:
        text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        for dev in self.backend.devices():
            if dev.uuid == text:
                dev.power_limit_mw()  # GPU_IS_LOST while the GPU is gone
                return _DeviceHandle(dev.index, generation=self._generation.get(dev.index, 0))
        raise _error(pynvml.NVML_ERROR_NOT_FOUND)  # no GPU with that UUID

    # --- reads -----------------------------------------------------------------------------
    @_faked
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        dev = self._dev(handle, mig_ok=True)
        if handle.gpu_instance_id is not None:
            gi = dev._mig_state("gpu_instances").get(handle.gpu_instance_id)
            if gi is None or not gi.has_ci:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return gi.uuid
        dev.power_limit_mw()  # GpuLost / injected faults, like every call on a real device
        return dev.uuid

    @_faked
    def nvmlDeviceGetName(self, handle: Any) -> str:
        dev = self._dev(handle)
        dev.power_limit_mw()
        return dev.name

    @_faked
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        dev = self._dev(handle)
        if dev.sku.supports_mig and dev.mig_enabled() and not self.backend.privileged:
            # NVML reference, nvmlDeviceGetMemoryInfo: in MIG mode the GPU handle's aggregate figures
            # are only for a caller with the privileges
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
        m = dev.memory()
        return pynvml.c_nvmlMemory_t(
            total=int(m.total_mib * _MIB), free=int(m.free_mib * _MIB), used=int(m.used_mib * _MIB)
        )

    @_faked
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        u = self._dev(handle).utilization()
        return pynvml.c_nvmlUtilization_t(gpu=int(round(u.sm_pct)), memory=int(round(u.mem_bw_pct)))

    @_faked
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._dev(handle).power_usage_mw()

    @_faked
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return pynvml.nvmlPciInfo_t(busId=self._dev(handle).pci_bus_id().encode())

    @_faked
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._dev(handle).temperature_c()

    @_faked
    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return self._dev(handle).power_limit_mw()

    @_faked
    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any) -> list[int]:
        c = self._dev(handle).power_constraints()
        return [c.min_mw, c.max_mw]

    @_faked
    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        return self._dev(handle).power_constraints().default_mw

    @_faked
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:  # noqa: A002 (pynvml's name)
        dev = self._dev(handle)
        if type not in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return dev.sm_clock_mhz()

    @_faked
    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        tx, rx = self._dev(device).pcie_throughput_kbps()
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return int(round(tx))
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return int(round(rx))
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _running(self, handle: Any, kind: str) -> list[Any]:
        """The processes with a `kind` ("C" or "G") context, as the GPU handle or a MIG device handle
        answers them (see the module doc)."""
        dev = self._dev(handle, mig_ok=True)
        gi_only = handle.gpu_instance_id
        mig = gi_only is None and dev.sku.supports_mig and dev.mig_enabled()
        if mig and not self.backend.privileged:
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)  # the aggregate view needs privileges
        out = []
        for p in dev.processes():
            if kind not in self.contexts.get(p.pid, "C"):
                continue
            if gi_only is not None and p.gpu_instance_id != gi_only:
                continue
            in_gi = p.gpu_instance_id is not None
            used = None if p.used_mib is None or mig else int(p.used_mib * _MIB)
            out.append(
                pynvml.nvmlFriendlyObject(
                    {
                        "pid": p.pid,
                        "usedGpuMemory": used,
                        "gpuInstanceId": p.gpu_instance_id if in_gi else _NO_ID,
                        "computeInstanceId": 0 if in_gi else _NO_ID,
                    }
                )
            )
        return out

    @_faked
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return self._running(handle, "C")

    @_faked
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return self._running(handle, "G")

    @_faked
    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:  # noqa: N803
        samples = [
            (s.pid, s.timestamp_us, int(round(s.sm_pct)), int(round(s.mem_bw_pct)))
            for s in self._dev(handle).process_utilization(int(timeStamp))
            if round(s.sm_pct) or round(s.mem_bw_pct)  # NVML samples only processes that used the GPU
        ]
        if not samples:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)  # what NVML answers when nothing is newer
        samples += self.extra_utilization_samples
        return [
            pynvml.c_nvmlProcessUtilizationSample_t(
                pid=pid, timeStamp=ts, smUtil=sm, memUtil=mem, encUtil=0, decUtil=0
            )
            for pid, ts, sm, mem in samples
        ]

    # --- MIG -------------------------------------------------------------------------------
    @_faked
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        dev = self._dev(device)
        current = dev.mig_enabled()
        pending = self._pending_mig.get(dev.index, current)
        return [int(current), int(pending)]

    @_faked
    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        dev = self._dev(device)
        enable = mode == pynvml.NVML_DEVICE_MIG_ENABLE
        if self.mig_activation_status is not None:
            dev.mig_enabled()  # GPU_IS_LOST, or NOT_SUPPORTED on a SKU without MIG
            if not self.backend.privileged:
                raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
            self._pending_mig[dev.index] = enable
            return self.mig_activation_status
        try:
            dev.set_mig_mode(enable)
        except InUse:
            # the mode is set as pending; NVML answers the failed activation in activationStatus
            self._pending_mig[dev.index] = enable
            return int(pynvml.NVML_ERROR_IN_USE)
        self._pending_mig.pop(dev.index, None)
        return _SUCCESS

    @_faked
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        dev = self._dev(device)
        dev._mig_state("gpu_instance_profiles")  # NotSupported without MIG
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        prof = next((p for p in dev.sku.mig_profiles if p.nvml_profile == profile), None)
        if prof is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version == 2:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.version = pynvml.nvmlGpuInstanceProfileInfo_v2
        elif version == 1:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = prof.profile_id
        info.sliceCount = prof.slice_count
        info.instanceCount = prof.max_count
        info.multiprocessorCount = prof.sm_count
        info.memorySizeMB = prof.mem_mib
        if version == 2:
            info.name = prof.name.encode()
        return info

    @_faked
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any  # noqa: N803
    ) -> int:
        prof = self._profile_by_id(self._dev(device), profileId)
        count = _target(countRef)
        if placementsRef is None:
            count.value = len(prof.placements)
            return _SUCCESS
        array = _target(placementsRef)
        if len(array) < len(prof.placements):
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, p in enumerate(prof.placements):
            array[i].start = p.start
            array[i].size = p.size
        count.value = len(prof.placements)
        return _SUCCESS

    @_faked
    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any  # noqa: N803
    ) -> int:
        dev = self._dev(device)
        self._profile_by_id(dev, profileId)
        found = sorted(
            (g for g in dev._mig_state("gpu_instances").values() if g.profile_id == profileId),
            key=lambda g: g.instance_id,
        )
        array = _target(gpuInstancesRef)
        if len(array) < len(found):
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, g in enumerate(found):
            array[i] = self._handle("gi", dev.index, g.instance_id)
        _target(countRef).value = len(found)
        return _SUCCESS

    @_faked
    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:  # noqa: N803
        dev = self._dev(device)
        if gpuInstanceId not in dev._mig_state("gpu_instances"):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._handle("gi", dev.index, gpuInstanceId)

    @_faked
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:  # noqa: N803
        dev = self._dev(device)
        prof = self._profile_by_id(dev, profileId)
        place = _target(placement)
        valid = prof.placement_at(int(place.start))
        if valid is None or valid.size != int(place.size):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with dev._lock:
            gi = dev._create_gi(profileId, int(place.start), with_ci=False)
        return self._handle("gi", dev.index, gi.instance_id)

    @_faked
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:  # noqa: N803
        dev, gi_id = self._resolve("gi", gpuInstance)
        g = dev._gis[gi_id]
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id = g.instance_id
        info.profileId = g.profile_id
        info.placement.start = g.placement.start
        info.placement.size = g.placement.size
        return info

    @_faked
    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:  # noqa: N803
        dev, gi_id = self._resolve("gi", gpuInstance)
        with dev._lock:
            dev._destroy_gi(gi_id, require_no_ci=True)
        return _SUCCESS

    def _full_ci_profile(self, dev: SimDevice, gi_id: int) -> tuple[int, int]:
        """(compute-instance profile constant, slice count) of the instance's one compute instance."""
        prof = dev.sku.profile(dev._gis[gi_id].profile_id)
        assert prof is not None
        return CI_PROFILE_FOR_SLICES[prof.slice_count], prof.slice_count

    @_faked
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2  # noqa: N803
    ) -> Any:
        dev, gi_id = self._resolve("gi", device)
        ci_profile, slices = self._full_ci_profile(dev, gi_id)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED or profile != ci_profile:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version != 2:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id = ci_profile
        info.sliceCount = slices
        info.instanceCount = 1
        return info

    @_faked
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:  # noqa: N803
        dev, gi_id = self._resolve("gi", gpuInstance)
        if profileId != self._full_ci_profile(dev, gi_id)[0]:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        dev._set_ci(gi_id, True)
        return self._handle("ci", dev.index, gi_id)

    @_faked
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any  # noqa: N803
    ) -> int:
        dev, gi_id = self._resolve("gi", gpuInstance)
        has_ci = bool(dev._gi(gi_id).has_ci) and profileId == self._full_ci_profile(dev, gi_id)[0]
        array = _target(computeInstancesRef)
        if has_ci:
            if len(array) < 1:
                raise _error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            array[0] = self._handle("ci", dev.index, gi_id)
        _target(countRef).value = int(has_ci)
        return _SUCCESS

    @_faked
    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:  # noqa: N803
        found = self._by_address.get(_address(computeInstance))
        if found is None or found[0] != "ci":
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        dev = self.backend.devices()[found[1]]
        dev._set_ci(found[2], False)
        return _SUCCESS

    @_faked
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        dev = self._dev(device)
        dev.mig_enabled()  # NotSupported on a SKU without MIG
        return dev.sku.compute_slices

    @_faked
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> _DeviceHandle:
        dev = self._dev(device)
        if not 0 <= index < dev.sku.compute_slices:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with_ci = sorted((g for g in dev._mig_state("gpu_instances").values() if g.has_ci), key=lambda g: g.instance_id)
        if index >= len(with_ci):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return _DeviceHandle(dev.index, with_ci[index].instance_id, self._generation.get(dev.index, 0))

    @_faked
    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        self._dev(device, mig_ok=True)
        if device.gpu_instance_id is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(device.gpu_instance_id)

    # --- writes ----------------------------------------------------------------------------
    @_faked
    def nvmlDeviceSetPowerManagementLimit(self, handle: Any, limit: int) -> None:
        dev = self._dev(handle)
        dev.power_limit_mw()  # GPU_IS_LOST first, like every call on a real device
        if not self.backend.privileged:
            # NVML reference: the setter needs root, whatever the value (the simulator lets a set to the
            # current value through; the NVML backend never sends one)
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
        dev.set_power_limit_mw(int(limit))

    # --- per-cgroup memory limits ------------------------------------------------------------
    def _limits_target(self, device: Any, limits: Any) -> tuple[SimDevice, str]:
        dev = self._dev(device)
        if not self.backend.memory_limits:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # the driver predates the function
        ns = _target(limits).nameSpace
        if not ns:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return dev, ns.decode() if isinstance(ns, bytes) else str(ns)

    @staticmethod
    def _mib(value: int) -> float:
        return math.inf if value >= pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX else value / _MIB

    @staticmethod
    def _bytes(mib: float) -> int:
        return pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX if math.isinf(mib) else int(round(mib * _MIB))

    @_faked
    def nvmlDeviceSetMemoryLimits_v1(self, device: Any, limits: Any) -> None:
        dev, ns = self._limits_target(device, limits)
        lim = _target(limits)
        dev.set_memory_limit_mib(ns, self._mib(int(lim.softLimit)), self._mib(int(lim.hardLimit)))

    @_faked
    def nvmlDeviceGetMemoryLimits_v1(self, device: Any, limits: Any) -> None:
        dev, ns = self._limits_target(device, limits)
        soft, hard, used = dev.memory_limit_mib(ns)
        lim = _target(limits)
        lim.softLimit = self._bytes(soft)
        lim.hardLimit = self._bytes(hard)
        lim.currentUsed = int(round(used * _MIB))
