"""Hard memory limits only where a device is contended, cooperative ones elsewhere; and the job's
cold-start size carried into the predictive policy, with the start-up window counted from first use.

The allocator on the simulated GPU, with a manual clock: each rule is checked by what the device
holds (its per-cgroup memory limits) or by the grant, against the setting that turns the rule off."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from vgpu.allocator.core import AllocationEvent, AllocationRequest, Allocator, EventKind, Subscription
from vgpu.allocator.mechanisms.limits import CgroupMemoryLimits, read_cgroup
from vgpu.allocator.policy.base import IDLE_MEM_MIB, DeviceView, Enforcement, Plan, Recommendation, Sizing
from vgpu.allocator.policy.forecast import (
    PREDICTIVE_CONFIG,
    ForecastPolicy,
    active_since_use_s,
    history_since_use_s,
)
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.jobs import JobConfig
from vgpu.manager.core import first_use_s
from vgpu.traces import AppTrace

CGROUPS = {11: "/test/a", 12: "/test/b"}


def _rig(hard_at: float = PREDICTIVE_CONFIG.hard_limit_at_frac, policy: object | None = None,
         ) -> tuple[Allocator, SimBackend, ManualClock]:
    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=False, policy=policy or ForecastPolicy(),  # type: ignore[arg-type]
                          cgroup_limits=CgroupMemoryLimits(), cgroup_of=CGROUPS.get,
                          hard_limit_at_frac=hard_at)
    return allocator, backend, clock


def _limits(backend: SimBackend) -> dict[str, tuple[float, float]]:
    return dict(backend.devices()[0].memory_limits())


def _total(allocator: Allocator) -> float:
    return allocator.ledger.devices()[0].mem_total_mib


# --- hard only where contended ------------------------------------------------------------------------------
def test_limits_are_cooperative_until_the_device_is_contended_and_lifted_after() -> None:
    allocator, backend, _ = _rig()
    watch = allocator.watch("a")
    allocator.request_allocation(AllocationRequest("a", memory_mib=2048, pid=11))
    assert _limits(backend) == {}  # uncontended: no cgroup cap, the application keeps to its grant itself
    assert allocator.app_memory_limit("a")[0] == "cooperative"
    first = _drain(watch)[0]
    assert first.kind == EventKind.GRANTED and first.mem_limit == "cooperative"

    # b takes the device to 95 % of its memory: contended, the caps go on
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=0.95 * _total(allocator) - 2048, pid=12))
    assert _limits(backend) == {"/test/a": (2048.0, 2048.0), "/test/b": (b.memory_mib, b.memory_mib)}
    kind, why = allocator.app_memory_limit("a")
    assert kind == "hard" and why.startswith("contended")
    told = [e for e in _drain(watch) if e.kind == EventKind.LIMITS_CHANGED]
    assert [e.mem_limit for e in told] == ["hard"] and "contended" in told[0].detail

    # b leaves: the caps are lifted (the originals, no limit, written back)
    allocator.release(b.grant_id)
    assert _limits(backend) == {}
    assert allocator.app_memory_limit("a")[0] == "cooperative"
    assert [e.mem_limit for e in _drain(watch) if e.kind == EventKind.LIMITS_CHANGED] == ["cooperative"]
    allocator.stop()


def test_a_process_in_a_cgroup_whose_name_is_not_utf8_is_left_uncapped_and_the_others_capped(tmp_path: Path) -> None:
    """Any user with a delegated cgroup subtree (systemd's user@.service) may name a cgroup with
    bytes that are not UTF-8 and run its process there, so /proc/<pid>/cgroup is hostile input: that
    process has no cgroup the allocator can cap (it is told "cooperative"), while the request is
    answered, announced, and the other application on the contended device is capped as ever.
    Before, reading it raised UnicodeDecodeError out of the request after its grant was stored,
    and out of every later change on the device, so no cap was written there any more."""
    for pid, text in ((11, b"0::/test/a\n"), (12, b"0::/user.slice/user-1000.slice/\xff\xfe\n")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_bytes(text)
    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(),
                          cgroup_limits=CgroupMemoryLimits(),
                          cgroup_of=functools.partial(read_cgroup, proc_root=tmp_path),
                          hard_limit_at_frac=PREDICTIVE_CONFIG.hard_limit_at_frac)
    watch = allocator.watch("b")
    allocator.request_allocation(AllocationRequest("a", memory_mib=2048, pid=11))
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=0.95 * _total(allocator) - 2048, pid=12))
    assert _limits(backend) == {"/test/a": (2048.0, 2048.0)}  # contended: a capped, b has no cgroup to cap
    assert allocator.app_memory_limit("a")[0] == "hard"
    assert allocator.app_memory_limit("b")[0] == "cooperative"
    granted = [e for e in _drain(watch) if e.kind == EventKind.GRANTED]
    assert [(e.grant.grant_id, e.mem_limit) for e in granted if e.grant is not None] == [(b.grant_id, "cooperative")]
    allocator.release(b.grant_id)
    assert _limits(backend) == {}  # no longer contended: a's original written back
    allocator.stop()


def _drain(sub: Subscription) -> list[AllocationEvent]:
    return sub.drain_nowait()


def test_hard_everywhere_when_the_threshold_is_zero() -> None:
    """The setting that turns the rule off: every known pid's cgroup is capped at once."""
    allocator, backend, _ = _rig(hard_at=0.0)
    allocator.request_allocation(AllocationRequest("a", memory_mib=2048, pid=11))
    assert _limits(backend) == {"/test/a": (2048.0, 2048.0)}
    assert allocator.app_memory_limit("a")[0] == "hard"


def test_an_app_without_a_pid_is_cooperative_on_a_contended_device() -> None:
    allocator, _, _ = _rig()
    allocator.request_allocation(AllocationRequest("b", memory_mib=0.95 * _total(allocator)))
    kind, why = allocator.app_memory_limit("b")
    assert kind == "cooperative" and "no process" in why and allocator.memory_enforcement(
        allocator.ledger.devices()[0].device_id).hard_mem


class _Says:
    """A policy that plans nothing but the enforcement of every device."""

    def __init__(self, hard: bool) -> None:
        self.hard = hard

    def plan(self, recommendations: Sequence[Recommendation], devices: Sequence[DeviceView], now_s: float) -> Plan:
        return Plan(enforcement=tuple(Enforcement(d.device_id, self.hard, "forecast needs over capacity")
                                      for d in devices))


def test_the_plans_contention_makes_limits_hard_until_its_apps_are_gone() -> None:
    """Forecast needs above the device (a plan's decision) make the limits hard though the grants,
    clamped to what fits, are below the threshold; once no planned application is left, the grants
    alone decide again."""
    allocator, backend, _ = _rig(policy=_Says(True))
    dev = allocator.ledger.devices()[0].device_id
    allocator.request_allocation(AllocationRequest("a", memory_mib=2048, pid=11))
    assert _limits(backend) == {}
    allocator.apply_recommendations([Recommendation("a", dev, 2048.0, 10.0, mem_used_mib=1000.0)])
    assert _limits(backend) == {"/test/a": (2048.0, 2048.0)}
    assert allocator.memory_enforcement(dev).reason == "forecast needs over capacity"
    allocator.policy = _Says(False)
    allocator.apply_recommendations([Recommendation("a", dev, 2048.0, 10.0, mem_used_mib=1000.0)])
    assert _limits(backend) == {}
    allocator.policy = _Says(True)
    allocator.apply_recommendations([Recommendation("a", dev, 2048.0, 10.0, mem_used_mib=1000.0)])
    allocator.forget_app("a")  # its request grant stays; no plan speaks for the device any more
    assert not allocator.memory_enforcement(dev).hard_mem


def test_the_forecast_policy_marks_contention_by_forecast_needs() -> None:
    allocator, _, _ = _rig()
    dev = allocator.ledger.devices()[0]
    view = DeviceView(dev.device_id, "H100", dev.mem_total_mib, 100.0, ())
    small = [Recommendation(a, dev.device_id, 5_000.0, 10.0, mem_p90_peak_mib=5_000.0, mem_used_mib=4_000.0)
             for a in ("a", "b")]
    (e,) = ForecastPolicy().plan(small, [view], 0.0).enforcement
    assert not e.hard_mem and e.reason.startswith("uncontended")
    big = [Recommendation(a, dev.device_id, 50_000.0, 10.0, mem_p90_peak_mib=50_000.0, mem_used_mib=45_000.0)
           for a in ("a", "b")]
    (e,) = ForecastPolicy().plan(big, [view], 0.0).enforcement
    assert e.hard_mem and e.reason.startswith("contended")


def test_a_release_ends_the_plans_contention_at_once() -> None:
    """The policy planned b's forecast to more than 90 % of the device beside a's request: hard. b's
    grant is released (and b sends nothing more): the plan, judged again without b, no longer marks
    the device contended, so a's cap is lifted at once, not at a next plan that may never come."""
    allocator, backend, _ = _rig()
    dev = allocator.ledger.devices()[0].device_id
    allocator.request_allocation(AllocationRequest("a", memory_mib=2048, pid=11))
    need = 0.9 * _total(allocator)
    allocator.apply_recommendations([Recommendation("b", dev, need, 10.0, mem_p90_peak_mib=need, mem_used_mib=need)])
    assert _limits(backend) == {"/test/a": (2048.0, 2048.0)}
    (b,) = allocator.ledger.grants(app_id="b")
    watch = allocator.watch("a")
    allocator.release(b.grant_id)
    assert _limits(backend) == {}
    kind, why = allocator.app_memory_limit("a")
    assert kind == "cooperative" and why.startswith("uncontended once b left")
    assert [e.mem_limit for e in _drain(watch) if e.kind == EventKind.LIMITS_CHANGED] == ["cooperative"]


class _Counts:
    """A policy that plans no grants, only a decision that says what it counted per application."""

    def __init__(self, counted: dict[str, float]) -> None:
        self.counted = counted

    def plan(self, recommendations: Sequence[Recommendation], devices: Sequence[DeviceView], now_s: float) -> Plan:
        return Plan(enforcement=tuple(
            Enforcement(d.device_id, True, "needs over capacity", tuple(self.counted.items()), d.mem_total_mib,
                        0.9 * d.mem_total_mib) for d in devices))


def test_a_plan_still_contended_without_the_app_that_left_keeps_the_caps_until_its_last_one_leaves() -> None:
    """c's need (the plan's word) keeps the device contended after b leaves, though the grants are far
    below the threshold: the caps stay. Then c departs (it holds only a small request): judged on
    its grant, the device is not contended any more and the caps come off at once."""
    allocator, backend, _ = _rig()
    dev = allocator.ledger.devices()[0].device_id
    total = _total(allocator)
    allocator.policy = _Counts({"a": 2048.0, "b": 4096.0, "c": 0.9 * total})
    allocator.request_allocation(AllocationRequest("a", memory_mib=2048, pid=11))
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=4096))
    allocator.request_allocation(AllocationRequest("c", memory_mib=4096))
    allocator.apply_recommendations([Recommendation(x, dev, 4096.0, 10.0, mem_used_mib=4000.0) for x in ("b", "c")])
    assert _limits(backend) == {"/test/a": (2048.0, 2048.0)}
    allocator.release(b.grant_id)
    assert _limits(backend) == {"/test/a": (2048.0, 2048.0)}
    assert allocator.memory_enforcement(dev).reason.startswith("contended once b left")
    allocator.forget_app("c")  # its request grant stays; it counts at that, no longer at its need
    assert _limits(backend) == {}
    assert not allocator.memory_enforcement(dev).hard_mem


