"""The sampler's MIG call sites failing, through the NVML backend over the fake pynvml: on a MIG-enabled
A100 the sampler also asks for the GPU instances (MIG mode, profiles, instances, MIG device handles and
UUIDs) once per enumeration. Any of those failing with any code must not raise: the process is still
reported (on its GPU when its instance cannot be read), a lost GPU is skipped, and the instance comes
back at the next enumeration once the fault clears. And where a MIG application's recommendation goes."""

from __future__ import annotations

import numpy as np
import pynvml
import pytest
from manager_fakes import EwmaMarginForecaster

from vgpu.allocator.core import Allocator
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.manager.core import Manager
from vgpu.profiler.sampler import Sampler
from vgpu.traces import AppTrace
from vgpu.v1 import ingest_pb2

PID = 5001
PER_TICK = {"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetClockInfo", "nvmlDeviceGetPcieThroughput",
            "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses"}
MIG_SITES = ("nvmlDeviceGetMigMode", "nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstancePossiblePlacements",
             "nvmlDeviceGetGpuInstances", "nvmlGpuInstanceGetInfo", "nvmlDeviceGetMaxMigDeviceCount",
             "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetUUID")
CODES = {
    "not_supported": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "no_permission": pynvml.NVML_ERROR_NO_PERMISSION,
    "invalid_argument": pynvml.NVML_ERROR_INVALID_ARGUMENT,
    "unknown": pynvml.NVML_ERROR_UNKNOWN,
    "gpu_is_lost": pynvml.NVML_ERROR_GPU_IS_LOST,
}


def _mig_rig() -> tuple[SimBackend, FakePynvml, Sampler, ManualClock, str]:
    clock = ManualClock(1000.0)
    sim = SimBackend(["a100-40gb"], clock=clock, mig_enabled=True, mig_reconfig_s=0.0)
    dev = sim.devices()[0]
    gi = dev.create_gpu_instance(dev.gpu_instance_profiles()[0].profile_id, 0)
    t = np.arange(0.0, 60.0)
    sim.launch("mig-app", PID, AppTrace("mig-app", t, {"mem_used_mib": 1000.0 + t, "sm_util_pct": np.full(60, 30.0)}),
               gpu_instance_id=gi.instance_id)
    clock.advance(1.0)
    fake = FakePynvml(sim)
    sampler = Sampler(NvmlBackend(nvml=fake), psutil_module=None, inapp_dir=None, clock=lambda: clock() + 1.7e9,
                      monotonic=clock, app_id_of={PID: "mig-app"}.get)
    return sim, fake, sampler, clock, gi.uuid


def test_the_mig_sites_are_what_the_sampler_calls_on_a_mig_gpu() -> None:
    _, fake, sampler, _, mig_uuid = _mig_rig()
    fake.calls.clear()
    (sig,) = sampler.sample()
    assert sig.device_id == mig_uuid and sig.device.mem_total_mib < 10_000  # the instance's, not the GPU's
    assert set(fake.calls) == PER_TICK | set(MIG_SITES)


_CASES = [
    pytest.param(f, c, id=f"{f}-{c}")
    for f in MIG_SITES
    for c in sorted(CODES)
]


@pytest.mark.parametrize(("function", "code_name"), _CASES)
def test_a_mig_read_failing_never_raises_and_the_instance_comes_back(function: str, code_name: str) -> None:
    sim, fake, sampler, clock, mig_uuid = _mig_rig()
    gpu = sim.devices()[0]
    fake.inject(function, CODES[code_name], times=None)
    sigs = sampler.sample()  # must not raise
    if code_name == "gpu_is_lost":
        assert sigs == [] and sampler.lost_devices() == [gpu.uuid]
        fake.clear_faults()
        sampler.rediscover()
    else:
        (sig,) = sigs  # the process is still reported
        if sig.device_id != mig_uuid:  # its instance could not be read: reported on its GPU, consistently
            assert sig.device_id == gpu.uuid
            assert sig.device.mem_total_mib == gpu.memory().total_mib
        fake.clear_faults()
    clock.advance(1.1)  # the next enumeration
    (sig,) = sampler.sample()
    assert sig.device_id == mig_uuid


def test_a_mig_applications_recommendation_reaches_the_allocator() -> None:
    sim, _, sampler, clock, _ = _mig_rig()
    alloc = Allocator(sim, clock=clock, dry_run=False)
    manager = Manager(alloc, EwmaMarginForecaster(), clock=clock, forecast_interval_s=0.0, min_samples=2)
    for k in range(4):
        manager.ingest(ingest_pb2.SignatureBatch(tick=k, signatures=sampler.sample()))
        clock.advance(0.5)
    assert manager.stats.decisions > 0
    assert alloc.ledger.grants(app_id="mig-app"), "no grant for the MIG application"
