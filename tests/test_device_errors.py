"""NVML error codes through the fake pynvml and the NVML backend, each to its typed error."""

from __future__ import annotations

import pynvml
import pytest
from device_rigs import trace

from vgpu.device.errors import (
    NVML_ERRORS,
    DeviceError,
    DriverNotLoaded,
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    LibraryNotFound,
    NoPermission,
    NotSupported,
    UnknownDeviceError,
    from_nvml_code,
)
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import ManualClock, SimBackend

CASES = [
    (pynvml.NVML_ERROR_NOT_SUPPORTED, NotSupported),
    (pynvml.NVML_ERROR_NO_PERMISSION, NoPermission),
    (pynvml.NVML_ERROR_IN_USE, InUse),
    (pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, InsufficientResources),
    (pynvml.NVML_ERROR_GPU_IS_LOST, GpuLost),
    (pynvml.NVML_ERROR_INVALID_ARGUMENT, InvalidArgument),
    (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, NotSupported),  # a driver older than the function
    (4242, UnknownDeviceError),  # a code no table knows
]


def _backend(**sim_kw: object) -> tuple[SimBackend, FakePynvml, NvmlBackend]:
    sim = SimBackend(["a100-40gb"], clock=ManualClock(0.0), **sim_kw)  # type: ignore[arg-type]
    fake = FakePynvml(sim)
    return sim, fake, NvmlBackend(nvml=fake)


def test_our_codes_agree_with_pynvml() -> None:
    for code, cls in CASES[:-1]:
        assert NVML_ERRORS[code] is cls
        assert type(pynvml.NVMLError(code)) is not pynvml.NVMLError  # pynvml has a subclass for it


@pytest.mark.parametrize(("code", "cls"), CASES, ids=[c.__name__ for _, c in CASES])
@pytest.mark.parametrize(
    "call",
    ["power_usage_mw", "memory", "set_power_limit_mw", "gpu_instances"],
)
def test_injected_code_becomes_its_typed_error_once(code: int, cls: type[DeviceError], call: str) -> None:
    _, fake, backend = _backend(mig_enabled=True)
    dev = backend.devices()[0]
    nvml_fn = {
        "power_usage_mw": "nvmlDeviceGetPowerUsage",
        "memory": "nvmlDeviceGetMemoryInfo",
        "set_power_limit_mw": "nvmlDeviceSetPowerManagementLimit",
        "gpu_instances": "nvmlDeviceGetGpuInstances",
    }[call]
    run = {
        "power_usage_mw": dev.power_usage_mw,
        "memory": dev.memory,
        "set_power_limit_mw": lambda: dev.set_power_limit_mw(250_000),
        "gpu_instances": dev.gpu_instances,
    }[call]
    fake.inject(nvml_fn, code, times=1)
    with pytest.raises(cls) as info:
        run()
    assert type(info.value) is cls
    assert info.value.nvml_code == code
    assert isinstance(info.value.__cause__, pynvml.NVMLError)
    assert nvml_fn in str(info.value)
    run()  # the fault fired once


def test_the_fake_raises_real_pynvml_subclasses() -> None:
    sim, fake, backend = _backend(mig_enabled=True, mig_reconfig_s=0.0)
    dev = backend.devices()[0]
    gi = dev.create_gpu_instance(0, 0)  # 7g.40gb
    sim.launch("busy", 9, trace("busy", [100] * 5, 10.0), gpu_instance_id=gi.instance_id)
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InUse):
        fake.nvmlComputeInstanceDestroy(
            fake.nvmlDeviceGetGpuInstanceById(handle, gi.instance_id) and fake._handle("ci", 0, gi.instance_id)
        )
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceSetPowerManagementLimit(handle, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUtilizationRates(handle)
    sim.privileged = False
    with pytest.raises(pynvml.NVMLError_NoPermission):
        fake.nvmlDeviceSetPowerManagementLimit(handle, 200_000)
    sim.devices()[0].lose()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetPowerUsage(handle)


def test_insufficient_resources_from_the_driver_through_the_backend() -> None:
    _, fake, backend = _backend(mig_enabled=True)
    dev = backend.devices()[0]
    dev.create_gpu_instance(0, 0)
    with pytest.raises(InsufficientResources):
        dev.create_gpu_instance(19, 3)
    assert fake.calls["nvmlDeviceCreateGpuInstanceWithPlacement"] == 2


def test_a_failed_compute_instance_rolls_the_gpu_instance_back() -> None:
    _, fake, backend = _backend(mig_enabled=True)
    dev = backend.devices()[0]
    fake.inject("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    with pytest.raises(InsufficientResources):
        dev.create_gpu_instance(9, 0)
    assert dev.gpu_instances() == []


def test_process_utilization_not_found_means_no_new_samples() -> None:
    _, fake, backend = _backend()
    fake.inject("nvmlDeviceGetProcessUtilization", pynvml.NVML_ERROR_NOT_FOUND)
    assert backend.devices()[0].process_utilization(0) == []


def test_nvml_init_without_a_driver_says_what_to_do() -> None:
    sim = SimBackend(["h100-80gb"])
    with pytest.raises(LibraryNotFound, match="driver"):
        NvmlBackend(nvml=FakePynvml(sim, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(DriverNotLoaded, match="driver is not loaded"):
        NvmlBackend(nvml=FakePynvml(sim, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))


def test_calls_before_nvml_init_are_uninitialized() -> None:
    fake = FakePynvml(SimBackend(["h100-80gb"]))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 1
    with pytest.raises(ValueError):
        fake.inject("nvmlNoSuchFunction", 3)


def test_close_shuts_nvml_down_once() -> None:
    _, fake, backend = _backend()
    backend.close()
    backend.close()
    assert fake.calls["nvmlShutdown"] == 1


def test_from_nvml_code_keeps_the_code() -> None:
    err = from_nvml_code(4242)
    assert isinstance(err, UnknownDeviceError) and err.nvml_code == 4242


def test_an_nvidia_ml_py_without_memory_limits_is_not_supported() -> None:
    class OldPynvml(FakePynvml):
        def __getattr__(self, name: str) -> object:
            if "MemoryLimits" in name:
                raise AttributeError(name)  # nvidia-ml-py before 13.615
            return super().__getattr__(name)

    sim = SimBackend(["h100-80gb"], clock=ManualClock(0.0))
    dev = NvmlBackend(nvml=OldPynvml(sim)).devices()[0]
    with pytest.raises(NotSupported, match="nvidia-ml-py"):
        dev.memory_limit_mib("/a")
    with pytest.raises(NotSupported, match="nvidia-ml-py"):
        dev.set_memory_limit_mib("/a", 1.0, 1.0)
