"""A request the application makes itself (explicit memory, or a job the cold-start sizer sizes) is
admitted out of the slack of the policy's managed grants (allocator/reclaim.py,
`Allocator._grant_reclaiming`): never below what their applications use plus the margin, heard
by them as RESIZED events, stored with the grant, enforced after the cut, refused (nothing changed)
when it does not fit even so."""

from __future__ import annotations

import pytest

from vgpu.allocator.core import AllocationEvent, AllocationRequest, Allocator, EventKind, Subscription
from vgpu.allocator.errors import InsufficientResources, StateNotSaved
from vgpu.allocator.ledger import AppLimits, Ledger
from vgpu.allocator.mechanisms.limits import CgroupMemoryLimits
from vgpu.allocator.policy.base import Recommendation, Sizing
from vgpu.allocator.policy.forecast import ForecastPolicy
from vgpu.allocator.reclaim import Slack, plan_reclaim
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.jobs import JobConfig

CGROUPS = {11: "/test/a", 12: "/test/b"}


class _Sizer:
    """Sizes every job at `mib` and `sm` % SM."""

    def __init__(self, mib: float = 30_000.0, sm: float = 70.0) -> None:
        self.mib, self.sm = mib, sm

    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        return Sizing(self.mib, self.sm, "test")


def _rig(gpus: tuple[str, ...] = ("h100-80gb",), *, reclaim: bool = True,
         hard_limit_at_frac: float = 0.0) -> tuple[Allocator, SimBackend]:
    clock = ManualClock(1000.0)
    backend = SimBackend(list(gpus), clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=False, sizer=_Sizer(), cgroup_limits=CgroupMemoryLimits(),
                          cgroup_of=CGROUPS.get, reclaim=reclaim, hard_limit_at_frac=hard_limit_at_frac)
    return allocator, backend


def _gpu(allocator: Allocator, i: int = 0) -> str:
    return allocator.ledger.devices()[i].device_id


def _total(allocator: Allocator) -> float:
    return allocator.ledger.devices()[0].mem_total_mib


def _forecast(allocator: Allocator, app: str, granted_mib: float, used_mib: float, sm: float = 100.0,
              sm_used: float = 40.0, device: int = 0) -> str:
    """A forecast grant of `granted_mib` / `sm` % for `app`, whose latest usage is `used_mib` / `sm_used` %."""
    rec = Recommendation(app, _gpu(allocator, device), granted_mib, sm, source="baseline",
                         mem_used_mib=used_mib, sm_util_pct=sm_used)
    allocator.apply_recommendations([rec])
    (g,) = allocator.ledger.grants(app_id=app)
    assert g.source == "forecast" and g.memory_mib == pytest.approx(granted_mib)
    return g.grant_id


def _drain(sub: Subscription) -> list[AllocationEvent]:
    return sub.drain_nowait()


def test_an_explicit_request_takes_the_forecast_grants_slack_and_the_app_hears_it() -> None:
    allocator, _ = _rig()
    total = _total(allocator)
    a = _forecast(allocator, "a", total - 10_000, used_mib=20_000, sm=60, sm_used=30)
    watch = allocator.watch("a")
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=40_000, sm_pct=50))
    assert (b.memory_mib, b.sm_pct, b.source) == (40_000, 50, "request")
    cut = allocator.ledger.get(a)
    # exactly what b lacked is taken (40,000 wanted, 10,000 free), never below a's use + 10 %
    assert cut.memory_mib == pytest.approx(total - 40_000)
    assert cut.memory_mib >= 20_000 * 1.1
    assert cut.sm_pct == pytest.approx(50)  # SM: 40 % free, 10 more from a's share (use 30 % + 10 %: 33 %)
    (event,) = _drain(watch)
    assert event.kind == EventKind.RESIZED and event.grant == cut and "reclaimed for b" in event.detail
    assert allocator.counters.reclaims == 1
    assert allocator.counters.grant_changes[("resized", "reclaim")] == 1
    assert allocator.ledger.usage(_gpu(allocator)).mem_available_mib == pytest.approx(0)


