"""What real NVML answers that a caller must cope with, through the NVML backend over the fake pynvml
(which answers the same way; see vgpu/device/fake_pynvml.py): process lists split into compute and
graphics, MIG processes whose memory only the MIG device handles give, an unprivileged caller on a MIG
GPU, per-process utilization samples NVML has been seen to get wrong, pynvml's NVMLError(SUCCESS), and a
MIG mode change NVML leaves pending. Each also through the profiler's sampler where it reaches a
signature. Where a check can run on a real GPU it is a `rig` test in test_device_backends.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pynvml
import pytest

from vgpu.device.errors import GpuLost, InUse, ResetRequired
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.profiler.sampler import Sampler
from vgpu.traces import AppTrace
from vgpu.wire import parse_signature

MIB = 1024 * 1024


def _trace(app: str, mem_mib: float = 1000.0, sm_pct: float = 30.0) -> AppTrace:
    t = np.arange(0.0, 60.0)
    return AppTrace(app, t, {"mem_used_mib": np.full(60, mem_mib), "sm_util_pct": np.full(60, sm_pct)})


def _rig(gpus: tuple[str, ...] = ("h100-80gb",), **kw: Any) -> tuple[SimBackend, FakePynvml, NvmlBackend, ManualClock]:
    clock = ManualClock(1000.0)
    sim = SimBackend(list(gpus), clock=clock, **kw)
    fake = FakePynvml(sim)
    return sim, fake, NvmlBackend(nvml=fake), clock


def _sampler(backend: NvmlBackend, clock: ManualClock, names: dict[int, str]) -> Sampler:
    return Sampler(backend, psutil_module=None, inapp_dir=None, clock=lambda: clock() + 1.7e9, monotonic=clock,
                   app_id_of=names.get)


def _mig_rig(privileged: bool = True) -> tuple[SimBackend, FakePynvml, NvmlBackend, ManualClock, list[int]]:
    """An A100-40GB in MIG mode with two instances, one process in each (1000 and 3000 MiB)."""
    sim, fake, backend, clock = _rig(("a100-40gb",), mig_enabled=True, mig_reconfig_s=0.0)
    dev = sim.devices()[0]
    prof = next(p for p in dev.gpu_instance_profiles() if p.name == "3g.20gb")
    gis = [dev.create_gpu_instance(prof.profile_id, start).instance_id for start in (0, 4)]
    sim.launch("a", 6001, _trace("a", 1000.0), gpu_instance_id=gis[0])
    sim.launch("b", 6002, _trace("b", 3000.0), gpu_instance_id=gis[1])
    clock.advance(1.0)
    sim.privileged = privileged
    return sim, fake, backend, clock, gis


# --- process lists ---------------------------------------------------------------------------------


def test_the_gpu_handle_of_a_mig_gpu_gives_no_process_memory_and_the_backend_reads_it_per_instance() -> None:
    _, fake, backend, _, gis = _mig_rig()
    gpu_handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert {p.usedGpuMemory for p in fake.nvmlDeviceGetComputeRunningProcesses(gpu_handle)} == {None}
    procs = {p.pid: p for p in backend.devices()[0].processes()}
    assert procs[6001].used_mib == pytest.approx(1000.0) and procs[6001].gpu_instance_id == gis[0]
    assert procs[6002].used_mib == pytest.approx(3000.0) and procs[6002].gpu_instance_id == gis[1]
    assert fake.calls["nvmlDeviceGetMigDeviceHandleByIndex"] >= 2  # the memory came from the MIG devices


def test_an_unprivileged_caller_still_lists_mig_processes_through_the_mig_devices() -> None:
    _, fake, backend, _, gis = _mig_rig(privileged=False)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(0))
    procs = {p.pid: (p.used_mib, p.gpu_instance_id) for p in backend.devices()[0].processes()}
    assert procs == {6001: (1000.0, gis[0]), 6002: (3000.0, gis[1])}  # whole MiB: exact


def test_a_mig_process_signature_has_its_memory_and_its_instance() -> None:
    sim, _, backend, clock, gis = _mig_rig(privileged=False)  # the profiler runs unprivileged
    sigs = {s.pid: s for s in _sampler(backend, clock, {6001: "a", 6002: "b"}).sample()}
    instances = {gi.instance_id: gi for gi in sim.devices()[0].gpu_instances()}
    a = sigs[6001]
    assert a.device_id == instances[gis[0]].uuid
    assert a.process.gpu_mem_used_mib == pytest.approx(1000.0)
    assert a.device.mem_used_mib == pytest.approx(1000.0)  # the instance's, summed over its processes
    assert sigs[6002].process.gpu_mem_used_mib == pytest.approx(3000.0)


def test_a_failing_mig_device_read_keeps_the_gpu_list_without_memory() -> None:
    _, fake, backend, _, _ = _mig_rig()
    fake.inject("nvmlDeviceGetMaxMigDeviceCount", pynvml.NVML_ERROR_UNKNOWN)
    procs = backend.devices()[0].processes()
    assert sorted(p.pid for p in procs) == [6001, 6002]
    assert {p.used_mib for p in procs} == {None}  # unknown this time, not made up


def test_unprivileged_on_a_mig_gpu_with_the_mig_devices_unreadable_is_an_error() -> None:
    _, fake, backend, _, _ = _mig_rig(privileged=False)
    fake.inject("nvmlDeviceGetMaxMigDeviceCount", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(Exception, match="NVML code 999"):
        backend.devices()[0].processes()


def test_no_permission_on_a_gpu_without_mig_is_not_taken_for_mig() -> None:
    _, fake, backend, _ = _rig()
    fake.inject("nvmlDeviceGetComputeRunningProcesses", pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(Exception, match="NVML code 4"):
        backend.devices()[0].processes()


@pytest.mark.parametrize("contexts", ["C", "G", "C+G"])
def test_compute_and_graphics_processes_are_listed_once(contexts: str) -> None:
    sim, fake, backend, clock = _rig()
    sim.launch("a", 7001, _trace("a", 2048.0))
    clock.advance(1.0)
    fake.contexts[7001] = contexts
    procs = backend.devices()[0].processes()
    assert [(p.pid, p.used_mib) for p in procs] == [(7001, 2048.0)]  # whole MiB: exact


def test_graphics_list_not_supported_leaves_the_compute_list() -> None:
    sim, fake, backend, clock = _rig()
    sim.launch("a", 7001, _trace("a"))
    clock.advance(1.0)
    fake.inject("nvmlDeviceGetGraphicsRunningProcesses", pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert [p.pid for p in backend.devices()[0].processes()] == [7001]


class _RawSentinelPynvml(FakePynvml):
    """A pynvml that hands usedGpuMemory through as NVML's raw NVML_VALUE_NOT_AVAILABLE."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        out = super().nvmlDeviceGetComputeRunningProcesses(handle)
        for p in out:
            p.usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
        return out


