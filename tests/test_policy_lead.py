"""The policy's leading rules: headroom on a foreseen rise, a ramp granted to its end, slow shrinking
that needs the forecast and the recent history to agree, and hard memory limits only where a device
is contended. Each test shows the rule's effect and that it is absent without the rule."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_policy import DEV, app

from vgpu.allocator.policy.forecast import PREDICTIVE_CONFIG, DeviceState, PolicyConfig, plan

BASE = PolicyConfig(confidence_multiplier=0.0, mem_margin_frac=0.02, min_change_frac=0.05, dwell_s=10.0)


def test_a_foreseen_rise_is_granted_with_headroom_above_the_p90() -> None:
    a = app("a", granted_mem_mib=4_000, used_mem_mib=3_900, forecast_mem_p90_mib=5_000,
            last_mem_change_s=99.0)  # inside the dwell: growth is made anyway
    led = plan([a], [DEV], 100.0, replace(BASE, mem_lead_frac=0.2)).target("a")
    assert led.mem_mib == pytest.approx(5_000 * 1.22) and led.reason_mem == "lead"
    plain = plan([a], [DEV], 100.0, BASE).target("a")
    assert plain.mem_mib == pytest.approx(5_000 * 1.02)


def test_no_headroom_when_the_forecast_stays_under_the_grant() -> None:
    a = app("a", granted_mem_mib=6_000, used_mem_mib=3_900, forecast_mem_p90_mib=5_000, last_mem_change_s=99.0)
    assert plan([a], [DEV], 100.0, replace(BASE, mem_lead_frac=0.2)).target("a").reason_mem != "lead"


def test_a_ramp_is_granted_to_where_its_rate_says_it_ends() -> None:
    # 294 -> 956 MiB over the last 2 s: at 331 MiB/s for 5 s more, the ramp ends near 2,611 MiB
    a = app("a", granted_mem_mib=1_000, used_mem_mib=956, forecast_mem_p90_mib=1_100,
            mem_ramp_s=2.0, mem_ramp_rate_mib_s=331.0, last_mem_change_s=99.0)
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.mem_mib == pytest.approx((956 + 331 * 5) * 1.02) and t.reason_mem == "ramp"
    assert plan([a], [DEV], 100.0, BASE).target("a").mem_mib == pytest.approx(1_100 * 1.02)
    # too short a ramp for the rule
    short = replace(a, mem_ramp_s=0.0)
    assert plan([short], [DEV], 100.0, cfg).target("a").reason_mem != "ramp"


def test_an_accelerating_ramp_is_granted_where_its_last_slope_says_it_ends() -> None:
    # 4 -> 294 -> 956 -> 1,947 MiB: 648 MiB/s over the ramp, 991 MiB/s over its last second
    a = app("a", granted_mem_mib=2_000, used_mem_mib=1_947, forecast_mem_p90_mib=2_000,
            mem_ramp_s=3.0, mem_ramp_rate_mib_s=648.0, mem_ramp_last_mib_s=991.0, last_mem_change_s=99.0)
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0, ramp_last_rate=1.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.mem_mib == pytest.approx((1_947 + 991 * 5) * 1.02) and t.reason_mem == "ramp"
    # without the rule: the mean rate
    off = plan([a], [DEV], 100.0, replace(cfg, ramp_last_rate=0.0)).target("a")
    assert off.mem_mib == pytest.approx((1_947 + 648 * 5) * 1.02)
    # a ramp slowing down keeps its mean rate; a ramp whose last second is unknown too
    slowing = replace(a, mem_ramp_last_mib_s=100.0)
    assert plan([slowing], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx(off.mem_mib)
    assert plan([replace(a, mem_ramp_last_mib_s=math.nan)], [DEV], 100.0, cfg).target("a").mem_mib == \
        pytest.approx(off.mem_mib)


def test_a_ramp_s_extrapolated_end_can_be_capped_at_a_multiple_of_its_usage() -> None:
    # one step of 3,000 MiB after a slow start: 5 s at that slope says 19,000 MiB for a 4,000 MiB job
    a = app("a", granted_mem_mib=4_000, used_mem_mib=4_000, forecast_mem_p90_mib=4_000,
            mem_ramp_s=2.0, mem_ramp_rate_mib_s=1_500.0, mem_ramp_last_mib_s=3_000.0, last_mem_change_s=99.0)
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0, ramp_last_rate=1.0, ramp_cap_frac=2.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.mem_mib == pytest.approx(4_000 * 3 * 1.02) and t.reason_mem == "ramp"
    uncapped = plan([a], [DEV], 100.0, replace(cfg, ramp_cap_frac=0.0)).target("a")
    assert uncapped.mem_mib == pytest.approx((4_000 + 3_000 * 5) * 1.02)
    # the forecast's P90 is not capped: where it says more, it is granted
    high = replace(a, forecast_mem_p90_mib=15_000.0)
    assert plan([high], [DEV], 100.0, cfg).target("a").mem_mib >= 15_000 * 1.02


def test_a_ramp_at_any_age_can_be_granted_a_multiple_of_its_usage() -> None:
    # 10 minutes in, ramping for 2 s at 100 MiB/s: the rate says 2,000 + 500
    a = app("a", granted_mem_mib=2_000, used_mem_mib=2_000, forecast_mem_p90_mib=2_000, history_s=600.0,
            mem_ramp_s=2.0, mem_ramp_rate_mib_s=100.0, last_mem_change_s=99.0)
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0, ramp_frac=1.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.mem_mib == pytest.approx(2_000 * 2 * 1.02) and t.reason_mem == "ramp"
    off = plan([a], [DEV], 100.0, replace(cfg, ramp_frac=0.0)).target("a")
    assert off.mem_mib == pytest.approx((2_000 + 500) * 1.02)
    # a ramp shorter than `ramp_frac_min_s` gets its rate only
    assert plan([replace(a, mem_ramp_s=1.0)], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx(off.mem_mib)


def test_a_ramp_is_granted_to_the_cold_start_size() -> None:
    a = app("a", granted_mem_mib=1_000, used_mem_mib=956, forecast_mem_p90_mib=1_100,
            mem_ramp_s=2.0, mem_ramp_rate_mib_s=10.0, expected_mem_mib=9_000, last_mem_change_s=99.0)
    t = plan([a], [DEV], 100.0, replace(BASE, ramp_min_s=1.0)).target("a")
    assert t.mem_mib == pytest.approx(9_000 * 1.02) and t.reason_mem == "ramp"


def test_a_shrink_takes_a_bounded_step() -> None:
    a = app("a", granted_mem_mib=10_000, used_mem_mib=2_000, forecast_mem_p90_mib=2_000, last_mem_change_s=0.0)
    slow = plan([a], [DEV], 100.0, replace(BASE, mem_shrink_step_frac=0.25)).target("a")
    assert slow.mem_mib == pytest.approx(7_500)
    assert plan([a], [DEV], 100.0, BASE).target("a").mem_mib == pytest.approx(2_040)


def test_a_grant_far_over_the_recent_peak_shrinks_to_a_multiple_of_it_at_once() -> None:
    # a ramp extrapolated to 20 GB ended at 8 GB: the forecast and the last 30 s agree it is far under
    a = app("a", granted_mem_mib=20_000, used_mem_mib=8_000, forecast_mem_p90_mib=8_000,
            recent_peak_mem_mib=8_000, last_mem_change_s=0.0)
    cfg = replace(BASE, mem_shrink_step_frac=0.25, mem_shrink_window_s=30.0, mem_shrink_peak_mult=1.5)
    assert plan([a], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx(12_000)
    # without it: a quarter of the grant per change
    assert plan([a], [DEV], 100.0, replace(cfg, mem_shrink_peak_mult=0.0)).target("a").mem_mib == \
        pytest.approx(15_000)
    # a grant within the multiple keeps the bounded step; the recent-peak floor still holds
    near = replace(a, granted_mem_mib=11_000, forecast_mem_p90_mib=2_000)
    assert plan([near], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx(8_250)
    # the dwell still holds it
    assert plan([replace(a, last_mem_change_s=95.0)], [DEV], 100.0, cfg).target("a").mem_mib == 20_000


def test_a_shrink_waits_for_the_recent_history_to_agree() -> None:
    # the forecast says 2 GB, but the usage peaked at 8 GB within the window: keep room for it
    a = app("a", granted_mem_mib=10_000, used_mem_mib=2_000, forecast_mem_p90_mib=2_000,
            recent_peak_mem_mib=8_000, last_mem_change_s=0.0)
    t = plan([a], [DEV], 100.0, replace(BASE, mem_shrink_window_s=30.0)).target("a")
    assert t.mem_mib == pytest.approx(8_160)
    assert plan([a], [DEV], 100.0, BASE).target("a").mem_mib == pytest.approx(2_040)


def test_hard_limits_only_on_a_contended_device() -> None:
    cfg = replace(BASE, hard_limit_at_frac=0.9)
    roomy = plan([app("a", forecast_mem_p90_mib=10_000)], [DEV], 0.0, cfg)
    assert not roomy.target("a").hard_mem_limit and not roomy.devices[0].hard_mem_limits
    full = plan([app("a", forecast_mem_p90_mib=40_000), app("b", forecast_mem_p90_mib=35_000)], [DEV], 0.0, cfg)
    assert full.target("a").hard_mem_limit and full.devices[0].hard_mem_limits
    over = plan([app("a", forecast_mem_p90_mib=50_000), app("b", forecast_mem_p90_mib=50_000)], [DEV], 0.0,
                replace(BASE, hard_limit_at_frac=2.0))
    assert over.devices[0].contended_mem and over.target("b").hard_mem_limit
    # without the rule (0: today's behaviour) every limit is hard
    assert plan([app("a", forecast_mem_p90_mib=10_000)], [DEV], 0.0, BASE).target("a").hard_mem_limit


def test_sm_caps_only_on_a_contended_device() -> None:
    cfg = replace(BASE, hard_limit_at_frac=0.9)
    roomy = plan([app("a", forecast_sm_p90_pct=30)], [DEV], 0.0, cfg)
    assert not roomy.target("a").hard_sm_limit and not roomy.devices[0].hard_sm_limits
    full = plan([app("a", forecast_sm_p90_pct=60), app("b", forecast_sm_p90_pct=50)], [DEV], 0.0, cfg)
    assert full.target("a").hard_sm_limit and full.devices[0].contended_sm
    assert plan([app("a", forecast_sm_p90_pct=30)], [DEV], 0.0, BASE).target("a").hard_sm_limit


def test_the_lead_is_taken_back_first_on_a_full_device() -> None:
    # leads above the claims yield before any claim (forecast + margin) is cut
    small = DeviceState("gpu0", mem_total_mib=20_000)
    a = app("a", granted_mem_mib=8_000, used_mem_mib=8_000, forecast_mem_p90_mib=10_000)
    b = app("b", granted_mem_mib=8_000, used_mem_mib=8_000, forecast_mem_p90_mib=9_000)
    p = plan([a, b], [small], 100.0, replace(BASE, mem_lead_frac=0.5))
    ta, tb = p.target("a"), p.target("b")
    assert ta.mem_mib + tb.mem_mib == pytest.approx(20_000)
    assert ta.mem_mib > 10_000 * 1.02 and tb.mem_mib > 9_000 * 1.02
    assert ta.reason_mem == tb.reason_mem == "contention"


def test_predictive_settings_validate() -> None:
    assert PREDICTIVE_CONFIG.mem_shrink_step_frac <= 1.0
    with pytest.raises(ValueError):
        PolicyConfig(mem_shrink_step_frac=0.0)
    with pytest.raises(ValueError):
        PolicyConfig(ramp_min_s=-1.0)


def test_a_starting_application_gets_start_up_headroom() -> None:
    a = app("a", granted_mem_mib=1_300, used_mem_mib=1_200, forecast_mem_p90_mib=1_250, history_s=1.0,
            last_mem_change_s=99.0)
    cfg = replace(BASE, start_window_s=10.0, start_headroom_mib=1024.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.mem_mib == pytest.approx((1_200 + 1024) * 1.02) and t.reason_mem == "start"
    # the job's cold-start size instead, when known
    sized = plan([replace(a, expected_mem_mib=6_000)], [DEV], 100.0, cfg).target("a")
    assert sized.mem_mib == pytest.approx(6_000 * 1.02)
    # past the window, or without the rule: the forecast
    old = plan([replace(a, history_s=30.0)], [DEV], 100.0, cfg).target("a")
    assert old.reason_mem != "start"
    assert plan([a], [DEV], 100.0, BASE).target("a").mem_mib == pytest.approx(1_300)  # held (threshold)


def test_on_a_contended_gpu_only_the_shares_that_were_cut_are_capped() -> None:
    # a (priority 1) keeps its claim; b (priority 0) is cut to fit: only b must yield
    apps = [app("a", forecast_sm_p90_pct=60, priority=1), app("b", forecast_sm_p90_pct=60)]
    cut_only = plan(apps, [DEV], 0.0, replace(BASE, hard_limit_at_frac=0.9, sm_cap_cut_only=1.0))
    assert cut_only.devices[0].contended_sm
    assert not cut_only.target("a").hard_sm_limit and cut_only.target("b").hard_sm_limit
    assert cut_only.target("b").reason_sm == "contention"
    every = plan(apps, [DEV], 0.0, replace(BASE, hard_limit_at_frac=0.9))
    assert every.target("a").hard_sm_limit and every.target("b").hard_sm_limit


def test_usage_history_sees_a_ramp_and_the_recent_peak() -> None:
    from vgpu.allocator.policy.forecast import UsageHistory

    h = UsageHistory()
    for t, used in [(0.0, 1_000.0), (1.0, 1_000.0), (2.0, 1_300.0), (2.4, 1_350.0), (3.0, 1_700.0)]:
        h.observe("a", t, used)
    ramp_s, rate = h.ramp("a")
    assert ramp_s == pytest.approx(2.0) and rate == pytest.approx(350.0)  # 1,000 -> 1,700 over 2 s
    assert h.peak("a", 3.0, 1.5) == 1_700.0 and h.peak("a", 3.0, 30.0) == 1_700.0
    assert h.last_rise("a") == pytest.approx(350.0)  # 1,350 -> 1,700 in the last second kept
    h.observe("a", 4.0, 1_700.0, seq=7)
    flat_s, flat_rate = h.ramp("a")
    assert flat_s == 0.0 and math.isnan(flat_rate)  # flat: no ramp
    assert math.isnan(h.last_rise("a")) and math.isnan(h.last_rise("unknown"))
    h.observe("a", 5.0, 9_000.0, seq=7)  # a stale stand-in (seen seq): no new sample
    assert h.peak("a", 5.0, 30.0) == 1_700.0
    h.prune(500.0)
    assert math.isnan(h.peak("a", 500.0, 1e9))


def _daemon_grant_mib(config: PolicyConfig, seconds: list[tuple[float, float]]) -> float:
    """The memory granted to one application after the daemon's Allocator and ForecastPolicy (on a
    simulated H100) were given one recommendation a second: (forecast P90, usage) in MiB."""
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.policy.base import Recommendation
    from vgpu.allocator.policy.forecast import ForecastPolicy
    from vgpu.device.sim import ManualClock, SimBackend

    clock = ManualClock(1000.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    uuid = backend.devices()[0].uuid
    alloc = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(config))
    for seq, (p90, used) in enumerate(seconds, start=1):
        alloc.apply_recommendations([Recommendation("a", uuid, p90, 20, mem_p90_peak_mib=p90, sm_p90_peak_pct=20,
                                                    mem_used_mib=used, sm_util_pct=20, for_seq=seq)])
        clock.advance(1.0)
    (g,) = alloc.ledger.grants()
    alloc.stop()
    return g.memory_mib


def _daemon_grant_steps_mib(config: PolicyConfig, steps: list[tuple[float, float, float]],
                            first_use_ago_s: float = math.nan) -> float:
    """Like `_daemon_grant_mib`, with a recommendation per (seconds until the next one, forecast
    P90, usage in MiB), and the manager's first use of the GPU `first_use_ago_s` before the first
    recommendation (NaN: not said)."""
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.policy.base import Recommendation
    from vgpu.allocator.policy.forecast import ForecastPolicy
    from vgpu.device.sim import ManualClock, SimBackend

    clock = ManualClock(1000.0)
    first_use_s = clock() - first_use_ago_s
    backend = SimBackend(["h100-80gb"], clock=clock)
    uuid = backend.devices()[0].uuid
    alloc = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(config))
    for seq, (step_s, p90, used) in enumerate(steps, start=1):
        alloc.apply_recommendations([Recommendation("a", uuid, p90, 20, mem_p90_peak_mib=p90, sm_p90_peak_pct=20,
                                                    mem_used_mib=used, sm_util_pct=20, for_seq=seq,
                                                    first_use_s=first_use_s)])
        clock.advance(step_s)
    (g,) = alloc.ledger.grants()
    alloc.stop()
    return g.memory_mib


def test_the_daemons_policy_keeps_room_for_a_burst_inside_one_second() -> None:
    # 40 s at 20 GB; then, half a second into a second, a 10 GB burst: the daemon plans twice in that
    # second and keeps the larger usage for it, so the next second (still 30 GB) is no rise over it.
    # The replay judges the second's rise all the same; so must the daemon
    steps = ([(1.0, 20_000.0, 20_000.0)] * 40 + [(0.5, 20_000.0, 20_000.0), (0.5, 30_000.0, 30_000.0)]
             + [(1.0, 30_000.0, 30_000.0)] * 20 + [(1.0, 20_000.0, 20_000.0)] * 60)
    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)
    assert _daemon_grant_steps_mib(cfg, steps) == pytest.approx(30_000 * 1.02)
    assert _daemon_grant_steps_mib(replace(cfg, mem_burst_window_s=0.0), steps) == pytest.approx(20_000 * 1.02)


def test_the_daemons_policy_counts_a_burst_s_age_from_the_managers_first_use() -> None:
    # the policy first sees the application 100 s after the manager saw its first use (a daemon that
    # restarted, or a recommendation that came late); its cache bursts 10 s later: 110 s into its
    # run, past the 30 s start-up windows, as the replay (and the start-up window) count it
    used = [20_000.0] * 10 + [30_000.0] * 20 + [20_000.0] * 60
    steps = [(1.0, u, u) for u in used]
    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)
    assert _daemon_grant_steps_mib(cfg, steps, first_use_ago_s=100.0) == pytest.approx(30_000 * 1.02)
    # not said: from the first use the policy saw itself, 10 s before: the start-up's business
    assert _daemon_grant_steps_mib(cfg, steps) == pytest.approx(20_000 * 1.02)
    # said, but not used yet (inf): no burst either (the start-up's headroom over the usage instead)
    assert _daemon_grant_steps_mib(cfg, steps, first_use_ago_s=-math.inf) == pytest.approx((20_000 + 1024) * 1.02)


def test_the_daemons_policy_grants_a_ramp_it_saw_through_recommendations() -> None:
    def run(config: PolicyConfig) -> float:
        # the forecast trails the ramp (it says the last value)
        return _daemon_grant_mib(config, [(used, used) for used in [4_000.0] * 15 + [4_400.0, 4_900.0]])

    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0, start_ramp_frac=0.0)
    # 4,000 -> 4,400 -> 4,900: 450 MiB/s over the last 2 s, 500 over the last one; granted to 4,900
    # + 5 s of its latest slope, plus the margin
    assert cfg.ramp_ahead_s == 5.0 and cfg.ramp_last_rate == 1.0
    assert run(cfg) == pytest.approx((4_900 + 5 * 500) * 1.02)
    assert run(replace(cfg, ramp_last_rate=0.0)) == pytest.approx((4_900 + 5 * 450) * 1.02)
    assert run(replace(cfg, ramp_min_s=0.0)) < 4_900 + 3 * 450
    # the same ramp 16 s after the application's start, with the start-up ramp rule: x3 of its usage
    assert run(replace(cfg, start_ramp_frac=2.0)) == pytest.approx(4_900 * 3 * 1.02)


def test_the_daemons_policy_takes_back_a_grant_far_over_the_recent_peak() -> None:
    def run(config: PolicyConfig) -> float:
        # 4,000 MiB in use throughout; the forecast says 20,000 for 3 s, then 4,000
        return _daemon_grant_mib(config, [(p90, 4_000.0) for p90 in [20_000.0] * 3 + [4_000.0] * 12])

    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0, start_window_s=0.0, start_ramp_frac=0.0,
                  mem_shrink_peak_mult=1.5)
    assert run(cfg) == pytest.approx(4_000 * 1.5)
    assert run(replace(cfg, mem_shrink_peak_mult=0.0)) == pytest.approx(20_000 * 1.02 * 0.75)


def test_lead_summary_medians_over_all_and_visible_rises() -> None:
    from vgpu.allocator.policy import lead

    s = lead.summarize([(3, 0), (-1, 2), (2, 5), (0, 1)])
    assert (s.rises, s.median, s.rises_visible, s.median_visible, s.ahead_frac_visible) == (4, 1.0, 2, 0.5, 0.5)
    empty = lead.summarize([])
    assert empty.rises == 0 and empty.median is None and empty.median_visible is None
    with pytest.raises(ValueError):
        lead.lead_times([1.0, 2.0], [1.0])


def test_a_ramp_in_the_start_up_is_granted_a_multiple_of_its_usage() -> None:
    # 25 s in, ramping for 3 s at 100 MiB/s: the rate says 2,000 + 300; a start-up jumps by multiples
    a = app("a", granted_mem_mib=2_000, used_mem_mib=2_000, forecast_mem_p90_mib=2_000, history_s=25.0,
            mem_ramp_s=3.0, mem_ramp_rate_mib_s=100.0, last_mem_change_s=99.0)
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=3.0, start_window_s=10.0, start_headroom_mib=1024.0,
                  start_ramp_frac=2.0, start_ramp_window_s=30.0)
    t = plan([a], [DEV], 100.0, cfg).target("a")
    assert t.mem_mib == pytest.approx(2_000 * 3 * 1.02) and t.reason_mem == "start"
    # without the rule: the ramp's rate
    off = plan([a], [DEV], 100.0, replace(cfg, start_ramp_frac=0.0)).target("a")
    assert off.mem_mib == pytest.approx((2_000 + 300) * 1.02) and off.reason_mem == "ramp"
    # not ramping (flat after its start), or past its window: nothing more than before
    assert plan([replace(a, mem_ramp_s=0.0)], [DEV], 100.0, cfg).target("a").reason_mem != "start"
    assert plan([replace(a, history_s=40.0)], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx(off.mem_mib)


def test_the_start_up_window_can_count_from_the_first_real_use() -> None:
    # idle for 40 s (a launcher, data loading), then 2 s into its first use of the GPU
    a = app("a", granted_mem_mib=1_300, used_mem_mib=1_200, forecast_mem_p90_mib=1_250, history_s=42.0,
            active_s=2.0, last_mem_change_s=99.0)
    cfg = replace(BASE, start_window_s=10.0, start_headroom_mib=1024.0)
    assert plan([a], [DEV], 100.0, cfg).target("a").reason_mem != "start"  # the window went by, idle
    used = plan([a], [DEV], 100.0, replace(cfg, start_from_use=1.0)).target("a")
    assert used.mem_mib == pytest.approx((1_200 + 1024) * 1.02) and used.reason_mem == "start"
    # not begun yet: still starting; long past the first use: not
    idle = replace(a, used_mem_mib=1.0, forecast_mem_p90_mib=1.0, granted_mem_mib=256.0, active_s=math.nan)
    assert plan([idle], [DEV], 100.0, replace(cfg, start_from_use=1.0)).target("a").reason_mem == "start"
    late = replace(a, active_s=12.0)
    assert plan([late], [DEV], 100.0, replace(cfg, start_from_use=1.0)).target("a").reason_mem != "start"


def test_usage_history_dates_the_first_real_use() -> None:
    from vgpu.allocator.policy.base import IDLE_MEM_MIB
    from vgpu.allocator.policy.forecast import UsageHistory

    h = UsageHistory()
    h.observe("a", 0.0, 1.0)
    h.observe("a", 5.0, IDLE_MEM_MIB)
    assert math.isnan(h.active_s("a", 5.0))
    h.observe("a", 7.0, 900.0)
    h.observe("a", 9.0, 2_000.0)
    assert h.active_s("a", 10.0) == pytest.approx(3.0)
    h.prune(500.0)
    assert math.isnan(h.active_s("a", 500.0))


def test_the_daemons_policy_keeps_a_contended_gpu_at_full_power() -> None:
    from vgpu.allocator.policy.base import DeviceView, Recommendation
    from vgpu.allocator.policy.forecast import ForecastPolicy
    from vgpu.device.base import PowerConstraints

    c = PowerConstraints(min_mw=200_000, max_mw=700_000, default_mw=700_000)
    view = DeviceView("gpu0", "NVIDIA H100 80GB HBM3", 81_559.0, 100.0, (), power_limit_mw=700_000,
                      power_constraints=c)
    recs = [Recommendation(n, "gpu0", 1_000.0, 70.0, mem_p90_peak_mib=1_000.0, sm_p90_peak_pct=70.0,
                           mem_used_mib=1_000.0, sm_util_pct=70.0) for n in ("a", "b")]

    def limit(cfg: PolicyConfig) -> float:
        plan_ = ForecastPolicy(cfg).plan(recs, [view], 100.0)
        return plan_.power[0].limit_mw if plan_.power else 700_000.0

    assert limit(replace(PREDICTIVE_CONFIG, contended_full_power=1.0)) == 700_000
    assert limit(replace(PREDICTIVE_CONFIG, contended_full_power=0.0)) < 700_000

    # one application forecast at the whole GPU, nothing cut: full power only with full_power_at_frac
    recs = [Recommendation("a", "gpu0", 1_000.0, 98.0, mem_p90_peak_mib=1_000.0, sm_p90_peak_pct=98.0,
                           mem_used_mib=1_000.0, sm_util_pct=98.0)]
    assert limit(replace(PREDICTIVE_CONFIG, full_power_at_frac=1.0)) == 700_000
    assert limit(replace(PREDICTIVE_CONFIG, full_power_at_frac=0.0)) < 700_000


def test_a_forecast_that_has_covered_the_usage_is_trusted_without_the_margin() -> None:
    # a serving engine: 69 GB in use, most of it weights; its P90 has covered the usage for 60 s
    cfg = replace(BASE, mem_trust_s=30.0, mem_trust_margin_frac=0.01, mem_lead_frac=0.1)
    a = app("a", granted_mem_mib=76_000, used_mem_mib=69_000, forecast_mem_p90_mib=70_000,
            last_mem_change_s=50.0, mem_p90_covered_s=60.0)
    trusted = plan([a], [DEV], 100.0, cfg).target("a")
    assert trusted.mem_mib == pytest.approx(70_000 * 1.01)
    # without the rule, or not covered long enough: the margin on all of it
    for off in (replace(cfg, mem_trust_s=0.0), cfg):
        b = a if off is not cfg else replace(a, mem_p90_covered_s=10.0)
        assert plan([b], [DEV], 100.0, off).target("a").mem_mib == pytest.approx(70_000 * 1.02)


def test_a_trusted_forecast_that_rises_past_the_grant_gets_no_lead_headroom() -> None:
    cfg = replace(BASE, mem_trust_s=30.0, mem_trust_margin_frac=0.01, mem_lead_frac=0.1)
    a = app("a", granted_mem_mib=70_500, used_mem_mib=70_000, forecast_mem_p90_mib=71_000,
            last_mem_change_s=99.0, mem_p90_covered_s=60.0)
    grown = plan([a], [DEV], 100.0, cfg).target("a")
    assert grown.mem_mib == pytest.approx(71_000 * 1.01) and grown.reason_mem == "overrun"
    # the first miss ends the trust: the headroom of a foreseen rise is back, on the whole P90
    led = plan([replace(a, mem_p90_covered_s=0.0)], [DEV], 100.0, cfg).target("a")
    assert led.mem_mib == pytest.approx(71_000 * 1.12) and led.reason_mem == "lead"


def test_a_trusted_forecast_keeps_the_full_margin_over_the_usage_and_the_recent_peak() -> None:
    # trust drops the margin stacked on the P90, not the margin over what is in use: a P90 at the
    # usage (memory that barely moves) is granted the usage plus the whole margin, as before
    cfg = replace(BASE, mem_trust_s=30.0, mem_trust_margin_frac=0.0, mem_shrink_window_s=30.0)
    a = app("a", granted_mem_mib=80_000, used_mem_mib=69_800, forecast_mem_p90_mib=70_000,
            last_mem_change_s=50.0, mem_p90_covered_s=60.0)
    assert plan([a], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx(69_800 * 1.02)
    peaked = replace(a, recent_peak_mem_mib=70_500.0)
    assert plan([peaked], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx(70_500 * 1.02)


def test_a_trusted_forecast_can_be_followed_down_in_smaller_steps() -> None:
    # 3 % under the grant: under the 5 % threshold, unless the forecast is trusted and the rule is on
    cfg = replace(BASE, mem_trust_s=30.0, mem_trust_margin_frac=0.0, mem_trust_change_frac=0.02)
    a = app("a", granted_mem_mib=72_100, used_mem_mib=69_000, forecast_mem_p90_mib=70_000,
            last_mem_change_s=50.0, mem_p90_covered_s=60.0)
    followed = plan([a], [DEV], 100.0, cfg).target("a")
    assert followed.mem_mib == pytest.approx(70_380) and followed.changed_mem  # the usage + 2 %, over the P90
    assert plan([a], [DEV], 100.0, replace(cfg, mem_trust_change_frac=0.0)).target("a").mem_mib == 72_100
    untrusted = replace(a, mem_p90_covered_s=5.0)
    assert plan([untrusted], [DEV], 100.0, cfg).target("a").reason_mem == "below-threshold"


def test_usage_history_counts_the_seconds_the_forecast_covered_a_moving_usage() -> None:
    from vgpu.allocator.policy.forecast import UsageHistory

    h = UsageHistory()
    h.observe("a", 0.0, 1_000.0, forecast_mib=1_100.0)
    assert h.covered_s("a") == 0.0  # nothing to judge the first sample by
    for t, used in [(1.0, 1_050.0), (2.0, 1_040.0), (3.0, 1_060.0)]:
        h.observe("a", t, used, forecast_mib=1_100.0)
    assert h.covered_s("a") == 3.0
    h.observe("a", 4.0, 1_060.0, forecast_mib=1_100.0)  # unchanged: a flat second tests nothing
    assert h.covered_s("a") == 3.0
    h.observe("a", 4.5, 1_080.0, forecast_mib=1_200.0)  # within the second: still under 1,100
    assert h.covered_s("a") == 3.0
    h.observe("a", 4.7, 1_150.0, forecast_mib=1_200.0)  # the second's larger value passed 1,100
    assert h.covered_s("a") == 0.0
    h.observe("a", 5.0, 1_190.0, forecast_mib=1_200.0)
    assert h.covered_s("a") == 1.0
    h.observe("a", 6.0, 1_250.0)  # over the P90 given with the sample before: a miss
    assert h.covered_s("a") == 0.0
    h.observe("a", 7.0, 1_000.0)  # no forecast came with the sample before: nothing to judge by
    assert h.covered_s("a") == 0.0 and h.covered_s("unknown") == 0.0


def test_the_daemons_policy_trusts_a_forecast_it_saw_cover_the_usage() -> None:
    def run(config: PolicyConfig, last: tuple[float, float], moving: bool = True) -> float:
        # 40 s with a P90 of 70,000 over 68,800-69,000 in use, then the P90 rises to 72,000
        used = [69_000.0 - (200.0 if moving and i % 2 else 0.0) for i in range(40)]
        return _daemon_grant_mib(config, [(70_000.0, u) for u in used] + [last])

    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0, mem_trust_s=30.0, mem_trust_margin_frac=0.01)
    assert cfg.mem_lead_frac == pytest.approx(0.1)
    assert run(cfg, (72_000.0, 69_200.0)) == pytest.approx(72_000 * 1.01)
    # without the rule, or when that second's usage passed the P90 before it: the lead headroom
    assert run(replace(cfg, mem_trust_s=0.0), (72_000.0, 69_200.0)) == pytest.approx(72_000 * 1.12)
    assert run(cfg, (72_000.0, 70_100.0)) == pytest.approx(72_000 * 1.12)
    # a usage that never moved tested nothing: no trust
    assert run(cfg, (72_000.0, 69_200.0), moving=False) == pytest.approx(72_000 * 1.12)


def test_a_cut_share_is_capped_only_where_the_gpu_s_use_exceeds_it() -> None:
    # the forecasts (60 % each) do not fit, so b (priority 0) is cut; the two use 90 % of the GPU
    # together, so a cap on b would leave idle SM that b asked for
    cfg = replace(BASE, hard_limit_at_frac=0.9, sm_cap_cut_only=1.0)
    apps = [app("a", forecast_sm_p90_pct=60, used_sm_pct=45, priority=1),
            app("b", forecast_sm_p90_pct=60, used_sm_pct=45)]
    assert plan(apps, [DEV], 0.0, cfg).target("b").hard_sm_limit  # without the rule: capped
    at_use = replace(cfg, sm_cap_at_use_frac=1.0)
    roomy = plan(apps, [DEV], 0.0, at_use)
    assert roomy.devices[0].contended_sm and roomy.target("b").reason_sm == "contention"
    assert not roomy.target("b").hard_sm_limit and not roomy.devices[0].hard_sm_limits
    full = [replace(a, used_sm_pct=55) for a in apps]  # 110 % of the GPU in use: b yields
    assert plan(full, [DEV], 0.0, at_use).target("b").hard_sm_limit


def test_a_gpu_its_plan_fills_keeps_full_power_with_full_power_at_frac() -> None:
    # one application forecast past the whole GPU: planned at 100 %, nothing cut
    one = [app("a", forecast_sm_p90_pct=99, used_sm_pct=97)]
    cfg = replace(BASE, contended_full_power=1.0)
    filled = plan(one, [DEV], 0.0, cfg).devices[0]
    assert filled.sm_planned_pct == pytest.approx(100) and not filled.contended_sm
    assert not filled.full_power  # without the rule: the power policy's choice
    assert plan(one, [DEV], 0.0, replace(cfg, full_power_at_frac=1.0)).devices[0].full_power
    # only with contended_full_power, and only where the plan reaches the fraction
    assert not plan(one, [DEV], 0.0, replace(BASE, full_power_at_frac=1.0)).devices[0].full_power
    half = [app("a", forecast_sm_p90_pct=40, used_sm_pct=40)]
    assert not plan(half, [DEV], 0.0, replace(cfg, full_power_at_frac=1.0)).devices[0].full_power


def test_an_application_whose_memory_burst_keeps_room_for_another_burst() -> None:
    # a cache pool at 20 GB that jumped by 10 GB a while ago and came back down; the forecast sees 23 GB
    cfg = replace(BASE, mem_burst_window_s=1200.0, mem_burst_frac=0.1)
    a = app("a", granted_mem_mib=36_000, used_mem_mib=20_000, forecast_mem_p90_mib=23_000,
            last_mem_change_s=50.0, mem_burst_mib=10_000.0)
    held = plan([a], [DEV], 100.0, cfg).target("a")
    assert held.mem_mib == pytest.approx(30_000 * 1.02) and held.reason_mem == "burst"
    # without the rule, or without a burst: down to the forecast plus the margin
    for off, b in ((replace(cfg, mem_burst_window_s=0.0), a), (cfg, replace(a, mem_burst_mib=0.0))):
        assert plan([b], [DEV], 100.0, off).target("a").mem_mib == pytest.approx(23_000 * 1.02)
    # a grant under the room grows at once, inside the dwell
    grown = plan([replace(a, granted_mem_mib=24_000, last_mem_change_s=99.0)], [DEV], 100.0, cfg).target("a")
    assert grown.mem_mib == pytest.approx(30_000 * 1.02) and grown.changed_mem


def test_a_rise_is_a_burst_only_past_the_p90_past_the_start_up_and_over_the_threshold() -> None:
    cfg = replace(PREDICTIVE_CONFIG, mem_burst_window_s=1200.0, mem_burst_frac=0.1)
    assert cfg.is_burst(10_000.0, 20_000.0, 23_000.0, 300.0)
    assert not cfg.is_burst(2_000.0, 20_000.0, 23_000.0, 300.0)  # foreseen: under the P90
    assert not cfg.is_burst(1_500.0, 20_000.0, 21_000.0, 300.0)  # past the P90, but under 10 % of the usage
    assert not cfg.is_burst(10_000.0, 20_000.0, 23_000.0, 20.0)  # inside the start-up windows (30 s)
    assert not cfg.is_burst(10_000.0, 20_000.0, 23_000.0, math.nan)  # not started
    assert not cfg.is_burst(10_000.0, 20_000.0, math.nan, 300.0)  # no forecast to judge by
    assert not replace(cfg, mem_burst_window_s=0.0).is_burst(10_000.0, 20_000.0, 23_000.0, 300.0)


def test_a_bursty_application_s_ramp_is_extrapolated_at_most_one_burst_ahead() -> None:
    # a second burst of 10 GB: its own slope for 5 s asks for 50 GB more; it is one burst, not a ramp
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0, ramp_last_rate=1.0, mem_burst_window_s=1200.0,
                  mem_burst_ramp_cap=1.0)
    a = app("a", granted_mem_mib=31_000, used_mem_mib=30_000, forecast_mem_p90_mib=30_500, mem_ramp_s=1.0,
            mem_ramp_rate_mib_s=10_000.0, mem_ramp_last_mib_s=10_000.0, last_mem_change_s=99.0,
            mem_burst_mib=12_000.0)
    capped = plan([a], [DEV], 100.0, cfg).target("a")
    assert capped.mem_mib == pytest.approx(42_000 * 1.02)
    assert plan([a], [DEV], 100.0, replace(cfg, mem_burst_ramp_cap=0.0)).target("a").mem_mib == DEV.mem_total_mib
    # no burst seen yet: the ramp rule as for any other application
    assert plan([replace(a, mem_burst_mib=0.0)], [DEV], 100.0, cfg).target("a").mem_mib == DEV.mem_total_mib


def test_a_one_second_jump_past_the_start_up_is_extrapolated_less_than_a_ramp() -> None:
    # a serving engine's cache jumps 3 GB in one second, 60 s into its run: five seconds of that
    # slope ask for 15 GB more; as a jump it is extrapolated `ramp_jump_ahead_s` (here 1 s)
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0, ramp_last_rate=1.0, start_window_s=10.0,
                  start_ramp_window_s=30.0, ramp_jump_s=2.0, ramp_jump_ahead_s=1.0)
    a = app("a", granted_mem_mib=71_400, used_mem_mib=73_000, forecast_mem_p90_mib=71_000, mem_ramp_s=1.0,
            mem_ramp_rate_mib_s=3_000.0, mem_ramp_last_mib_s=3_000.0, last_mem_change_s=50.0, active_s=60.0)
    assert plan([a], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx((73_000 + 3_000) * 1.02)
    assert plan([a], [DEV], 100.0, replace(cfg, ramp_jump_ahead_s=0.0)).target("a").mem_mib == pytest.approx(
        73_000 * 1.02)
    # off: the ramp rule as before, the whole 80 GB device
    assert plan([a], [DEV], 100.0, replace(cfg, ramp_jump_s=0.0)).target("a").mem_mib == DEV.mem_total_mib
    # a rise that goes on into a second second is a ramp: extrapolated in full
    ramp = replace(a, mem_ramp_s=2.0)
    assert plan([ramp], [DEV], 100.0, cfg).target("a").mem_mib == DEV.mem_total_mib
    # in the start-up windows a first step is a ramp's beginning: extrapolated in full
    starting = replace(a, used_mem_mib=8_000, forecast_mem_p90_mib=7_000, granted_mem_mib=7_200, active_s=20.0)
    assert plan([starting], [DEV], 100.0, cfg).target("a").mem_mib == pytest.approx((8_000 + 5 * 3_000) * 1.02)


def test_a_jump_that_stays_flat_gives_back_its_grant_at_once() -> None:
    # a second ago the cache jumped 70 -> 73 GB and was granted the whole device (5 s of its slope);
    # now it is flat: the grant goes back to the forecast at once, not after the dwell and slow shrink
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0, start_window_s=10.0, start_ramp_window_s=30.0,
                  mem_shrink_dwell_s=10.0, mem_shrink_step_frac=0.25, ramp_jump_s=2.0, ramp_jump_ahead_s=5.0,
                  ramp_jump_release=1.0)
    a = app("a", granted_mem_mib=80_000, used_mem_mib=73_000, forecast_mem_p90_mib=73_500, mem_ramp_s=0.0,
            mem_ramp_prev_s=1.0, last_mem_change_s=99.0, active_s=60.0)
    released = plan([a], [DEV], 100.0, cfg).target("a")
    assert released.mem_mib == pytest.approx(73_500 * 1.02) and released.reason_mem == "jump-ended"
    # off: held by the dwell
    assert plan([a], [DEV], 100.0, replace(cfg, ramp_jump_release=0.0)).target("a").mem_mib == 80_000
    # not a jump that ended: still rising, a ramp of 2 s that stopped, a grant that changed 5 s ago,
    # or a start-up's first step
    for held in (replace(a, mem_ramp_s=1.0), replace(a, mem_ramp_prev_s=2.0), replace(a, last_mem_change_s=95.0),
                 replace(a, active_s=20.0)):
        assert plan([held], [DEV], 100.0, cfg).target("a").mem_mib >= 80_000 * 0.75


def test_a_jump_in_a_start_up_that_grows_in_stages_keeps_its_grant() -> None:
    # 60 s into its use (past the 30 s start-up windows) a job steps from 10 to 12 GB in one second and
    # was granted 5 s of that slope; a start-up that grows in stages steps again a few seconds later, so
    # within `ramp_jump_release_after_s` of use the flat second after a step does not give its grant back
    cfg = replace(BASE, ramp_min_s=1.0, ramp_ahead_s=5.0, start_window_s=10.0, start_ramp_window_s=30.0,
                  mem_shrink_dwell_s=10.0, mem_shrink_step_frac=0.25, ramp_jump_s=2.0, ramp_jump_ahead_s=5.0,
                  ramp_jump_release=1.0, ramp_jump_release_after_s=90.0)
    a = app("a", granted_mem_mib=22_440, used_mem_mib=12_000, forecast_mem_p90_mib=12_000, mem_ramp_s=0.0,
            mem_ramp_prev_s=1.0, last_mem_change_s=99.0, active_s=60.0)
    held = plan([a], [DEV], 100.0, cfg).target("a")
    assert held.mem_mib == 22_440 and held.reason_mem != "jump-ended"
    # without the window (0: the start-up windows only) the grant goes back to the forecast at once
    released = plan([a], [DEV], 100.0, replace(cfg, ramp_jump_release_after_s=0.0)).target("a")
    assert released.mem_mib == pytest.approx(12_000 * 1.02) and released.reason_mem == "jump-ended"
    # past the window (the jump made at 90 s of use, judged at 91 s) a jump that stopped is released
    late = plan([replace(a, active_s=91.0)], [DEV], 100.0, cfg).target("a")
    assert late.mem_mib == pytest.approx(12_000 * 1.02) and late.reason_mem == "jump-ended"
    assert plan([replace(a, active_s=90.5)], [DEV], 100.0, cfg).target("a").mem_mib == 22_440
    with pytest.raises(ValueError, match="ramp_jump_release_after_s"):
        PolicyConfig(ramp_jump_release_after_s=-1.0)


def test_the_daemons_policy_gives_back_a_jumps_grant_once_the_usage_is_flat() -> None:
    def run(config: PolicyConfig, tail: list[float], flat_s: int = 120) -> float:
        # `flat_s` at 70 GB; the cache jumps to 73 GB in one second (the forecast says the last value)
        used = [70_000.0] * flat_s + [73_000.0] + tail
        return _daemon_grant_mib(config, [(u, u) for u in used])

    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)
    assert (cfg.ramp_jump_s, cfg.ramp_jump_release, cfg.ramp_jump_release_after_s) == (2.0, 1.0, 90.0)
    # one flat second after the jump: back to the usage plus the margin
    assert run(cfg, [73_000.0]) == pytest.approx(73_000 * 1.02)
    # off: the jump's 5 s of slope (the whole simulated H100) held by the dwell
    assert run(replace(cfg, ramp_jump_release=0.0), [73_000.0]) > 80_000
    # a rise that goes on is a ramp: its extrapolation stays
    assert run(cfg, [76_000.0]) > 80_000
    # the same jump 60 s into the use, a start-up's possible next stage: kept, unless the window is 0
    assert run(cfg, [73_000.0], flat_s=60) > 80_000
    assert run(replace(cfg, ramp_jump_release_after_s=0.0), [73_000.0], flat_s=60) == pytest.approx(73_000 * 1.02)


def test_usage_history_keeps_the_bursts_that_came_back_down() -> None:
    from vgpu.allocator.policy.forecast import UsageHistory

    cfg = replace(PREDICTIVE_CONFIG, mem_burst_window_s=100.0)
    h = UsageHistory()
    for t in range(40):
        h.observe("a", float(t), 20_000.0, forecast_mib=21_000.0)
    h.observe("a", 40.0, 30_000.0, forecast_mib=31_000.0)  # over the 21,000 it was judged against
    h.observe("a", 41.0, 30_000.0, forecast_mib=31_000.0)
    assert h.burst_mib("a", 41.0, cfg) == 0.0  # still up: a step that stays is no burst
    h.observe("a", 42.0, 24_000.0, forecast_mib=25_000.0)  # under 20,000 + half the rise: back down
    assert h.burst_mib("a", 42.0, cfg) == 10_000.0
    assert h.burst_mib("a", 140.0, cfg) == 0.0  # out of the window
    assert h.burst_mib("a", 42.0, replace(cfg, mem_burst_window_s=0.0)) == 0.0
    # the same jump in the start-up windows counts for nothing
    h.observe("b", 0.0, 20_000.0, forecast_mib=21_000.0)
    h.observe("b", 1.0, 30_000.0, forecast_mib=31_000.0)
    h.observe("b", 2.0, 20_000.0, forecast_mib=21_000.0)
    assert h.burst_mib("b", 2.0, cfg) == 0.0


def test_the_daemons_policy_keeps_room_for_a_burst_it_saw() -> None:
    def run(config: PolicyConfig) -> float:
        # 40 s at 20 GB (the forecast says the last value), a 10 GB burst for 20 s, 60 s back at 20 GB
        used = [20_000.0] * 40 + [30_000.0] * 20 + [20_000.0] * 60
        return _daemon_grant_mib(config, [(u, u) for u in used])

    cfg = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)
    assert (cfg.mem_burst_window_s, cfg.mem_burst_ramp_cap) == (1200.0, 1.0)
    assert run(cfg) == pytest.approx(30_000 * 1.02)
    assert run(replace(cfg, mem_burst_window_s=0.0)) == pytest.approx(20_000 * 1.02)