def test_it_is_refused_as_before_when_it_does_not_fit_even_so() -> None:
    allocator, _ = _rig()
    total = _total(allocator)
    a = _forecast(allocator, "a", total - 10_000, used_mib=40_000)
    before = allocator.ledger.to_records()
    with pytest.raises(InsufficientResources) as err:
        # free 10,000 + slack (grant - 44,000) is 4,000 MiB short of this
        allocator.request_allocation(AllocationRequest("b", memory_mib=total - 44_000 + 14_000))
    said = str(err.value)
    assert "does not fit" in said and "reclaimable" in said and "committed" in said
    assert allocator.ledger.to_records() == before and allocator.ledger.get(a).memory_mib == total - 10_000
    assert allocator.counters.reclaims == 0


def test_requests_and_apps_of_unknown_use_give_nothing_back() -> None:
    allocator, _ = _rig()
    total = _total(allocator)
    allocator.request_allocation(AllocationRequest("r", memory_mib=total - 10_000))
    allocator.apply_recommendations([Recommendation("r", _gpu(allocator), 1_000, 10, mem_used_mib=500)])
    with pytest.raises(InsufficientResources):
        allocator.request_allocation(AllocationRequest("b", memory_mib=20_000))
    assert allocator.ledger.grants(app_id="r")[0].memory_mib == total - 10_000
    # a forecast grant whose application's use is not known here (no recommendation) is not cut either
    allocator2, _ = _rig()
    _forecast(allocator2, "a", total - 10_000, used_mib=1_000)
    allocator2._latest.clear()  # as after a restart: grants restored, no recommendation yet
    with pytest.raises(InsufficientResources):
        allocator2.request_allocation(AllocationRequest("b", memory_mib=20_000))


def test_lower_priority_gives_first_then_the_largest_slack() -> None:
    allocator, _ = _rig()
    total = _total(allocator)
    hi = _forecast(allocator, "hi", 40_000, used_mib=1_000)
    allocator.set_limits(AppLimits("hi", priority=5))
    lo = _forecast(allocator, "lo", total - 40_000 - 1_000, used_mib=10_000)
    allocator.request_allocation(AllocationRequest("b", memory_mib=11_000))
    assert allocator.ledger.get(hi).memory_mib == 40_000  # the low-priority grant had enough slack
    assert allocator.ledger.get(lo).memory_mib == pytest.approx(total - 40_000 - 11_000)
    # more than lo can give: lo down to its floor, the rest from hi
    allocator.request_allocation(AllocationRequest("c", memory_mib=total - 40_000 - 11_000 - 11_000 + 5_000))
    assert allocator.ledger.get(lo).memory_mib == pytest.approx(11_000)
    assert allocator.ledger.get(hi).memory_mib == pytest.approx(35_000)


def test_a_request_without_a_device_goes_where_reclaiming_leaves_the_most() -> None:
    allocator, _ = _rig(("h100-80gb", "h100-80gb"))
    total = _total(allocator)
    _forecast(allocator, "a", total, used_mib=60_000, device=0)
    b = _forecast(allocator, "b", total, used_mib=10_000, device=1)
    g = allocator.request_allocation(AllocationRequest("c", memory_mib=30_000))
    assert g.device_id == _gpu(allocator, 1)
    assert allocator.ledger.get(b).memory_mib == pytest.approx(total - 30_000)


def test_operator_limits_still_refuse_and_nothing_is_cut() -> None:
    allocator, _ = _rig()
    a = _forecast(allocator, "a", _total(allocator), used_mib=1_000)
    allocator.set_limits(AppLimits("b", max_memory_mib=10_000))
    with pytest.raises(InsufficientResources, match="over its limit"):
        allocator.request_allocation(AllocationRequest("b", memory_mib=20_000))
    assert allocator.ledger.get(a).memory_mib == _total(allocator)
    allocator.request_allocation(AllocationRequest("b", memory_mib=10_000))  # within it: admitted
    assert allocator.ledger.get(a).memory_mib == pytest.approx(_total(allocator) - 10_000)