def test_the_raw_not_available_sentinel_is_unknown_memory_not_16_exbibytes() -> None:
    clock = ManualClock(1000.0)
    sim = SimBackend(["h100-80gb"], clock=clock)
    sim.launch("a", 7001, _trace("a"))
    clock.advance(1.0)
    (proc,) = NvmlBackend(nvml=_RawSentinelPynvml(sim)).devices()[0].processes()
    assert proc.pid == 7001 and proc.used_mib is None


# --- per-process utilization -----------------------------------------------------------------------


def test_bogus_utilization_samples_are_dropped() -> None:
    sim, fake, backend, clock = _rig()
    sim.launch("a", 7001, _trace("a", sm_pct=30.0))
    clock.advance(1.0)
    newest = int(clock() * 1e6)
    fake.extra_utilization_samples = [
        (0, newest, 10, 10),  # no pid
        (7001, newest, 4294967295, 0),  # smUtil far above 100
        (7001, newest, 50, 250),  # memUtil above 100
        (7001, 1, 50, 10),  # older than asked for
    ]
    since = int((clock() - 0.5) * 1e6)
    samples = backend.devices()[0].process_utilization(since)
    assert samples and all(s.pid == 7001 and s.sm_pct == 30.0 and s.timestamp_us > since for s in samples)


def test_nvml_error_success_from_pynvml_means_no_samples() -> None:
    sim, fake, backend, clock = _rig()
    sim.launch("a", 7001, _trace("a"))
    clock.advance(1.0)
    fake.inject("nvmlDeviceGetProcessUtilization", pynvml.NVML_SUCCESS)  # pynvml raises NVMLError(0)
    assert backend.devices()[0].process_utilization(0) == []