def test_a_forecast_plans_decision_judged_again_with_everyone_is_the_same() -> None:
    """What the decision counted reproduces it: nothing left out, the same kind."""
    policy = ForecastPolicy()
    for mib in (5_000.0, 38_000.0, 50_000.0):
        view = DeviceView("GPU-0", "H100", 81_559.0, 100.0, ())
        recs = [Recommendation(a, "GPU-0", mib, 10.0, mem_p90_peak_mib=mib, mem_used_mib=mib) for a in ("a", "b")]
        (e,) = policy.plan(recs, [view], 0.0).enforcement
        counted = dict(e.counted_mib)
        assert set(counted) == {"a", "b"}
        assert e.recounted("a", counted["a"]).hard_mem == e.hard_mem
        assert not e.recounted("a", 0.0).hard_mem or mib >= 0.9 * 81_559.0


# --- the cold-start size in the policy, the start-up window from first use --------------------------------
class _Sizer:
    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        return Sizing(10_000.0, 20.0, "test")


JOB = JobConfig(model_type="resnet50", batch_size=64, input_size=224)


def _cold_rig() -> tuple[Allocator, ManualClock, str]:
    clock = ManualClock(1000.0)
    allocator = Allocator(SimBackend(["h100-80gb"], clock=clock), clock=clock, dry_run=False, sizer=_Sizer(),
                          policy=ForecastPolicy())
    grant = allocator.request_allocation(AllocationRequest("job", job=JOB))
    assert grant.source == "cold_start" and grant.memory_mib == 10_000
    return allocator, clock, grant.device_id