def test_the_sizers_sm_is_trimmed_and_an_explicit_sm_may_take_it_while_the_jobs_use_is_unknown() -> None:
    allocator, _ = _rig()
    a = _forecast(allocator, "a", 20_000, used_mib=10_000, sm=100, sm_used=40)
    g = allocator.request_allocation(AllocationRequest("b", job=JobConfig(model_type="resnet", batch_size=8)))
    watch = allocator.watch("b")
    # memory fitted; SM: a's share cut to its use + 10 % (44 %), b gets the 56 % left of the sizer's 70 %
    assert (g.source, g.memory_mib, g.sm_estimated) == ("cold_start", 30_000, True)
    assert allocator.ledger.get(a).sm_pct == pytest.approx(44) and g.sm_pct == pytest.approx(56)
    # b's share is the sizer's estimate and b's use is not known yet: an explicit share is taken from
    # it (a stays at its use's floor), and b hears of the cut
    c = allocator.request_allocation(AllocationRequest("c", memory_mib=1_000, sm_pct=10))
    assert c.sm_pct == 10 and allocator.ledger.get(g.grant_id).sm_pct == pytest.approx(46)
    assert allocator.ledger.get(g.grant_id).memory_mib == 30_000 and allocator.ledger.get(a).sm_pct == pytest.approx(44)
    (event,) = _drain(watch)
    assert event.kind == EventKind.RESIZED and "reclaimed for c" in event.detail and event.grant.sm_pct == 46
    # more than the estimates and the slack above use hold: refused, nothing changed
    before = allocator.ledger.to_records()
    with pytest.raises(InsufficientResources, match="SM") as refused:
        allocator.request_allocation(AllocationRequest("d", memory_mib=1_000, sm_pct=47))
    assert allocator.ledger.to_records() == before
    # the loading job's memory is committed (its cold-start size), a's need is its use + 10 %, and b's
    # 46 % estimate is what SM could be taken
    assert "31000 MiB committed" in str(refused.value) and "11000 MiB needed now" in str(refused.value)
    assert "46 % SM reclaimable" in str(refused.value)


def test_an_estimate_is_not_taken_for_another_estimate() -> None:
    allocator, _ = _rig()
    allocator.sizer = _Sizer(mib=10_000, sm=80)
    first = allocator.request_allocation(AllocationRequest("j1", job=JobConfig(model_type="resnet", batch_size=8)))
    second = allocator.request_allocation(AllocationRequest("j2", job=JobConfig(model_type="resnet", batch_size=8)))
    # the second job's estimate is trimmed to what is free; the first's stands
    assert (first.sm_pct, second.sm_pct) == (80, 20)
    assert allocator.ledger.get(first.grant_id).sm_pct == 80 and allocator.counters.reclaims == 0


def test_an_sm_share_the_job_asked_for_itself_is_not_taken() -> None:
    allocator, _ = _rig()
    g = allocator.request_allocation(AllocationRequest("b", job=JobConfig(model_type="resnet", batch_size=8),
                                                       sm_pct=100))
    assert (g.source, g.sm_pct, g.sm_estimated) == ("cold_start", 100, False)
    with pytest.raises(InsufficientResources, match="SM"):
        allocator.request_allocation(AllocationRequest("c", memory_mib=1_000, sm_pct=10))
    # once b's use is known its share is cut toward that use like any managed grant's
    allocator.apply_recommendations([Recommendation("b", _gpu(allocator), 30_000, 100, mem_used_mib=20_000,
                                                    sm_util_pct=50)])
    assert allocator.request_allocation(AllocationRequest("c", memory_mib=1_000, sm_pct=10)).sm_pct == 10