def test_a_sample_of_an_unlisted_process_neither_reaches_a_signature_nor_hides_later_samples() -> None:
    sim, fake, backend, clock = _rig()
    sim.launch("a", 7001, _trace("a", sm_pct=30.0), loop=True)
    clock.advance(1.0)
    far_ahead_us = int((clock() + 3600.0) * 1e6)
    fake.extra_utilization_samples = [(99999, far_ahead_us, 100, 0)]  # no such process, an hour ahead
    sampler = _sampler(backend, clock, {7001: "a"})
    for _ in range(5):
        (sig,) = sampler.sample()
        assert parse_signature(sig)[0] is None  # the manager accepts it
        assert sig.process.sm_util_pct == 30.0
        clock.advance(0.5)
    assert sampler.stats.errors == {}


def test_a_sample_above_100_pct_never_makes_the_manager_reject_a_signature() -> None:
    sim, fake, backend, clock = _rig()
    sim.launch("a", 7001, _trace("a", sm_pct=30.0))
    clock.advance(1.0)
    fake.extra_utilization_samples = [(7001, int((clock() + 0.001) * 1e6), 4294967295, 0)]
    (sig,) = _sampler(backend, clock, {7001: "a"}).sample()
    assert parse_signature(sig)[0] is None
    assert sig.process.sm_util_pct == 30.0


# --- MIG mode --------------------------------------------------------------------------------------


def test_a_mig_mode_change_nvml_leaves_pending_raises_its_activation_status() -> None:
    sim, fake, backend, clock = _rig(("a100-40gb",))
    dev = backend.devices()[0]
    sim.launch("a", 7001, _trace("a"))
    clock.advance(1.0)
    with pytest.raises(InUse, match="pending"):
        dev.set_mig_mode(True)
    assert fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(0)) == [0, 1]  # current off, pending on
    assert not dev.mig_enabled()
    sim.kill(7001)
    dev.set_mig_mode(True)  # idle now: activates
    assert dev.mig_enabled()
    assert fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(0)) == [1, 1]


def test_a_mig_mode_change_that_needs_a_reset_says_so() -> None:
    _, fake, backend, _ = _rig(("a100-40gb",))
    fake.mig_activation_status = pynvml.NVML_ERROR_RESET_REQUIRED
    dev = backend.devices()[0]
    with pytest.raises(ResetRequired, match="reset the GPU"):
        dev.set_mig_mode(True)
    assert not dev.mig_enabled()


def test_an_unprivileged_profiler_on_a_mig_gpu_says_the_refused_field_once() -> None:
    _, _, backend, clock, _ = _mig_rig(privileged=False)
    logged: list[tuple[str, dict[str, Any]]] = []

    class _Log:
        def warning(self, event: str, **kw: Any) -> None:
            logged.append((event, kw))

        info = error = warning

    sampler = Sampler(backend, psutil_module=None, inapp_dir=None, clock=lambda: clock() + 1.7e9, monotonic=clock,
                      app_id_of={6001: "a", 6002: "b"}.get, logger=_Log())
    for _ in range(25):
        sigs = sampler.sample()
        assert len(sigs) == 2 and all(s.process.HasField("gpu_mem_used_mib") for s in sigs)
        clock.advance(0.1)
    refused = [kw for event, kw in logged if "without privileges" in event]
    assert [kw["field"] for kw in refused] == ["memory"]  # once, though refused every tick
    ((where, field), count), = sampler.stats.errors.items()
    assert field == "memory" and count == 25


# --- a GPU reset ---------------------------------------------------------------------------------


def test_a_gpu_whose_handle_went_stale_is_sampled_again_after_rediscovery() -> None:
    sim, fake, backend, clock = _rig(("h100-80gb", "h100-80gb"))
    sim.launch("a", 7001, _trace("a"), loop=True)
    sim.launch("b", 7002, _trace("b"), device_index=1, loop=True)
    clock.advance(1.0)
    sampler = _sampler(backend, clock, {7001: "a", 7002: "b"})
    assert {s.app_id for s in sampler.sample()} == {"a", "b"}
    fake.reset_gpu(1)  # its old handle now answers GPU_IS_LOST
    clock.advance(0.1)
    assert {s.app_id for s in sampler.sample()} == {"a"}
    assert sampler.lost_devices() == [sim.devices()[1].uuid]
    sampler.rediscover()  # what the sampler does every 30 s
    clock.advance(0.1)
    assert {s.app_id for s in sampler.sample()} == {"a", "b"}
    assert fake.calls["nvmlDeviceGetHandleByUUID"] == 1  # only the lost GPU was asked for again


