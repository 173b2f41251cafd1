"""The allocation policy: guarantees, priorities under contention, hysteresis, reclamation, estimators."""

from __future__ import annotations

import math

import pytest

from vgpu.allocator.policy.forecast import (
    AppState,
    DeviceState,
    PolicyConfig,
    WithCapping,
    WithConfidence,
    WithMargin,
    advance,
    forecast_or_usage,
    plan,
    priority_score,
)

DEV = DeviceState("gpu0", mem_total_mib=80_000)
# no confidence widening, so the arithmetic below is plain
CFG = PolicyConfig(confidence_multiplier=0.0, min_change_frac=0.05, dwell_s=10.0)


def app(app_id: str, **kw: object) -> AppState:
    return AppState(app_id=app_id, device_id="gpu0", **kw)  # type: ignore[arg-type]


def test_forecast_plus_margin_sizes_a_new_app() -> None:
    p = plan([app("a", forecast_mem_p90_mib=10_000, forecast_sm_p90_pct=40)], [DEV], 0.0, CFG)
    t = p.target("a")
    assert t.mem_mib == pytest.approx(11_000)
    assert t.sm_pct == pytest.approx(44)
    assert t.changed and t.reason_mem == "forecast"


def test_guarantee_is_a_floor_even_when_forecast_is_lower() -> None:
    a = app("a", request_mem_mib=20_000, request_sm_pct=30, granted_mem_mib=20_000, granted_sm_pct=30,
            forecast_mem_p90_mib=5_000, forecast_sm_p90_pct=5, used_mem_mib=4_000, used_sm_pct=3)
    t = plan([a], [DEV], 100.0, CFG).target("a")
    assert t.mem_mib == 20_000 and t.sm_pct == 30
    assert not t.changed


def test_reclamation_takes_back_unused_memory() -> None:
    a = app("a", granted_mem_mib=40_000, granted_sm_pct=50, used_mem_mib=9_000, used_sm_pct=20,
            forecast_mem_p90_mib=10_000, forecast_sm_p90_pct=20)
    t = plan([a], [DEV], 100.0, CFG).target("a")
    assert t.mem_mib == pytest.approx(11_000)
    assert t.sm_pct == pytest.approx(22)
    assert t.changed_mem and t.changed_sm


def test_reclamation_grows_an_app_using_more_than_its_forecast() -> None:
    a = app("a", granted_mem_mib=10_000, used_mem_mib=15_000, forecast_mem_p90_mib=9_000,
            granted_sm_pct=20, used_sm_pct=10, forecast_sm_p90_pct=10)
    t = plan([a], [DEV], 100.0, CFG).target("a")
    assert t.mem_mib == pytest.approx(16_500)
    assert t.reason_mem in ("overrun", "reclaim-grow")


def test_change_below_threshold_is_not_made() -> None:
    a = app("a", granted_mem_mib=10_000, granted_sm_pct=40, forecast_mem_p90_mib=9_600 / 1.1,
            forecast_sm_p90_pct=40 / 1.1)
    t = plan([a], [DEV], 100.0, CFG).target("a")
    assert t.mem_mib == 10_000 and t.reason_mem == "below-threshold"
    assert not t.changed
    # a larger step is made
    b = app("b", granted_mem_mib=10_000, granted_sm_pct=40, forecast_mem_p90_mib=8_000 / 1.1,
            forecast_sm_p90_pct=40 / 1.1)
    assert plan([b], [DEV], 100.0, CFG).target("b").mem_mib == pytest.approx(8_000)


def test_dwell_time_holds_a_recent_change_then_releases_it() -> None:
    a = app("a", granted_mem_mib=20_000, granted_sm_pct=40, forecast_mem_p90_mib=10_000,
            forecast_sm_p90_pct=40 / 1.1, last_mem_change_s=95.0)
    early = plan([a], [DEV], 100.0, CFG).target("a")
    assert early.mem_mib == 20_000 and early.reason_mem == "dwell"
    late = plan([a], [DEV], 105.0, CFG).target("a")
    assert late.mem_mib == pytest.approx(11_000)


