"""An NVML error at every call site the profiler's sampler makes, field by field, through the real NVML
backend over the fake pynvml (which raises pynvml.NVMLError(code)): the field goes missing, or the
device is skipped (GPU lost, or no process list), and the sampler never raises. Also a GPU lost in the
middle of a stream to a real manager, and the allocator's handling of recommendations for a lost GPU."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pynvml
import pytest
from fault_helpers import until
from manager_fakes import EwmaMarginForecaster

from vgpu.allocator.core import Allocator
from vgpu.allocator.policy.base import Recommendation
from vgpu.allocator.service import AllocatorServicer, build_server
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.manager.core import Manager
from vgpu.manager.service import IngestServicer
from vgpu.profiler.sampler import Sampler
from vgpu.profiler.stream import SignatureStreamer
from vgpu.traces import AppTrace
from vgpu.v1 import signature_pb2

PIDS = {4001: "app-a", 4002: "app-b"}

# Every NVML function the sampler reaches on a non-MIG GPU per tick, and the signature fields that
# come from it. None: the process list itself, without which the device yields no signature.
SITES: dict[str, tuple[str, ...] | None] = {
    "nvmlDeviceGetMemoryInfo": ("device.mem_used_mib", "device.mem_total_mib"),
    "nvmlDeviceGetUtilizationRates": ("device.sm_util_pct", "device.mem_bw_util_pct"),
    "nvmlDeviceGetPowerUsage": ("device.power_mw",),
    "nvmlDeviceGetPowerManagementLimit": ("device.power_limit_mw",),
    "nvmlDeviceGetClockInfo": ("device.sm_clock_mhz",),
    "nvmlDeviceGetPcieThroughput": ("device.pcie_tx_kbps", "device.pcie_rx_kbps"),
    "nvmlDeviceGetProcessUtilization": ("process.sm_util_pct",),
    "nvmlDeviceGetComputeRunningProcesses": None,
    "nvmlDeviceGetGraphicsRunningProcesses": None,
}
# (function, code) whose failure the backend absorbs: the signature keeps every field. A device without
# graphics contexts answers the graphics list with NOT_SUPPORTED; the compute list is then the answer.
ABSORBED = {("nvmlDeviceGetGraphicsRunningProcesses", "not_supported")}
# Functions called once when the backend opens (not per tick).
OPEN_ONLY = {"nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName"}
CODES = {
    "not_supported": pynvml.NVML_ERROR_NOT_SUPPORTED,
    "no_permission": pynvml.NVML_ERROR_NO_PERMISSION,
    "not_found": pynvml.NVML_ERROR_NOT_FOUND,
    "invalid_argument": pynvml.NVML_ERROR_INVALID_ARGUMENT,
    "timeout": pynvml.NVML_ERROR_TIMEOUT,
    "unknown": pynvml.NVML_ERROR_UNKNOWN,
    "gpu_is_lost": pynvml.NVML_ERROR_GPU_IS_LOST,
}


def _trace(app: str) -> AppTrace:
    t = np.arange(0.0, 60.0)
    return AppTrace(app, t, {"mem_used_mib": 1000.0 + t, "sm_util_pct": np.full(len(t), 30.0),
                             "pcie_tx_kbps": np.full(len(t), 5.0), "pcie_rx_kbps": np.full(len(t), 7.0)})


def _rig(gpus: int = 2) -> tuple[SimBackend, FakePynvml, Sampler, ManualClock]:
    clock = ManualClock(1000.0)
    sim = SimBackend(["h100-80gb"] * gpus, clock=clock)
    for i, (pid, app) in enumerate(PIDS.items()):
        sim.launch(app, pid, _trace(app), device_index=i % gpus)
    clock.advance(1.0)
    fake = FakePynvml(sim)
    backend = NvmlBackend(nvml=fake)
    sampler = Sampler(backend, psutil_module=None, inapp_dir=None, clock=lambda: clock() + 1.7e9, monotonic=clock,
                      app_id_of=PIDS.get)
    return sim, fake, sampler, clock


def _fields(sig: signature_pb2.BehavioralSignature) -> set[str]:
    out = set()
    for part in ("device", "process"):
        for fd, _ in getattr(sig, part).ListFields():
            out.add(f"{part}.{fd.name}")
    return out


def _clean_fields() -> set[str]:
    _, _, sampler, _ = _rig()
    sigs = sampler.sample()
    assert len(sigs) == 2
    fields = _fields(sigs[0])
    assert fields == _fields(sigs[1])
    return fields


def test_the_sites_table_covers_every_nvml_call_the_sampler_makes() -> None:
    _, fake, sampler, clock = _rig()
    fake.calls.clear()
    for _ in range(3):
        sampler.sample()
        clock.advance(1.0)
    called = set(fake.calls) - OPEN_ONLY
    assert called == set(SITES), f"sampler calls NVML functions this test does not fault: {called - set(SITES)}"
    # and each field listed really comes from a clean sample
    clean = _clean_fields()
    for fields in SITES.values():
        assert fields is None or set(fields) <= clean


@pytest.mark.parametrize("code_name", sorted(CODES))
@pytest.mark.parametrize("function", sorted(SITES))
def test_an_nvml_error_at_each_call_site_drops_only_its_fields(function: str, code_name: str) -> None:
    clean = _clean_fields()
    sim, fake, sampler, clock = _rig()
    fake.inject(function, CODES[code_name], times=None)
    sigs = sampler.sample()  # must not raise
    clock.advance(0.1)
    sigs += sampler.sample()
    if code_name == "gpu_is_lost":
        # every GPU hit that call and is lost: skipped, nothing made up
        assert sigs == []
        assert sorted(sampler.lost_devices()) == sorted(d.uuid for d in sim.devices())
        assert sampler.stats.lost_events == 2
        fake.clear_faults()
        sampler.rediscover()  # a lost GPU gets another chance at rediscovery
        assert len(sampler.sample()) == 2
        return
    expected = () if (function, code_name) in ABSORBED else SITES[function]
    if expected is None:
        assert sigs == []  # no process list: the device yields nothing this tick
    else:
        assert len(sigs) == 4
        for sig in sigs:
            assert _fields(sig) == clean - set(expected), function
    if code_name == "not_supported":
        assert not sampler.stats.errors  # NotSupported is a missing field, not an error
    elif not (function == "nvmlDeviceGetProcessUtilization" and code_name == "not_found"):
        assert sum(sampler.stats.errors.values()) >= 2  # counted, per device and field
    fake.clear_faults()
    clock.advance(1.1)
    assert _fields(sampler.sample()[0]) == clean  # the field comes back with the device


def test_a_transient_error_spares_the_other_gpu() -> None:
    sim, _, sampler, _ = _rig()
    sim.devices()[1].inject("memory", pynvml.NVML_ERROR_UNKNOWN)  # through the fake: NVMLError(999)
    by_app = {s.app_id: s for s in sampler.sample()}
    assert by_app["app-a"].device.HasField("mem_used_mib")
    assert not by_app["app-b"].device.HasField("mem_used_mib")


def test_a_lost_gpu_is_skipped_and_the_other_keeps_sampling() -> None:
    sim, _, sampler, clock = _rig()
    assert {s.app_id for s in sampler.sample()} == {"app-a", "app-b"}
    sim.devices()[1].lose()
    for _ in range(5):
        clock.advance(0.1)
        sigs = sampler.sample()
        assert [s.app_id for s in sigs] == ["app-a"]
    assert sampler.lost_devices() == [sim.devices()[1].uuid]
    assert sampler.stats.lost_events == 1  # marked once, then skipped without calling it


@pytest.fixture
def lost_gpu_allocator() -> tuple[Allocator, SimBackend]:
    sim = SimBackend(["h100-80gb", "h100-80gb"], clock=ManualClock(10.0))
    return Allocator(sim, dry_run=False), sim


def _rec(app: str, device: str) -> Recommendation:
    return Recommendation(app, device, memory_mib=2000.0, sm_pct=20.0)


def test_recommendations_for_a_healthy_gpu_are_applied_while_another_is_lost(
    lost_gpu_allocator: tuple[Allocator, SimBackend],
) -> None:
    alloc, sim = lost_gpu_allocator
    ok, lost = (d.uuid for d in sim.devices())
    sim.devices()[1].lose()
    report = alloc.apply_recommendations([_rec("a", ok), _rec("b", lost)])
    assert [g.app_id for g in report.created] == ["a"]
    assert any("b" in s for s in report.skipped)


async def test_a_gpu_lost_mid_stream_leaves_the_pipeline_running(tmp_path: Path) -> None:
    sim = SimBackend(["h100-80gb", "h100-80gb"])
    for i, (pid, app) in enumerate(PIDS.items()):
        sim.launch(app, pid, _trace(app), device_index=i, speed=1.0, loop=True)
    alloc = Allocator(sim, dry_run=False)
    manager = Manager(alloc, EwmaMarginForecaster(), forecast_interval_s=0.1, min_samples=2)
    address = f"unix:{tmp_path}/m.sock"
    server = build_server(address, allocator_servicer=AllocatorServicer(alloc), ingest_servicer=IngestServicer(manager))
    await server.start()
    sampler = Sampler(sim, psutil_module=None, inapp_dir=None, app_id_of=PIDS.get, enumerate_every_s=0.0)
    streamer = SignatureStreamer(sampler, address, period_s=0.02, profiler_id="lost-gpu")
    task = asyncio.create_task(streamer.run())
    try:
        await until(lambda: {"app-a", "app-b"} <= set(manager.windows.apps()))
        sim.devices()[1].lose()
        await until(lambda: sampler.lost_devices() == [sim.devices()[1].uuid])
        b_before = len(manager.windows.window("app-b").samples)
        a_before = len(manager.windows.window("app-a").samples)
        # GPU 0 keeps streaming: a few more ticks of it, waited for rather than assumed in a fixed time
        await until(lambda: len(manager.windows.window("app-a").samples) > a_before + 5)
        assert len(manager.windows.window("app-b").samples) <= b_before + 1  # nothing made up for GPU 1
        assert not task.done() and streamer.stats.source_errors == 0 and manager.stats.rejected == 0
    finally:
        streamer.stop()
        await asyncio.wait_for(task, 5.0)
        alloc.stop()
        await server.stop(0)


def test_nan_never_reaches_a_signature_field() -> None:
    _, _, sampler, clock = _rig()
    for _ in range(3):
        for sig in sampler.sample():
            for part in ("device", "process"):
                for _, value in getattr(sig, part).ListFields():
                    assert math.isfinite(value)
        clock.advance(0.1)
