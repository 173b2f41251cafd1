"""Hardware behaviour, written once and run on the simulator, NVML over the fake, and real NVML."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from device_rigs import Rig, trace

from vgpu.device.base import MemoryInfo, ProcessInfo
from vgpu.device.errors import (
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    NoPermission,
    NotFound,
    NotSupported,
)
from vgpu.device.sim import without_mig
from vgpu.device.skus import get_sku

# --- reads (these also run on a real GPU) ------------------------------------------------------


def test_identity_and_lookup_by_uuid(rig: Rig) -> None:
    devices = rig.backend.devices()
    assert devices
    for i, dev in enumerate(devices):
        assert dev.index == i
        assert dev.uuid.startswith("GPU-")
        assert dev.name
        assert rig.backend.device(dev.uuid) is not None
        assert rig.backend.device(dev.uuid).uuid == dev.uuid
    with pytest.raises(NotFound):
        rig.backend.device("GPU-no-such-device")


def test_memory_power_and_clock_reads_are_consistent(rig: Rig) -> None:
    dev = rig.device()
    mem = dev.memory()
    assert isinstance(mem, MemoryInfo)
    assert 0 <= mem.used_mib <= mem.total_mib
    assert 0 <= mem.free_mib <= mem.total_mib - mem.used_mib + 1.0  # real NVML may also reserve some
    if rig.sim is not None:
        assert mem.free_mib == mem.total_mib - mem.used_mib
    c = dev.power_constraints()
    assert 0 < c.min_mw <= c.default_mw <= c.max_mw
    assert c.min_mw <= dev.power_limit_mw() <= c.max_mw
    assert dev.power_usage_mw() >= 0
    assert dev.sm_clock_mhz() > 0
    tx, rx = dev.pcie_throughput_kbps()
    assert tx >= 0 and rx >= 0


def test_utilization_and_process_reads(rig: Rig) -> None:
    dev = rig.device()
    try:
        mig = dev.mig_enabled()
    except NotSupported:
        mig = False
    if mig:
        with pytest.raises(NotSupported):
            dev.utilization()
    else:
        u = dev.utilization()
        assert 0 <= u.sm_pct <= 100 and 0 <= u.mem_bw_pct <= 100
        for s in dev.process_utilization(0):
            assert s.timestamp_us > 0 and 0 <= s.sm_pct <= 100
    for p in dev.processes():
        assert isinstance(p, ProcessInfo) and p.pid > 0


def test_mig_reads_follow_the_mode(rig: Rig) -> None:
    dev = rig.device()
    try:
        mig = dev.mig_enabled()
    except NotSupported:
        pytest.skip("this GPU has no MIG")
    if not mig:
        with pytest.raises(NotSupported):
            dev.gpu_instances()
        return
    profiles = dev.gpu_instance_profiles()
    assert profiles
    for prof in profiles:
        assert prof.placements and prof.max_count >= 1 and prof.mem_mib > 0
    ids = {p.profile_id for p in profiles}
    for gi in dev.gpu_instances():
        assert gi.profile_id in ids


def test_mig_reconfiguration_time_is_exposed(rig_factory: Callable[..., Rig]) -> None:
    r = rig_factory(mig_reconfig_s=4.5)
    if r.kind == "nvml":
        assert r.device().mig_reconfig_s > 0
    else:
        assert r.device().mig_reconfig_s == 4.5


# --- power limit -------------------------------------------------------------------------------


def test_power_limit_within_constraints_reads_back_and_is_idempotent(rig: Rig) -> None:
    rig.need_writes()
    dev = rig.device()
    c = dev.power_constraints()
    target = (c.min_mw + c.max_mw) // 2
    dev.set_power_limit_mw(target)
    assert dev.power_limit_mw() == target
    writes = rig.sim_device().writes
    calls = rig.fake.calls["nvmlDeviceSetPowerManagementLimit"] if rig.fake else 0
    dev.set_power_limit_mw(target)  # the same value again: no write
    assert dev.power_limit_mw() == target
    assert rig.sim_device().writes == writes
    if rig.fake:
        assert rig.fake.calls["nvmlDeviceSetPowerManagementLimit"] == calls
    dev.set_power_limit_mw(c.min_mw)
    dev.set_power_limit_mw(c.max_mw)
    assert dev.power_limit_mw() == c.max_mw


@pytest.mark.parametrize("offset", [-1, +1])
def test_power_limit_outside_constraints_is_invalid_and_changes_nothing(rig: Rig, offset: int) -> None:
    rig.need_writes()
    dev = rig.device()
    c = dev.power_constraints()
    before = dev.power_limit_mw()
    bad = c.min_mw - 1 if offset < 0 else c.max_mw + 1
    with pytest.raises(InvalidArgument):
        dev.set_power_limit_mw(bad)
    assert dev.power_limit_mw() == before


def test_writes_without_privilege_are_refused(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    sim.privileged = False
    before = dev.power_limit_mw()
    with pytest.raises(NoPermission):
        dev.set_power_limit_mw(dev.power_constraints().min_mw)
    with pytest.raises(NoPermission):
        dev.set_mig_mode(True)
    assert dev.power_limit_mw() == before
    dev.set_power_limit_mw(before)  # the current value: nothing to write, no privilege needed


def test_power_follows_utilization_and_throttles_under_a_low_limit(rig: Rig) -> None:
    rig.need_sim()
    dev = rig.device()
    idle_mw = dev.power_usage_mw()
    full_clock = dev.sm_clock_mhz()
    rig.sim.launch("busy", 4242, trace("busy", [1000] * 30, 100.0))
    rig.advance(1.0)
    busy_mw = dev.power_usage_mw()
    assert busy_mw > idle_mw
    c = dev.power_constraints()
    dev.set_power_limit_mw(c.min_mw)
    assert dev.power_usage_mw() == c.min_mw
    assert dev.sm_clock_mhz() < full_clock
    assert rig.sim_device().throttle().slowdown > 1.0


# --- MIG constraints ---------------------------------------------------------------------------


def test_mig_calls_with_mig_disabled_are_not_supported(rig: Rig) -> None:
    rig.need_writes()
    dev = rig.device()
    assert dev.mig_enabled() is False
    for call in (
        dev.gpu_instance_profiles,
        dev.gpu_instances,
        lambda: dev.create_gpu_instance(0, 0),
        lambda: dev.destroy_gpu_instance(1),
    ):
        with pytest.raises(NotSupported):
            call()


def test_mig_calls_on_a_sku_without_mig_are_not_supported(rig_factory: Callable[..., Rig]) -> None:
    r = rig_factory(gpus=[without_mig(get_sku("h100-80gb"))])
    r.need_sim()
    dev = r.device()
    for call in (dev.mig_enabled, dev.gpu_instance_profiles, lambda: dev.set_mig_mode(True)):
        with pytest.raises(NotSupported):
            call()


def test_mig_mode_round_trip_and_busy_refusals(rig: Rig) -> None:
    rig.need_sim()
    dev = rig.device()
    pid = 777
    rig.sim.launch("app", pid, trace("app", [500] * 10, 10.0))
    with pytest.raises(InUse):
        dev.set_mig_mode(True)  # needs the GPU idle
    rig.sim.kill(pid)
    dev.set_mig_mode(True)
    assert dev.mig_enabled() is True
    with pytest.raises(NotSupported):
        dev.utilization()
    with pytest.raises(NotSupported):
        dev.process_utilization(0)
    gi = dev.create_gpu_instance(0, 0)  # 7g
    with pytest.raises(InUse):
        dev.set_mig_mode(False)  # instances still exist
    dev.destroy_gpu_instance(gi.instance_id)
    dev.set_mig_mode(False)
    assert dev.mig_enabled() is False


def test_overlap_count_and_placement_violations(rig_factory: Callable[..., Rig]) -> None:
    r = rig_factory(gpus=["a100-40gb"], mig_enabled=True)
    r.need_writes()
    dev = r.device()
    sku = get_sku("a100-40gb")
    three = sku.profile_by_name("3g.20gb")
    four = sku.profile_by_name("4g.20gb")
    me = sku.profile_by_name("1g.5gb+me")
    assert three and four and me
    dev.create_gpu_instance(three.profile_id, 0)
    with pytest.raises(InsufficientResources):
        dev.create_gpu_instance(four.profile_id, 0)  # overlaps 0:4
    dev.create_gpu_instance(me.profile_id, 4)
    with pytest.raises(InsufficientResources):
        dev.create_gpu_instance(me.profile_id, 5)  # max count 1
    with pytest.raises(InvalidArgument):
        dev.create_gpu_instance(three.profile_id, 2)  # 3g starts only at 0 or 4
    with pytest.raises((InvalidArgument, NotFound)):
        dev.destroy_gpu_instance(99)
    assert len(dev.gpu_instances()) == 2


def test_destroying_a_busy_instance_is_in_use(rig_factory: Callable[..., Rig]) -> None:
    r = rig_factory(gpus=["a100-80gb"], mig_enabled=True, mig_reconfig_s=0.0)
    sim = r.need_sim()
    dev = r.device()
    gi = dev.create_gpu_instance(get_sku("a100-80gb").profile_by_name("2g.20gb").profile_id, 2)  # type: ignore[union-attr]
    sim.launch("in-gi", 31337, trace("in-gi", [30000] * 20, 40.0), gpu_instance_id=gi.instance_id)
    r.advance(1.0)
    procs = dev.processes()
    assert [(p.pid, p.gpu_instance_id) for p in procs] == [(31337, gi.instance_id)]
    assert procs[0].used_mib == pytest.approx(19968.0)  # clipped to the instance's memory
    with pytest.raises(InUse):
        dev.destroy_gpu_instance(gi.instance_id)
    assert [g.instance_id for g in dev.gpu_instances()] == [gi.instance_id]
    sim.kill(31337)
    dev.destroy_gpu_instance(gi.instance_id)
    assert dev.gpu_instances() == []


def test_new_instances_become_usable_after_the_reconfiguration_time(rig_factory: Callable[..., Rig]) -> None:
    r = rig_factory(gpus=["h100-80gb"], mig_enabled=True, mig_reconfig_s=6.0)
    sim = r.need_sim()
    dev = r.device()
    gi = dev.create_gpu_instance(9, 0)  # 3g.40gb, listed at once
    assert [g.instance_id for g in dev.gpu_instances()] == [gi.instance_id]
    launch = sim.launch("late", 99, trace("late", [1000] * 20, 10.0), gpu_instance_id=gi.instance_id)
    assert launch.start_s == pytest.approx(r.clock() + 6.0)  # type: ignore[misc]
    r.advance(5.9)
    assert dev.processes() == []
    r.advance(0.2)
    assert [p.pid for p in dev.processes()] == [99]


# --- lost GPU and fault injection --------------------------------------------------------------


def test_gpu_lost_mid_run_fails_every_call(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    sim.launch("victim", 55, trace("victim", [2000] * 10, 50.0))
    rig.advance(1.0)
    assert dev.memory().used_mib == 2000
    rig.sim_device().lose()
    calls = [
        dev.memory,
        dev.utilization,
        dev.power_usage_mw,
        dev.power_limit_mw,
        dev.power_constraints,
        dev.sm_clock_mhz,
        dev.pcie_throughput_kbps,
        dev.processes,
        lambda: dev.process_utilization(0),
        dev.mig_enabled,
        dev.gpu_instance_profiles,
        dev.gpu_instances,
        lambda: dev.set_power_limit_mw(300_000),
        lambda: dev.set_mig_mode(True),
        lambda: dev.create_gpu_instance(0, 0),
        lambda: dev.destroy_gpu_instance(1),
    ]
    for call in calls:
        with pytest.raises(GpuLost):
            call()


def test_injected_faults_fire_the_requested_number_of_times(rig: Rig) -> None:
    rig.need_sim()
    dev = rig.device()
    rig.sim_device().inject("memory", InUse, times=2)
    for _ in range(2):
        with pytest.raises(InUse):
            dev.memory()
    assert dev.memory().total_mib > 0
    with pytest.raises(ValueError):
        rig.sim_device().inject("no_such_method", InUse)


# --- following a trace -------------------------------------------------------------------------


def test_memory_follows_the_trace_and_the_process_ends_with_it(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    mem = [1000, 1500, 4000, 4000, 2500, 512]
    t0 = rig.clock()  # type: ignore[misc]
    launch = sim.launch("train", 1234, trace("train", mem, [10, 20, 30, 40, 50, 60], pcie_tx_kbps=[7] * 6))
    assert launch.end_s == pytest.approx(t0 + 6.0)
    for k, want in enumerate(mem):
        rig.clock.set(t0 + k + 0.5)  # type: ignore[union-attr]
        assert dev.memory().used_mib == want
        assert [(p.pid, p.used_mib) for p in dev.processes()] == [(1234, want)]
        assert dev.utilization().sm_pct == pytest.approx(10 * (k + 1))
        assert dev.pcie_throughput_kbps()[0] == 7
    rig.clock.set(t0 + 6.0)  # type: ignore[union-attr]
    assert dev.processes() == [] and dev.memory().used_mib == 0


def test_speed_and_looping(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    t0 = rig.clock()  # type: ignore[misc]
    sim.launch("fast", 1, trace("fast", [100, 200, 300, 400], 1.0), speed=2.0)
    sim.launch("loop", 2, trace("loop", [1000, 2000], 1.0), loop=True)
    rig.clock.set(t0 + 1.25)  # type: ignore[union-attr]  fast at trace time 2.5 -> 300; loop at 1.25 -> 2000
    assert {p.pid: p.used_mib for p in dev.processes()} == {1: 300, 2: 2000}
    rig.clock.set(t0 + 4.5)  # type: ignore[union-attr]  fast ended at t0+2; loop at 4.5 mod 2 = 0.5 -> 1000
    assert {p.pid: p.used_mib for p in dev.processes()} == {2: 1000}


def test_device_utilization_is_the_capped_sum(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    sim.launch("a", 10, trace("a", [100] * 5, 70.0, mem_util_pct=[30] * 5))
    sim.launch("b", 11, trace("b", [100] * 5, 60.0, mem_util_pct=[20] * 5))
    rig.advance(0.5)
    u = dev.utilization()
    assert u.sm_pct == 100 and u.mem_bw_pct == 50
    assert dev.memory().used_mib == 200


def test_process_utilization_returns_only_newer_samples(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    sim.launch("a", 21, trace("a", [100] * 20, [5, 15, 25, 35, 45, 55, 65, 75, 85, 95] * 2))
    rig.advance(2.0)
    first = dev.process_utilization(0)
    assert first and all(s.pid == 21 for s in first)
    stamps = [s.timestamp_us for s in first]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert first[-1].sm_pct == 25  # the sample at t0+2 s reads trace second 2
    last = stamps[-1]
    assert dev.process_utilization(last) == []
    rig.advance(1.0)
    newer = dev.process_utilization(last)
    assert newer and all(s.timestamp_us > last for s in newer)
    assert len(newer) == pytest.approx(6, abs=1)  # one sample per 1/6 s


def test_process_reads_keep_their_promises_on_any_device(rig: Rig) -> None:
    """Reads only, so it also runs on a real GPU with whatever runs there: each process once per
    instance, its memory unknown (None) or within the GPU's, per-process samples of a real pid with
    utilization within 0-100 %, and a read from the newest timestamp returning only newer samples."""
    if rig.sim is not None:
        rig.sim.launch("a", 41, trace("a", [700] * 10, 40.0))
        rig.advance(1.0)
    dev = rig.device()
    procs = dev.processes()
    keys = [(p.pid, p.gpu_instance_id) for p in procs]
    assert len(keys) == len(set(keys))
    try:
        total_mib = dev.memory().total_mib
    except (NotSupported, NoPermission):  # an unprivileged caller on a MIG GPU
        total_mib = math.inf
    for p in procs:
        assert p.pid > 0 and (p.used_mib is None or 0 <= p.used_mib <= total_mib)
    try:
        samples = list(dev.process_utilization(0))
    except NotSupported:  # MIG, or a board without per-process counters
        samples = []
    for s in samples:
        assert s.pid > 0 and 0 <= s.sm_pct <= 100 and 0 <= s.mem_bw_pct <= 100 and s.timestamp_us > 0
    if samples:
        newest = max(s.timestamp_us for s in samples)
        assert all(s.timestamp_us > newest for s in dev.process_utilization(newest))
    if rig.sim is not None:
        assert keys == [(41, None)] and procs[0].used_mib == 700
        assert samples and {s.pid for s in samples} == {41}


def test_two_gpus_are_independent(rig_factory: Callable[..., Rig]) -> None:
    r = rig_factory(gpus=["a100-40gb", "h100-80gb"])
    sim = r.need_sim()
    sim.launch("on1", 5, trace("on1", [3000] * 5, 50.0), device_index=1)
    r.advance(0.5)
    d0, d1 = r.backend.devices()
    assert d0.memory().used_mib == 0 and d1.memory().used_mib == 3000
    assert d0.memory().total_mib == 40960 and "A100" in d0.name and "H100" in d1.name
    with pytest.raises(InvalidArgument):
        sim.launch("again", 5, trace("again", [1], 1.0), device_index=0)  # pid already runs


# --- per-cgroup memory limits (nvmlDevice{Set,Get}MemoryLimits_v1) ---------------------------------
def test_cgroup_memory_limit_sets_reads_back_and_clears(rig: Rig) -> None:
    rig.need_writes()
    dev = rig.device()
    ns = "/system.slice/job-a.scope"
    assert dev.memory_limit_mib(ns) == (math.inf, math.inf, 0.0)  # nothing set: no limit
    dev.set_memory_limit_mib(ns, 6_000, 8_000.5)
    assert dev.memory_limit_mib(ns) == (6_000, 8_000.5, 0.0)
    assert dev.memory_limit_mib("/system.slice/job-b.scope").hard_mib == math.inf  # per namespace
    writes = rig.sim_device().writes
    dev.set_memory_limit_mib(ns, 6_000, 8_000.5)  # the current limits: nothing written
    assert rig.sim_device().writes == writes
    dev.set_memory_limit_mib(ns, math.inf, math.inf)
    assert dev.memory_limit_mib(ns) == (math.inf, math.inf, 0.0)


def test_cgroup_memory_limit_clips_the_namespace_processes(rig: Rig) -> None:
    sim = rig.need_sim()
    dev = rig.device()
    sim.launch("a1", 11, trace("a1", [3_000] * 20, 10), cgroup="/jobs/a")
    sim.launch("a2", 12, trace("a2", [3_000] * 20, 10), cgroup="/jobs/a")
    sim.launch("b", 13, trace("b", [3_000] * 20, 10), cgroup="/jobs/b")
    rig.advance(0.5)
    assert dev.memory_limit_mib("/jobs/a").used_mib == 6_000
    dev.set_memory_limit_mib("/jobs/a", 4_000, 4_000)
    used = {p.pid: p.used_mib for p in dev.processes()}
    assert used == {11: 3_000, 12: 1_000, 13: 3_000}  # the later process of /jobs/a is clipped, /jobs/b is not
    assert dev.memory_limit_mib("/jobs/a") == (4_000, 4_000, 4_000)
    assert dev.memory().used_mib == 7_000


def test_cgroup_memory_limit_refusals(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory()
    rig.need_writes()
    dev = rig.device()
    for ns, soft, hard in [("relative/path", 1.0, 1.0), ("/a", 2.0, 1.0), ("/a", 0.0, 1.0), ("/a", math.nan, 1.0)]:
        with pytest.raises(InvalidArgument):
            dev.set_memory_limit_mib(ns, soft, hard)
    assert dev.memory_limit_mib("/a").hard_mib == math.inf
    rig.need_sim().privileged = False
    with pytest.raises(NoPermission):
        dev.set_memory_limit_mib("/a", 1_000, 1_000)
    assert dev.memory_limit_mib("/a").hard_mib == math.inf
    # a driver without the functions: NotSupported for reads and writes (FUNCTION_NOT_FOUND under NVML)
    old = rig_factory(memory_limits=False).device()
    with pytest.raises(NotSupported):
        old.memory_limit_mib("/a")
    with pytest.raises(NotSupported):
        old.set_memory_limit_mib("/a", 1_000, 1_000)