def test_overrun_growth_ignores_dwell() -> None:
    a = app("a", granted_mem_mib=10_000, used_mem_mib=12_000, forecast_mem_p90_mib=12_000,
            granted_sm_pct=50, forecast_sm_p90_pct=40, last_mem_change_s=99.0)
    t = plan([a], [DEV], 100.0, CFG).target("a")
    assert t.mem_mib == pytest.approx(13_200) and t.reason_mem == "overrun"
    held = plan([a], [DEV], 100.0, PolicyConfig(confidence_multiplier=0, grow_on_overrun=False)).target("a")
    assert held.mem_mib == 10_000


def test_lower_priority_shrinks_first_and_never_below_its_guarantee() -> None:
    dev = DeviceState("gpu0", mem_total_mib=50_000)
    hi = app("hi", priority=5, request_mem_mib=10_000, forecast_mem_p90_mib=30_000 / 1.1, forecast_sm_p90_pct=10)
    lo = app("lo", priority=0, request_mem_mib=15_000, forecast_mem_p90_mib=30_000 / 1.1, forecast_sm_p90_pct=10)
    p = plan([hi, lo], [dev], 0.0, CFG)
    assert p.target("hi").mem_mib == pytest.approx(30_000)  # untouched
    assert p.target("lo").mem_mib == pytest.approx(20_000)  # absorbed the 10 000 excess
    assert p.target("lo").reason_mem == "contention"
    assert p.devices[0].contended_mem and not p.devices[0].overcommitted

    # more excess than the low one can give: it stops at its guarantee, then the next shrinks
    tight = DeviceState("gpu0", mem_total_mib=35_000)
    p = plan([hi, lo], [tight], 0.0, CFG)
    assert p.target("lo").mem_mib == pytest.approx(15_000)
    assert p.target("hi").mem_mib == pytest.approx(20_000)
    assert sum(t.mem_mib for t in p.targets) == pytest.approx(35_000)


def test_sm_is_shared_in_proportion_within_a_priority_class() -> None:
    # one small and two large applications of equal priority, each wanting most of the GPU's SM
    small = app("small", used_mem_mib=2_000, forecast_mem_p90_mib=2_000, forecast_sm_p90_pct=70 / 1.1)
    big1 = app("big1", used_mem_mib=15_000, forecast_mem_p90_mib=15_000, forecast_sm_p90_pct=90 / 1.1)
    big2 = app("big2", used_mem_mib=15_000, forecast_mem_p90_mib=15_000, forecast_sm_p90_pct=90 / 1.1)
    p = plan([small, big1, big2], [DEV], 0.0, CFG)
    sm = {t.app_id: t.sm_pct for t in p.targets}
    assert sum(sm.values()) == pytest.approx(100)
    # each keeps the same fraction of what it wanted above the 5 % minimum: nobody is cut to the floor
    scale = (100 - 15) / (65 + 85 + 85)
    assert sm["small"] == pytest.approx(5 + 65 * scale) and sm["big1"] == pytest.approx(5 + 85 * scale)
    assert sm["big1"] == pytest.approx(sm["big2"]) and all(t.reason_sm == "contention" for t in p.targets)
    assert p.devices[0].contended_sm
    # a higher class is cut only once the lower one is at its floor
    vip = app("vip", priority=1, used_mem_mib=15_000, forecast_mem_p90_mib=15_000, forecast_sm_p90_pct=90 / 1.1)
    p = plan([small, big1, vip], [DEV], 0.0, CFG)
    sm = {t.app_id: t.sm_pct for t in p.targets}
    assert sm["small"] == pytest.approx(5) and sm["big1"] == pytest.approx(5) and sm["vip"] == pytest.approx(90)


def test_guarantees_beyond_capacity_are_kept_and_flagged() -> None:
    dev = DeviceState("gpu0", mem_total_mib=20_000)
    a = app("a", request_mem_mib=15_000)
    b = app("b", request_mem_mib=15_000)
    p = plan([a, b], [dev], 0.0, CFG)
    assert p.target("a").mem_mib == 15_000 and p.target("b").mem_mib == 15_000
    assert p.devices[0].overcommitted


def test_priority_score_orders_critical_deadline_and_size() -> None:
    base = app("x", used_mem_mib=1024)
    assert priority_score(app("c", critical=True), 0) > priority_score(app("p", priority=50), 0)
    assert priority_score(app("d", deadline_s=1800), 0) > priority_score(app("e", deadline_s=36_000), 0)
    assert priority_score(app("small", used_mem_mib=1024), 0) > priority_score(app("big", used_mem_mib=70_000), 0)
    assert priority_score(app("late", deadline_s=10), 100) == pytest.approx(20)  # missed: full urgency
    assert priority_score(base, 0) == pytest.approx(-1.0)