def _idle(dev: str, clock: ManualClock, seq: int, first_use: float, used: float = 300.0) -> Recommendation:
    return Recommendation("job", dev, used, 0.0, "model", mem_p90_peak_mib=used, sm_p90_peak_pct=0.0,
                          mem_used_mib=used, sm_util_pct=0.0, for_seq=seq, decided_at_s=clock(),
                          first_use_s=first_use)


def _granted(allocator: Allocator) -> float:
    return sum(g.memory_mib for g in allocator.ledger.grants(app_id="job"))


def test_a_job_idle_after_registering_keeps_its_cold_start_size() -> None:
    """Registered, then loading data for 20 s (a context, no use yet): the cold-start size is where its
    ramp will end, so the grant stays there; the start-up window has not begun."""
    allocator, clock, dev = _cold_rig()
    for seq in range(1, 21):
        clock.advance(1.0)
        allocator.apply_recommendations([_idle(dev, clock, seq, math.inf)])
    assert _granted(allocator) == pytest.approx(10_000 * (1 + PREDICTIVE_CONFIG.mem_margin_frac))


def test_without_the_cold_start_size_or_first_use_the_idle_grant_shrinks() -> None:
    """The same job with the window counted from registration and no cold-start size in the policy
    (what a caller that says neither gets): the grant shrinks while the job idles."""
    allocator, clock, dev = _cold_rig()
    allocator._cold_start_mib.clear()  # the policy is not told the cold-start size
    for seq in range(1, 21):
        clock.advance(1.0)
        allocator.apply_recommendations([_idle(dev, clock, seq, math.nan)])
    assert _granted(allocator) < 0.8 * 10_000


