"""An application the policy already manages (a forecast grant from its profiled use) that then
declares its job holds one grant on its GPU, not two: the cold-start grant supersedes the forecast
grant in one stored change (`Allocator._supersede_forecast`). The room the forecast grant held counts
toward the new grant; the new grant is no smaller than what the application held and uses there; the
sizer's size stays its `cold_start_mib`; the application and watchers hear RELEASED ("superseded") then
GRANTED, after the caps are written; a store that fails, or a refusal, leaves the forecast grant as it
was; and the policy resizes the single grant from then on. An explicit request is a floor the policy
tops up (allocator/policy/forecast.py `_grant_targets`), so it does not supersede anything."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vgpu.allocator.core import AllocationRequest, Allocator, EventKind
from vgpu.allocator.errors import InsufficientResources, StateNotSaved
from vgpu.allocator.ledger import AppLimits, Ledger
from vgpu.allocator.mechanisms.limits import CgroupMemoryLimits
from vgpu.allocator.policy.base import Recommendation, Sizing
from vgpu.allocator.policy.forecast import PREDICTIVE_CONFIG, ForecastPolicy
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.jobs import JobConfig

CGROUPS = {11: "/test/a", 12: "/test/b"}
JOB = JobConfig(model_type="resnet50", batch_size=8)


class _Sizer:
    """Sizes every job at `mib` and `sm` % SM."""

    def __init__(self, mib: float = 30_000.0, sm: float = 70.0) -> None:
        self.mib, self.sm = mib, sm

    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        return Sizing(self.mib, self.sm, "test")


def _rig(gpus: tuple[str, ...] = ("h100-80gb",), **kw: object) -> tuple[Allocator, SimBackend]:
    clock = ManualClock(1000.0)
    backend = SimBackend(list(gpus), clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=False, sizer=_Sizer(), cgroup_limits=CgroupMemoryLimits(),
                          cgroup_of=CGROUPS.get, **kw)  # type: ignore[arg-type]
    return allocator, backend


def _gpu(allocator: Allocator, i: int = 0) -> str:
    return allocator.ledger.devices()[i].device_id


def _forecast(allocator: Allocator, app: str, granted_mib: float, used_mib: float, sm: float = 40.0,
              device: int = 0) -> str:
    """A forecast grant of `granted_mib` / `sm` % for `app` (the baseline policy grants what it is
    told), whose latest usage is `used_mib`."""
    rec = Recommendation(app, _gpu(allocator, device), granted_mib, sm, source="baseline",
                         mem_used_mib=used_mib, sm_util_pct=sm / 2)
    allocator.apply_recommendations([rec])
    (g,) = allocator.ledger.grants(app_id=app, device_id=_gpu(allocator, device))
    assert g.source == "forecast" and g.memory_mib == pytest.approx(granted_mib)
    return g.grant_id


def test_a_declared_job_supersedes_the_forecast_grant_and_everyone_hears_it() -> None:
    allocator, backend = _rig()
    gpu = _gpu(allocator)
    old = _forecast(allocator, "a", 20_000, used_mib=5_000)
    mine, everyone = allocator.watch("a"), allocator.watch()
    granted = allocator.request_allocation(AllocationRequest("a", job=JOB, pid=11), caller="a")
    # one grant: the job's, at the sizer's size (more than the forecast grant held and the use)
    assert allocator.ledger.grants(app_id="a") == [granted]
    assert (granted.source, granted.memory_mib, granted.cold_start_mib) == ("cold_start", 30_000, 30_000)
    assert granted.sm_pct == 70 and granted.device_id == gpu
    assert allocator.ledger.usage(gpu).mem_granted_mib == 30_000  # counted once
    for sub in (mine, everyone):
        heard = sub.drain_nowait()
        assert [e.kind for e in heard if e.kind == EventKind.LIMITS_CHANGED] == [EventKind.LIMITS_CHANGED]
        released, got = [e for e in heard if e.kind != EventKind.LIMITS_CHANGED]  # its cap went on
        assert (released.kind, released.grant.grant_id) == (EventKind.RELEASED, old)  # type: ignore[union-attr]
        assert released.detail.startswith(f"superseded by its cold_start grant {granted.grant_id}")
        assert (got.kind, got.grant) == (EventKind.GRANTED, granted)
        # the caps are written before either is published: both say the job's cap is in force
        assert released.mem_limit == got.mem_limit == "hard"
    assert dict(backend.devices()[0].memory_limits()) == {"/test/a": (30_000, 30_000)}  # not 50,000
    changes = allocator.counters.grant_changes
    assert changes[("released", "superseded")] == 1 and changes[("granted", "cold_start")] == 1
    assert ("released", "released") not in changes
    assert allocator.counters.released == 1
    (info,) = allocator.list_apps()
    assert [g.grant_id for g in info.grants] == [granted.grant_id]


@pytest.mark.parametrize(("held_mib", "used_mib", "expected_mib"), [
    (50_000, 40_000, 50_000),  # held more than the job's size: nothing it holds is taken at once
    (20_000, 45_000, 45_000),  # used more than it held: nothing it uses is cut
    (20_000, 5_000, 30_000),   # the job's size
])
def test_the_new_grant_is_no_smaller_than_what_the_app_held_or_uses(held_mib: float, used_mib: float,
                                                                    expected_mib: float) -> None:
    allocator, _ = _rig()
    _forecast(allocator, "a", held_mib, used_mib=used_mib, sm=90)
    granted = allocator.request_allocation(AllocationRequest("a", job=JOB))
    assert granted.memory_mib == expected_mib
    assert granted.sm_pct == 90  # the forecast grant's SM share, more than the sizer's 70 %
    assert granted.cold_start_mib == 30_000  # the sizer's size, whatever the grant holds


def test_the_use_beyond_what_it_held_is_granted_as_far_as_there_is_room() -> None:
    allocator, _ = _rig()
    total = allocator.ledger.devices()[0].mem_total_mib
    _forecast(allocator, "a", 20_000, used_mib=60_000)
    allocator.request_allocation(AllocationRequest("b", memory_mib=total - 50_000))  # 30,000 MiB left for a
    granted = allocator.request_allocation(AllocationRequest("a", job=JOB))
    assert granted.memory_mib == 50_000  # its 20,000 and the 30,000 free; b is not cut for a's overrun
    assert allocator.ledger.usage(_gpu(allocator)).mem_available_mib == 0


@pytest.mark.parametrize("reclaim", [True, False])
def test_the_room_the_forecast_grant_held_counts_toward_the_job(reclaim: bool) -> None:
    """A full GPU: the application's forecast grant and another's request. The job fits in what the
    application itself held, which reclaiming (down to its use + 10 %) would not have freed."""
    allocator, _ = _rig(reclaim=reclaim)
    total = allocator.ledger.devices()[0].mem_total_mib
    _forecast(allocator, "a", total - 40_000, used_mib=20_000)
    allocator.request_allocation(AllocationRequest("b", memory_mib=40_000))
    granted = allocator.request_allocation(AllocationRequest("a", job=replace(JOB, batch_size=9)))
    assert granted.memory_mib == total - 40_000 and granted.cold_start_mib == 30_000
    assert [g.grant_id for g in allocator.ledger.grants(app_id="a")] == [granted.grant_id]
    assert allocator.ledger.grants(app_id="b")[0].memory_mib == 40_000


def test_the_app_may_hold_one_grant_only() -> None:
    allocator, _ = _rig()
    allocator.ledger.max_grants_per_app = 1
    _forecast(allocator, "a", 20_000, used_mib=5_000)
    granted = allocator.request_allocation(AllocationRequest("a", job=JOB))
    assert allocator.ledger.grants(app_id="a") == [granted]


def test_a_store_that_fails_leaves_the_forecast_grant_and_says_nothing() -> None:
    allocator, _ = _rig()
    old = _forecast(allocator, "a", 20_000, used_mib=5_000)
    before = allocator.ledger.to_records()
    watch = allocator.watch()
    counted = dict(allocator.counters.grant_changes)

    def fail(_ledger: Ledger) -> None:
        raise StateNotSaved("disk full")

    allocator.on_change = fail
    with pytest.raises(StateNotSaved):
        allocator.request_allocation(AllocationRequest("a", job=JOB, pid=11))
    assert allocator.ledger.to_records() == before and allocator.ledger.get(old).source == "forecast"
    assert allocator.ledger.changes().grants == () and allocator.ledger.changes().grants_removed == ()
    assert watch.drain_nowait() == [] and allocator.counters.grant_changes == counted
    assert allocator.counters.released == 0


def test_a_refused_job_leaves_the_forecast_grant() -> None:
    allocator, _ = _rig()
    old = _forecast(allocator, "a", 20_000, used_mib=5_000)
    allocator.set_limits(AppLimits("a", max_memory_mib=25_000))
    before = allocator.ledger.to_records()
    with pytest.raises(InsufficientResources, match="over its limit"):
        allocator.request_allocation(AllocationRequest("a", job=JOB))  # 30,000 MiB: over its limit
    assert allocator.ledger.to_records() == before and allocator.ledger.get(old).memory_mib == 20_000


def test_without_a_device_the_job_goes_where_its_forecast_grant_is() -> None:
    """The placement alone would choose the emptier GPU; the application runs where the profiler saw it."""
    allocator, _ = _rig(("h100-80gb", "h100-80gb"))
    _forecast(allocator, "a", 20_000, used_mib=5_000, device=1)
    granted = allocator.request_allocation(AllocationRequest("a", job=JOB))
    assert granted.device_id == _gpu(allocator, 1)
    assert allocator.ledger.grants(app_id="a") == [granted]


def test_a_forecast_grant_on_another_gpu_stays() -> None:
    allocator, _ = _rig(("h100-80gb", "h100-80gb"))
    other = _forecast(allocator, "a", 20_000, used_mib=5_000, device=1)
    granted = allocator.request_allocation(AllocationRequest("a", job=JOB, device_id=_gpu(allocator, 0)))
    assert granted.device_id == _gpu(allocator, 0) and allocator.ledger.get(other).memory_mib == 20_000


def test_an_explicit_request_is_a_floor_under_the_forecast_grant_not_a_replacement() -> None:
    allocator, _ = _rig()
    old = _forecast(allocator, "a", 20_000, used_mib=5_000)
    asked = allocator.request_allocation(AllocationRequest("a", memory_mib=1_000))
    assert {g.grant_id for g in allocator.ledger.grants(app_id="a")} == {old, asked.grant_id}
    assert allocator.counters.grant_changes.get(("released", "superseded"), 0) == 0


def test_the_policy_resizes_the_one_grant_after_the_declaration() -> None:
    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)
    allocator = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(cfg), sizer=_Sizer(3_000, 10))
    gpu = _gpu(allocator)
    seq = 0

    def seconds(n: int, used: float) -> None:
        nonlocal seq
        for _ in range(n):
            seq += 1
            allocator.apply_recommendations([Recommendation(
                "a", gpu, used, 20, mem_p90_peak_mib=used, sm_p90_peak_pct=20, mem_used_mib=used,
                sm_util_pct=20, for_seq=seq, first_use_s=1000.0)])
            clock.advance(1.0)

    seconds(40, 8_000.0)
    (old,) = allocator.ledger.grants(app_id="a")
    assert old.source == "forecast" and old.memory_mib >= 8_000
    job = allocator.request_allocation(AllocationRequest("a", job=JOB))
    assert job.memory_mib == old.memory_mib  # what it held, more than the sizer's 3,000
    seconds(60, 2_000.0)  # its use falls: past the job's start-up window, the grant follows it down
    (now,) = allocator.ledger.grants(app_id="a")
    assert now.grant_id == job.grant_id and now.source == "cold_start" and now.cold_start_mib == 3_000
    assert now.memory_mib < job.memory_mib
    assert allocator.ledger.usage(gpu).mem_granted_mib == now.memory_mib


def test_an_explicit_request_beside_the_forecast_grant_is_topped_up_not_counted_twice() -> None:
    """The design for requests: the policy's grant carries only what its plan wants beyond them, so
    once the shrink rules let it, the two add up to what the forecast grant alone held."""
    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=False,
                          policy=ForecastPolicy(replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)))
    gpu = _gpu(allocator)
    for seq in range(1, 121):
        if seq == 41:
            (alone,) = allocator.ledger.grants(app_id="a")
            asked = allocator.request_allocation(AllocationRequest("a", memory_mib=4_000))
        allocator.apply_recommendations([Recommendation(
            "a", gpu, 8_000, 20, mem_p90_peak_mib=8_000, sm_p90_peak_pct=20, mem_used_mib=8_000,
            sm_util_pct=20, for_seq=seq, first_use_s=1000.0)])
        clock.advance(1.0)
    now = {g.grant_id: g for g in allocator.ledger.grants(app_id="a")}
    assert set(now) == {alone.grant_id, asked.grant_id}
    assert now[asked.grant_id].memory_mib == 4_000
    assert sum(g.memory_mib for g in now.values()) == pytest.approx(alone.memory_mib)