def test_unknown_device_and_duplicate_app_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        plan([AppState("a", "nope")], [DEV], 0.0)
    with pytest.raises(ValueError, match="twice"):
        plan([app("a"), app("a")], [DEV], 0.0)
    with pytest.raises(ValueError, match="below the explicit request"):
        app("a", request_mem_mib=10, max_mem_mib=5)
    with pytest.raises(ValueError):
        app("a", granted_mem_mib=-1)


def test_nothing_known_keeps_the_grant_and_a_new_app_gets_the_minimum() -> None:
    old = app("old", granted_mem_mib=5_000, granted_sm_pct=20)
    new = app("new")
    p = plan([old, new], [DEV], 0.0, CFG)
    assert p.target("old").mem_mib == 5_000 and not p.target("old").changed
    assert p.target("new").mem_mib == CFG.min_mem_mib and p.target("new").sm_pct == CFG.min_sm_pct


def test_estimators_compose_like_vpa() -> None:
    devs = {"gpu0": DeviceState("gpu0", mem_total_mib=10_000)}
    chain = WithCapping(lambda r: 100.0, devs, WithConfidence(1.0, 1.0, 60.0, WithMargin(lambda r: 0.5, forecast_or_usage)))
    young = app("y", forecast_mem_p90_mib=1_000, history_s=60)  # confidence 1 -> x2
    old = app("o", forecast_mem_p90_mib=1_000, history_s=6_000)  # confidence 100 -> x1.01
    assert chain(young, "mem") == pytest.approx(3_000)
    assert chain(old, "mem") == pytest.approx(1_515)
    assert chain(app("h", forecast_mem_p90_mib=9_000, history_s=60), "mem") == 10_000  # device cap
    assert chain(app("l", forecast_mem_p90_mib=10, history_s=6_000), "mem") == 100  # minimum
    assert math.isnan(chain(app("n"), "mem"))
    capped = app("m", forecast_mem_p90_mib=4_000, history_s=6_000, max_mem_mib=5_000)
    assert chain(capped, "mem") == 5_000  # operator limit


def test_advance_records_change_times_and_feeds_hysteresis() -> None:
    apps = [app("a", forecast_mem_p90_mib=10_000, forecast_sm_p90_pct=10)]
    p1 = plan(apps, [DEV], 0.0, CFG)
    apps = advance(apps, p1)
    assert apps[0].granted_mem_mib == pytest.approx(11_000) and apps[0].last_mem_change_s == 0.0
    apps = [a.__class__(**{**a.__dict__, "forecast_mem_p90_mib": 5_000}) for a in apps]
    p2 = plan(apps, [DEV], 5.0, CFG)  # within dwell
    assert not p2.target("a").changed_mem
    p3 = plan(apps, [DEV], 11.0, CFG)
    assert p3.target("a").mem_mib == pytest.approx(5_500)


def test_foreseen_overrun_grows_despite_threshold_and_dwell() -> None:
    # the forecast (before margin) exceeds the grant by 3 %: below the threshold, inside the dwell,
    # yet the grant grows now, since holding it would be a foreseen violation
    a = app("a", granted_mem_mib=10_000, forecast_mem_p90_mib=10_300, granted_sm_pct=20,
            forecast_sm_p90_pct=10, last_mem_change_s=99.0)
    t = plan([a], [DEV], 100.0, CFG).target("a")
    assert t.mem_mib == pytest.approx(11_330) and t.reason_mem == "overrun"