def test_a_cold_start_grant_keeps_its_size_and_the_cut_is_capped_after() -> None:
    allocator, backend = _rig(hard_limit_at_frac=0.9)
    total = _total(allocator)
    # a registers its job (30,000 MiB), then the policy widens its grant to 70,000
    a = allocator.request_allocation(AllocationRequest("a", job=JobConfig(model_type="resnet", batch_size=8), pid=11))
    allocator.apply_recommendations([Recommendation("a", _gpu(allocator), 70_000, 40, mem_used_mib=5_000,
                                                    sm_util_pct=30)])
    assert allocator.ledger.get(a.grant_id).memory_mib == 70_000
    with pytest.raises(InsufficientResources):  # a's floor is the sizer's 30,000, not its use
        allocator.request_allocation(AllocationRequest("b", memory_mib=total - 30_000 + 1, pid=12))
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=total - 40_000, pid=12))
    assert allocator.ledger.get(a.grant_id).memory_mib == pytest.approx(40_000)
    # contended now: both caps written at the grants as they are after the cut
    limits = dict(backend.devices()[0].memory_limits())
    assert limits == {"/test/a": (40_000, 40_000), "/test/b": (b.memory_mib, b.memory_mib)}


def test_a_store_that_fails_undoes_the_cut_with_the_grant() -> None:
    allocator, _ = _rig()
    a = _forecast(allocator, "a", _total(allocator), used_mib=1_000)
    watch = allocator.watch("a")

    def fail(_ledger: Ledger) -> None:
        raise StateNotSaved("disk full")

    allocator.on_change = fail
    with pytest.raises(StateNotSaved):
        allocator.request_allocation(AllocationRequest("b", memory_mib=10_000))
    assert allocator.ledger.get(a).memory_mib == _total(allocator)
    assert allocator.ledger.grants(app_id="b") == [] and _drain(watch) == []


def test_the_next_plan_does_not_grow_the_forecast_grant_back_over_the_request() -> None:
    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    allocator = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy())
    total = _total(allocator)
    gpu = _gpu(allocator)

    def tick(used: float) -> None:
        clock.advance(1.0)
        allocator.apply_recommendations([Recommendation("a", gpu, used, 40, mem_p90_peak_mib=used * 3,
                                                        sm_p90_peak_pct=90, mem_used_mib=used, sm_util_pct=40)])

    for _ in range(5):
        tick(20_000)
    (a,) = allocator.ledger.grants(app_id="a")
    assert a.source == "forecast" and a.memory_mib > total - 20_000  # the policy holds most of the GPU
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=30_000, sm_pct=20))
    assert allocator.ledger.get(a.grant_id).memory_mib >= 20_000 * 1.1
    for _ in range(5):
        tick(20_000)
    assert allocator.ledger.get(b.grant_id).memory_mib == 30_000 and allocator.ledger.get(b.grant_id).sm_pct == 20
    assert allocator.ledger.usage(gpu).mem_granted_mib <= total + 1e-6


def test_off_it_refuses_as_before() -> None:
    allocator, _ = _rig(reclaim=False)
    _forecast(allocator, "a", _total(allocator), used_mib=1_000)
    with pytest.raises(InsufficientResources):
        allocator.request_allocation(AllocationRequest("b", memory_mib=10_000))


def test_plan_reclaim_cuts_sm_in_proportion_within_a_priority() -> None:
    slacks = [Slack("g1", "a", 0, 100, 60, 0, 20), Slack("g2", "b", 0, 100, 40, 0, 20), Slack("g3", "c", 1, 100, 50, 0, 0)]
    plan = plan_reclaim("d", 0, 0, 0, 30, slacks)
    assert plan is not None
    cut = {c.grant_id: c.sm_pct for c in plan.cuts}
    assert cut == {"g1": pytest.approx(40), "g2": pytest.approx(30)}  # 60 points of slack at priority 0, half taken
    assert plan_reclaim("d", 0, 0, 0, 111, slacks) is None
    elastic = plan_reclaim("d", 0, 0, 0, 111, slacks, sm_elastic=True)
    assert elastic is not None and elastic.sm_pct == pytest.approx(110)