def test_a_gpu_still_gone_keeps_its_old_handle_and_stays_lost() -> None:
    sim, _, backend, clock = _rig()
    dev = backend.devices()[0]
    sim.devices()[0].lose()
    with pytest.raises(GpuLost):
        dev.memory()
    assert not dev.reopen()
    assert backend.devices()[0] is dev  # the same device, still answering GPU_IS_LOST
    with pytest.raises(GpuLost):
        dev.power_limit_mw()


# --- library lifetime and threads ------------------------------------------------------------------


def test_close_shuts_nvml_down_once_and_tolerates_it_being_down_already() -> None:
    _, fake, backend, _ = _rig()
    fake.inject("nvmlShutdown", pynvml.NVML_ERROR_UNINITIALIZED)  # someone else shut it down
    backend.close()  # nothing left to release: no error
    backend.close()  # and a second close does not call nvmlShutdown again
    assert fake.calls["nvmlShutdown"] == 1


def test_close_still_fails_loudly_on_another_error() -> None:
    _, fake, backend, _ = _rig()
    fake.inject("nvmlShutdown", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(Exception, match="NVML code 999"):
        backend.close()


def test_reads_from_several_threads_at_once_agree_with_one_thread() -> None:
    sim, _, backend, clock, gis = _mig_rig()
    dev = backend.devices()[0]
    want = (sorted((p.pid, p.used_mib, p.gpu_instance_id) for p in dev.processes()),
            [(g.instance_id, g.uuid) for g in dev.gpu_instances()], dev.power_limit_mw())
    errors: list[BaseException] = []
    got: list[object] = []

    def reader() -> None:
        try:
            for _ in range(50):
                got.append((sorted((p.pid, p.used_mib, p.gpu_instance_id) for p in dev.processes()),
                            [(g.instance_id, g.uuid) for g in dev.gpu_instances()], dev.power_limit_mw()))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not errors and len(got) == 200 and all(g == want for g in got)


def test_an_idle_process_gets_no_nvml_sample_and_reads_zero_not_unknown() -> None:
    sim, fake, backend, clock = _rig()
    sim.launch("idle", 7001, _trace("idle", sm_pct=0.0), loop=True)
    sim.launch("busy", 7002, _trace("busy", sm_pct=40.0), loop=True)
    clock.advance(1.0)
    assert {s.pid for s in backend.devices()[0].process_utilization(0)} == {7002}  # as NVML: busy ones only
    sampler = _sampler(backend, clock, {7001: "idle", 7002: "busy"})
    first = {s.app_id: s for s in sampler.sample()}
    assert not first["idle"].process.HasField("sm_util_pct")  # just listed: too early to say
    assert first["busy"].process.sm_util_pct == 40.0
    for _ in range(12):
        clock.advance(0.1)
        sigs = {s.app_id: s for s in sampler.sample()}
    assert sigs["idle"].process.HasField("sm_util_pct") and sigs["idle"].process.sm_util_pct == 0.0
    assert sigs["busy"].process.sm_util_pct == 40.0


def test_an_idle_process_on_a_mig_gpu_stays_unknown() -> None:
    _, _, backend, clock, _ = _mig_rig()  # per-process utilization is not supported under MIG
    sampler = _sampler(backend, clock, {6001: "a", 6002: "b"})
    for _ in range(15):
        sigs = sampler.sample()
        clock.advance(0.1)
    assert sigs and not any(s.process.HasField("sm_util_pct") for s in sigs)


# --- power limit -----------------------------------------------------------------------------------


def test_an_unprivileged_power_limit_set_to_the_current_value_is_not_sent_to_nvml() -> None:
    sim, fake, backend, _ = _rig()
    sim.privileged = False
    with pytest.raises(pynvml.NVMLError_NoPermission):  # NVML refuses the setter itself without root
        fake.nvmlDeviceSetPowerManagementLimit(fake.nvmlDeviceGetHandleByIndex(0), sim.devices()[0].power_limit_mw())
    dev = backend.devices()[0]
    dev.set_power_limit_mw(dev.power_limit_mw())  # the backend sends nothing, so nothing is refused
    assert fake.calls["nvmlDeviceSetPowerManagementLimit"] == 1