def test_the_window_counts_from_first_use_then_ends() -> None:
    allocator, clock, dev = _cold_rig()
    clock.advance(30.0)
    used_at = clock()  # first use 30 s after registering
    for seq in range(1, 6):
        clock.advance(1.0)
        allocator.apply_recommendations([_idle(dev, clock, seq, used_at, used=500.0)])
    assert _granted(allocator) >= 10_000  # 5 s into the window
    for seq in range(6, 40):
        clock.advance(1.0)
        allocator.apply_recommendations([_idle(dev, clock, seq, used_at, used=500.0)])
    assert _granted(allocator) < 0.8 * 10_000  # past it, a job that stays small gives memory back


def test_history_since_use() -> None:
    assert history_since_use_s(100.0, 10.0, math.nan) == 90.0  # not said: since the first grant
    assert history_since_use_s(100.0, 10.0, math.inf) == 0.0  # not used yet
    assert history_since_use_s(100.0, 10.0, 95.0) == 5.0


def test_first_use_is_the_first_sample_with_memory_or_sm_in_use() -> None:
    t = np.arange(10.0)
    mem = np.array([0, 0, np.nan, 0, 0, 300, 300, 400, 500, 600], dtype=float)
    sm = np.zeros(10)
    assert first_use_s(AppTrace("a", t, {"mem_used_mib": mem, "sm_util_pct": sm})) == 5.0
    sm[3] = 12.0
    assert first_use_s(AppTrace("a", t, {"mem_used_mib": mem, "sm_util_pct": sm})) == 3.0
    assert first_use_s(AppTrace("a", t, {"mem_used_mib": np.zeros(10)})) == math.inf
    # the few MiB a process reads before it touches the GPU are not use (the policy's threshold)
    assert first_use_s(AppTrace("a", t, {"mem_used_mib": np.full(10, IDLE_MEM_MIB)})) == math.inf


