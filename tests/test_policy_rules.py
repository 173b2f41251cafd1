"""The policy's rules against overruns and churn: overrun bumps, slower shrinking, the SM points
threshold, contention that cuts from claims, and a contended split kept while it is close enough."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_policy import DEV, app

from vgpu.allocator.policy.forecast import (
    PREDICTIVE_CONFIG,
    DeviceState,
    ForecastPolicy,
    PolicyConfig,
    Resource,
    advance,
    plan,
)

# plain arithmetic: no confidence widening, 10 % margins, 5 % threshold, 10 s dwell, no new rule
BASE = PolicyConfig(confidence_multiplier=0.0, min_change_frac=0.05, dwell_s=10.0)
BUMP = replace(BASE, mem_bump_frac=0.2, mem_bump_min_mib=1024.0)


# ------------------------------------------------------------------------------------------------
# overrun bumps
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("used", [10_000.0, 10_500.0])  # at the grant (a hard limit stops it there) or over
def test_memory_that_reached_its_grant_is_bumped_past_the_margin(used: float) -> None:
    a = app("a", granted_mem_mib=10_000, used_mem_mib=used, forecast_mem_p90_mib=used,
            granted_sm_pct=20, forecast_sm_p90_pct=10, last_mem_change_s=99.0)  # inside the dwell
    t = plan([a], [DEV], 100.0, BUMP).target("a")
    assert t.mem_mib == pytest.approx(max(used * 1.2, used + 1024)) and t.reason_mem == "bump"
    # without the rule: usage plus the margin only, one step behind a ramp; and an application
    # held at its grant (a hard limit) is no overrun, so it waits out the dwell
    plain = plan([a], [DEV], 100.0, BASE).target("a")
    assert plain.mem_mib == pytest.approx(used * 1.1 if used > 10_000 else 10_000)


def test_memory_under_its_grant_is_not_bumped() -> None:
    a = app("a", granted_mem_mib=10_000, used_mem_mib=9_990, forecast_mem_p90_mib=9_990,
            granted_sm_pct=20, forecast_sm_p90_pct=10)
    t = plan([a], [DEV], 100.0, BUMP).target("a")
    assert t.reason_mem != "bump" and t.mem_mib == pytest.approx(9_990 * 1.1)


def test_the_bump_minimum_counts_for_small_applications_and_is_capped_by_the_device() -> None:
    small = app("s", granted_mem_mib=1_000, used_mem_mib=1_000, granted_sm_pct=20)
    assert plan([small], [DEV], 100.0, BUMP).target("s").mem_mib == pytest.approx(2_024)
    full = app("f", granted_mem_mib=79_000, used_mem_mib=79_500, granted_sm_pct=20)
    assert plan([full], [DEV], 100.0, BUMP).target("f").mem_mib == pytest.approx(80_000)


def test_a_memory_ramp_overruns_once_not_every_second() -> None:
    """Memory that climbs 300 MiB a second for 8 s (a model loading, a step growing its workspace)
    with a forecast that only sees the past: without the bump each second of the ramp is over the
    grant, with it only the first."""

    def overruns(config: PolicyConfig) -> int:
        ramp = [4_000.0 + 300.0 * min(k, 8) for k in range(12)]
        apps = [app("a", granted_mem_mib=4_400, granted_sm_pct=20, used_mem_mib=4_000, forecast_mem_p90_mib=4_000)]
        count = 0
        for k in range(1, len(ramp)):
            apps = advance(apps, plan(apps, [DEV], float(k), config))  # the grant for second k
            count += ramp[k] > apps[0].granted_mem_mib
            apps = [replace(apps[0], used_mem_mib=ramp[k], forecast_mem_p90_mib=ramp[k])]
        return count

    no_bump = replace(BASE, mem_margin_frac=0.02)
    assert overruns(no_bump) >= 6
    assert overruns(replace(BUMP, mem_margin_frac=0.02)) <= 2


def test_sm_over_its_grant_is_bumped_by_points() -> None:
    cfg = replace(BASE, sm_bump_pct=10.0)
    a = app("a", granted_mem_mib=10_000, used_mem_mib=5_000, forecast_mem_p90_mib=5_000,
            granted_sm_pct=40, used_sm_pct=45, forecast_sm_p90_pct=42, last_sm_change_s=99.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.sm_pct == pytest.approx(55) and t.reason_sm == "bump"
    assert plan([a], [DEV], 100.0, BASE).target("a").sm_pct == pytest.approx(49.5)
    # at the grant is not over a share: no bump
    b = replace(a, used_sm_pct=40.0, forecast_sm_p90_pct=30.0)
    assert plan([b], [DEV], 100.0, cfg).target("a").reason_sm != "bump"


# ------------------------------------------------------------------------------------------------
# slower to shrink; the SM points threshold
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("res", ["mem", "sm"])
def test_a_shrink_waits_the_shrink_dwell_a_grow_does_not(res: Resource) -> None:
    cfg = replace(BASE, mem_shrink_dwell_s=60.0) if res == "mem" else replace(BASE, sm_shrink_dwell_s=60.0)
    grant = {"mem": 20_000.0, "sm": 50.0}[res]
    changed = {"mem": {"last_mem_change_s": 100.0}, "sm": {"last_sm_change_s": 100.0}}[res]
    low = app("a", granted_mem_mib=20_000, granted_sm_pct=50, forecast_mem_p90_mib=10_000,
              forecast_sm_p90_pct=20, **changed)
    for now, held in ((130.0, True), (159.0, True), (160.0, False)):
        t = plan([low], [DEV], now, cfg).target("a")
        value, reason = (t.mem_mib, t.reason_mem) if res == "mem" else (t.sm_pct, t.reason_sm)
        assert (value == grant and reason == "dwell") is held
        # without the rule the ordinary 10 s dwell is over at 110
        plain = plan([low], [DEV], now, BASE).target("a")
        assert (plain.mem_mib if res == "mem" else plain.sm_pct) < grant
    # a grow (not an overrun: the forecast is at the grant, the margin above it) waits the
    # ordinary dwell alone
    high = replace(low, forecast_mem_p90_mib=grant if res == "mem" else 10_000,
                   forecast_sm_p90_pct=grant if res == "sm" else 20)
    t = plan([high], [DEV], 105.0, cfg).target("a")
    assert (t.mem_mib if res == "mem" else t.sm_pct) == grant
    t = plan([high], [DEV], 111.0, cfg).target("a")
    assert (t.mem_mib if res == "mem" else t.sm_pct) == pytest.approx(grant * 1.1)


def test_sm_points_threshold_and_overrun_tolerance() -> None:
    cfg = replace(BASE, sm_min_change_pct=5.0)
    # the forecast is half a point over the 40 % grant: within the tolerance it is no overrun, and
    # the 4.55-point step to 44.55 % is under the threshold
    a = app("a", granted_mem_mib=10_000, forecast_mem_p90_mib=10_000 / 1.1, granted_sm_pct=40,
            forecast_sm_p90_pct=40.5, last_sm_change_s=0.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.sm_pct == 40 and t.reason_sm == "below-threshold"
    assert plan([a], [DEV], 100.0, BASE).target("a").sm_pct == pytest.approx(44.55)  # an overrun without it
    # more than 5 points over the grant: an overrun, grown at once
    b = replace(a, forecast_sm_p90_pct=46.0, last_sm_change_s=99.0)
    tb = plan([b], [DEV], 100.0, cfg).target("a")
    assert tb.sm_pct == pytest.approx(50.6) and tb.reason_sm == "overrun"
    # the threshold is in points, whatever the grant: 8 % of 40 % is 3.2 points, not made
    c = replace(a, forecast_sm_p90_pct=(40 - 3.2) / 1.1)
    assert plan([c], [DEV], 100.0, cfg).target("a").sm_pct == 40
    assert plan([c], [DEV], 100.0, BASE).target("a").sm_pct == pytest.approx(36.8)


# ------------------------------------------------------------------------------------------------
# contention
# ------------------------------------------------------------------------------------------------
SM_DEV = DeviceState("gpu0", mem_total_mib=80_000, sm_total_pct=100.0)


def test_contention_takes_back_bumps_before_anyone_s_claim() -> None:
    cfg = replace(BASE, sm_bump_pct=20.0)
    # a: over its 40 % grant at 45 % -> bumped to 65 (claim 49.5); b: claims 44; 65 + 44 > 100
    a = app("a", granted_sm_pct=40, used_sm_pct=45, forecast_sm_p90_pct=45, granted_mem_mib=1_000)
    b = app("b", granted_sm_pct=44, used_sm_pct=40, forecast_sm_p90_pct=40, granted_mem_mib=1_000)
    p = plan([a, b], [SM_DEV], 100.0, cfg)
    assert p.target("b").sm_pct == pytest.approx(44)  # its claim, untouched
    assert p.target("a").sm_pct == pytest.approx(56)  # the bump gave back the 9-point excess
    assert p.devices[0].sm_planned_pct == pytest.approx(100)


def test_contention_takes_back_a_held_shrink_then_cuts_claims_not_held_grants() -> None:
    """a holds 60 % inside its dwell although it now claims less; b, cut to 40 % a second ago, is
    over its grant."""
    cfg = replace(BASE, min_sm_pct=0.0)
    held = {"granted_sm_pct": 60, "last_sm_change_s": 99.0, "granted_mem_mib": 1_000}
    cut = {"granted_sm_pct": 40, "last_sm_change_s": 99.0, "granted_mem_mib": 1_000}
    # a claims 44 %, b 49.5 %: a's held 16 points cover the 9.5-point excess, b keeps its claim
    p = plan([app("a", used_sm_pct=40, forecast_sm_p90_pct=40, **held),
              app("b", used_sm_pct=45, forecast_sm_p90_pct=45, **cut)], [SM_DEV], 100.0, cfg)
    assert p.target("a").sm_pct == pytest.approx(50.5) and p.target("b").sm_pct == pytest.approx(49.5)
    # a claims 55 %, b 59.4 %: the claims themselves are over, so both are cut in proportion to
    # their claims; cut from the held grants a would keep the larger share (50.25 / 49.75) and
    # the two would trade places at the next change
    p = plan([app("a", used_sm_pct=50, forecast_sm_p90_pct=50, **held),
              app("b", used_sm_pct=54, forecast_sm_p90_pct=54, **cut)], [SM_DEV], 100.0, cfg)
    ta, tb = p.target("a").sm_pct, p.target("b").sm_pct
    assert ta + tb == pytest.approx(100)
    assert ta / tb == pytest.approx(55 / 59.4)


def test_neighbours_on_a_full_gpu_do_not_trade_shares_every_second() -> None:
    """Two applications that together use the whole GPU, with the daemon's settings and a few
    points of noise: the split settles and stays. Cut from bumped or held grants, the two traded
    4-6 points back and forth almost every second (80 changes in these 50 s; MIGPerf replay)."""
    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)
    b_used = [52, 55, 53, 56, 54, 52, 55]
    apps = [
        app("a", used_sm_pct=44, forecast_sm_p90_pct=45, used_mem_mib=1_000, forecast_mem_p90_mib=1_000),
        app("b", used_sm_pct=54, forecast_sm_p90_pct=55, used_mem_mib=1_000, forecast_mem_p90_mib=1_000),
    ]
    changes = 0
    for k in range(60):
        result = plan(apps, [SM_DEV], float(k), cfg)
        if k >= 10:
            changes += sum(t.changed_sm for t in result.targets)
        apps = advance(apps, result)
        assert sum(a.granted_sm_pct for a in apps) <= 100 + 1e-9
        used = b_used[k % len(b_used)]
        apps = [replace(apps[0], used_sm_pct=44 + (k % 3 == 0), forecast_sm_p90_pct=45 + (k % 4 == 0)),
                replace(apps[1], used_sm_pct=used, forecast_sm_p90_pct=used + 1)]
    assert changes <= 4


def test_a_contended_split_close_to_the_one_in_force_is_kept() -> None:
    # grants 45 / 55 in force; the claims move a little (49.5 / 57.2, cut to 46.4 / 53.6): kept
    a = app("a", granted_sm_pct=45, used_sm_pct=44, forecast_sm_p90_pct=45, granted_mem_mib=1_000)
    b = app("b", granted_sm_pct=55, used_sm_pct=50, forecast_sm_p90_pct=52, granted_mem_mib=1_000)
    cfg = replace(BASE, min_sm_pct=0.0)
    p = plan([a, b], [SM_DEV], 100.0, cfg)
    assert (p.target("a").sm_pct, p.target("b").sm_pct) == (45, 55)
    assert p.target("a").reason_sm == "contention-held" and not p.changes()
    # without a threshold the split follows every sliver
    moved = plan([a, b], [SM_DEV], 100.0, replace(cfg, min_change_frac=0.0))
    assert moved.target("a").sm_pct == pytest.approx(49.5 / (49.5 + 57.2) * 100)
    # a larger move is made
    c = replace(b, forecast_sm_p90_pct=80.0)
    far = plan([a, c], [SM_DEV], 100.0, cfg)
    assert far.target("a").sm_pct == pytest.approx(49.5 / (49.5 + 88) * 100)


# ------------------------------------------------------------------------------------------------
# the daemon plans with the measured settings
# ------------------------------------------------------------------------------------------------
def test_forecast_policy_plans_with_the_replayed_settings() -> None:
    assert ForecastPolicy().config is PREDICTIVE_CONFIG
    assert PREDICTIVE_CONFIG.mem_bump_min_mib > 0 and PREDICTIVE_CONFIG.sm_shrink_dwell_s > PREDICTIVE_CONFIG.dwell_s


def test_the_daemon_s_policy_bumps_an_application_at_its_memory_grant() -> None:
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.policy.base import Recommendation
    from vgpu.device.sim import ManualClock, SimBackend

    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    uuid = backend.devices()[0].uuid
    alloc = Allocator(backend, clock=clock, dry_run=False,
                      policy=ForecastPolicy(replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0,
                                                    start_window_s=0.0)))

    def rec(used: float) -> Recommendation:
        return Recommendation("a", uuid, used, 20, mem_p90_peak_mib=used, sm_p90_peak_pct=20,
                              mem_used_mib=used, sm_util_pct=20)

    alloc.apply_recommendations([rec(8_000)])
    (g,) = alloc.ledger.grants()
    assert g.memory_mib == pytest.approx(8_160)  # P90 + 2 %
    clock.advance(1.0)
    alloc.apply_recommendations([rec(8_160)])  # the usage reached the grant
    (g,) = alloc.ledger.grants()
    assert g.memory_mib == pytest.approx(8_160 * 1.2)
    alloc.stop()


@pytest.mark.parametrize("name", ["mem_bump_frac", "mem_bump_min_mib", "sm_bump_pct", "mem_shrink_dwell_s",
                                  "sm_shrink_dwell_s", "sm_min_change_pct"])
def test_new_settings_refuse_negative_values(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        PolicyConfig(**{name: -1.0})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["confidence_exponent", "sm_cap_cut_only"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_settings_unchecked_by_sign_still_refuse_a_non_number(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        PolicyConfig(**{name: value})  # type: ignore[arg-type]
    PolicyConfig(**{name: -0.5})  # type: ignore[arg-type]  # any finite value is a setting