def test_forecast_policy_drives_the_allocator_on_the_simulator() -> None:
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.policy.base import Recommendation
    from vgpu.allocator.policy.forecast import ForecastPolicy
    from vgpu.device.sim import ManualClock, SimBackend

    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    dev = backend.devices()[0]
    alloc = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(PolicyConfig(confidence_multiplier=0)))
    # a requested guarantee of 10 GiB, then forecasts of 30 GiB: a forecast grant carries the rest
    alloc.ledger.grant("a", 10_240, 10, device_id=dev.uuid, source="request")
    rec = Recommendation("a", dev.uuid, 30_000, 30, mem_p90_peak_mib=30_000, sm_p90_peak_pct=30,
                         mem_used_mib=9_000, sm_util_pct=8)
    report = alloc.apply_recommendations([rec])
    grants = alloc.ledger.grants(app_id="a")
    assert sum(g.memory_mib for g in grants) == pytest.approx(33_000)
    assert {g.source for g in grants} == {"request", "forecast"}
    # planned SM 33 %: the power limit leaves the default, through the mechanism
    assert report.power and dev.power_limit_mw() < 700_000
    # the forecast falls under the guarantee: the forecast grant shrinks, the request stays
    clock.advance(60.0)
    low = Recommendation("a", dev.uuid, 2_000, 5, mem_p90_peak_mib=2_000, sm_p90_peak_pct=5,
                         mem_used_mib=2_000, sm_util_pct=5)
    alloc.apply_recommendations([low])
    req = [g for g in alloc.ledger.grants(app_id="a") if g.source == "request"]
    assert req[0].memory_mib == 10_240
    assert sum(g.memory_mib for g in alloc.ledger.grants(app_id="a")) == pytest.approx(10_240)
    alloc.stop()
    assert dev.power_limit_mw() == 700_000


def test_sm_changes_do_not_restart_the_memory_dwell() -> None:
    """Under contention SM shares move at every arrival; the memory grant must still shrink once its own
    dwell has passed (the allocator's ledger keeps a memory change time apart from any change)."""
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.policy.base import Recommendation
    from vgpu.allocator.policy.forecast import ForecastPolicy
    from vgpu.device.sim import ManualClock, SimBackend

    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    uuid = backend.devices()[0].uuid
    alloc = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(PolicyConfig(confidence_multiplier=0)))

    def rec(mem: float, sm: float) -> Recommendation:
        return Recommendation("a", uuid, mem, sm, mem_p90_peak_mib=mem, sm_p90_peak_pct=sm, mem_used_mib=mem, sm_util_pct=sm)

    alloc.apply_recommendations([rec(20_000, 30)])
    (g,) = alloc.ledger.grants()
    assert g.memory_mib == pytest.approx(22_000) and g.mem_changed_at_s == 1000.0
    sm_changes = []
    for t in range(1, 12):  # the SM need keeps growing (overruns resize at once), the memory need has halved
        clock.advance(1.0)
        alloc.apply_recommendations([rec(10_000, 30 + 3 * t)])
        (g,) = alloc.ledger.grants()
        if g.updated_at_s == clock():
            sm_changes.append(clock())
        assert g.memory_mib == pytest.approx(22_000 if clock() < 1010 else 11_000)  # dwell 10 s from 1000
    assert len(sm_changes) >= 4 and min(sm_changes) < 1005
    assert g.mem_changed_at_s == 1010.0


def test_a_device_is_planned_with_every_application_when_recommendations_arrive_one_by_one() -> None:
    """The manager hands over recommendations per application as each becomes due. The power limit and
    SM shares of a device must still weigh all of its applications: one busy application's lone
    recommendation must not plan the GPU as if it ran alone (which flapped the demo's power limit)."""
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.policy.base import Recommendation
    from vgpu.allocator.policy.forecast import ForecastPolicy
    from vgpu.device.sim import ManualClock, SimBackend

    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    dev = backend.devices()[0]
    alloc = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(PolicyConfig(confidence_multiplier=0)))

    def rec(app: str, sm: float) -> Recommendation:
        return Recommendation(app, dev.uuid, 4_000, sm, mem_p90_peak_mib=4_000, sm_p90_peak_pct=sm,
                              mem_used_mib=4_000, sm_util_pct=sm)

    alloc.apply_recommendations([rec("busy", 60)])
    limit_busy_alone = dev.power_limit_mw()
    clock.advance(1.0)
    alloc.apply_recommendations([rec("idle", 1)])  # alone, this would plan 1 % SM: the lowest limit
    assert dev.power_limit_mw() == limit_busy_alone
    for _ in range(5):  # 60 % + 60 % asked: the shares are cut in proportion, never one app planned alone
        clock.advance(1.0)
        alloc.apply_recommendations([rec("idle", 60)])
        clock.advance(1.0)
        alloc.apply_recommendations([rec("busy", 60)])
    shares = {g.app_id: g.sm_pct for g in alloc.ledger.grants()}
    assert sum(shares.values()) <= 100.0 + 1e-6
    assert shares["busy"] == pytest.approx(shares["idle"], rel=0.2)
    alloc.stop()