def test_the_start_up_window_takes_the_managers_first_use_over_its_own() -> None:
    assert active_since_use_s(100.0, 90.0, 50.0) == 10.0  # the manager said when
    assert math.isnan(active_since_use_s(100.0, math.inf, 50.0))  # the manager says: not used yet
    assert active_since_use_s(100.0, math.nan, 50.0) == 50.0  # not said (the replay): its own history


def test_dry_run_decides_the_same_and_writes_nothing() -> None:
    """The device's decision is the same; the application is told "cooperative", since nothing caps it."""
    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=True, cgroup_limits=CgroupMemoryLimits(dry_run=True),
                          cgroup_of=CGROUPS.get, hard_limit_at_frac=0.9)
    allocator.request_allocation(AllocationRequest("a", memory_mib=0.95 * _total(allocator), pid=11))
    kind, why = allocator.app_memory_limit("a")
    assert allocator.memory_enforcement(allocator.ledger.devices()[0].device_id).hard_mem
    assert kind == "cooperative" and why.startswith("contended") and "dry run" in why
    assert _limits(backend) == {}


@pytest.mark.parametrize("told", [True, False])
def test_a_ramp_after_the_window_is_granted_to_the_cold_start_size(told: bool) -> None:
    """Past its start-up window, the job's memory starts to climb: the ramp is granted at once to
    where its cold-start size says it ends, not a few seconds of its rate at a time."""
    allocator, clock, dev = _cold_rig()
    if not told:
        allocator._cold_start_mib.clear()
    used_at = clock()
    seq = 0
    for _ in range(40):  # small and flat for 40 s: the grant shrinks towards it
        seq += 1
        clock.advance(1.0)
        allocator.apply_recommendations([_idle(dev, clock, seq, used_at, used=1000.0)])
    assert _granted(allocator) < 0.6 * 10_000
    for used in (1500.0, 2000.0, 2500.0):  # the ramp begins
        seq += 1
        clock.advance(1.0)
        allocator.apply_recommendations([_idle(dev, clock, seq, used_at, used=used)])
    if told:
        assert _granted(allocator) == pytest.approx(10_000 * (1 + PREDICTIVE_CONFIG.mem_margin_frac))
    else:
        assert _granted(allocator) < 0.6 * 10_000


def test_an_application_on_two_gpus_is_judged_on_each_as_its_caps_are_written() -> None:
    """Caps are per GPU: an application whose first grant is on a free GPU and whose second is on a
    contended one is capped on the second; what it is told says so, GPU by GPU."""
    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb", "h100-80gb"], clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=False, cgroup_limits=CgroupMemoryLimits(), cgroup_of=CGROUPS.get,
                          hard_limit_at_frac=PREDICTIVE_CONFIG.hard_limit_at_frac)
    free, busy = (d.uuid for d in backend.devices())
    allocator.request_allocation(AllocationRequest("multi", memory_mib=2048, pid=11, device_id=free))
    allocator.request_allocation(AllocationRequest("multi", memory_mib=4096, pid=11, device_id=busy))
    total = allocator.ledger.capacity(busy).mem_total_mib
    allocator.request_allocation(AllocationRequest("big", memory_mib=0.95 * total - 4096, pid=12, device_id=busy))
    # what is written: capped on the contended GPU at what it holds there, nothing on the free one
    caps = {d.uuid: dict(d.memory_limits()) for d in backend.devices()}
    assert caps[free] == {} and caps[busy]["/test/a"] == (4096.0, 4096.0)
    assert allocator.app_memory_limit("multi", free) == ("cooperative", allocator.memory_enforcement(free).reason)
    kind, why = allocator.app_memory_limit("multi", busy)
    assert kind == "hard" and why.startswith("contended")
    kind, why = allocator.app_memory_limit("multi")
    assert kind == "hard" and f"hard on {busy}: contended" in why and f"cooperative on {free}: uncontended" in why
    (info,) = [a for a in allocator.list_apps() if a.app_id == "multi"]
    assert (info.mem_limit, info.mem_limit_reason) == (kind, why)

    # a grant naming no pid on the contended GPU is not capped there (no process to cap), whatever
    # its grant elsewhere names
    allocator.request_allocation(AllocationRequest("nopid", memory_mib=1024, pid=11, device_id=free))
    allocator.request_allocation(AllocationRequest("nopid", memory_mib=1024, device_id=busy))
    assert allocator.app_memory_limit("nopid", busy)[0] == "cooperative"
    assert allocator.app_memory_limit("nopid")[0] == "cooperative"
    allocator.stop()


def test_what_an_app_is_told_follows_the_cap_in_force_not_the_devices_decision() -> None:
    """A cap whose write fails leaves the application cooperative on a contended GPU, and says why;
    a cap whose original cannot be written back leaves it hard on a GPU no longer contended. Each
    change of what is in force reaches the application as one LIMITS_CHANGED, and its other events
    say the same."""
    from vgpu.device.errors import DeviceError

    allocator, backend, _ = _rig()
    allocator.cgroup_limits = CgroupMemoryLimits(cgroup_exists=lambda _cg: True)  # the test's cgroups exist
    dev = backend.devices()[0]
    watch = allocator.watch("a")
    allocator.request_allocation(AllocationRequest("a", memory_mib=2048, pid=11))
    dev.inject("set_memory_limit_mib", DeviceError, times=None)  # every write fails
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=0.95 * _total(allocator) - 2048, pid=12))
    assert allocator.memory_enforcement(dev.uuid).hard_mem and _limits(backend) == {}
    kind, why = allocator.app_memory_limit("a")
    assert kind == "cooperative" and why.startswith("contended") and "no cap in place" in why
    assert {e.mem_limit for e in _drain(watch)} == {"cooperative"}

    dev.clear_faults()
    allocator.request_allocation(AllocationRequest("a", memory_mib=512, pid=11))  # the caps are written now
    assert _limits(backend)["/test/a"] == (2560.0, 2560.0)
    events = _drain(watch)
    assert [(e.kind, e.mem_limit) for e in events] == [(EventKind.LIMITS_CHANGED, "hard"), (EventKind.GRANTED, "hard")]

    dev.inject("set_memory_limit_mib", DeviceError, times=None)  # now the originals cannot go back
    allocator.release(b.grant_id)
    assert not allocator.memory_enforcement(dev.uuid).hard_mem and "/test/a" in _limits(backend)
    kind, why = allocator.app_memory_limit("a")
    assert kind == "hard" and why.startswith("uncontended") and "still holds our cap" in why
    assert not [e for e in _drain(watch) if e.kind == EventKind.LIMITS_CHANGED]  # nothing changed for a

    dev.clear_faults()
    allocator.request_allocation(AllocationRequest("a", memory_mib=256, pid=11))  # the next sync restores it
    assert _limits(backend) == {}
    assert [(e.kind, e.mem_limit) for e in _drain(watch)] == [(EventKind.LIMITS_CHANGED, "cooperative"),
                                                              (EventKind.GRANTED, "cooperative")]
    assert allocator.app_memory_limit("a")[0] == "cooperative"
    allocator.stop()
