"""bench/replay.py: the metric formulas on hand-computable numbers, and the JSON it prints."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import replay as R  # noqa: E402
from vgpu.allocator.policy.forecast import PREDICTIVE_CONFIG, ForecastPolicy  # noqa: E402
from vgpu.device.skus import get_sku  # noqa: E402
from vgpu.manager.forecast import Forecast, Forecaster  # noqa: E402
from vgpu.traces import AppTrace, write_trace  # noqa: E402

SKU = get_sku("h100-80gb")


def app_trace(name: str, mem: list[float], sm: list[float]) -> AppTrace:
    n = len(mem)
    return AppTrace(name, np.arange(n, dtype=float) + 1000.0,
                    {"mem_used_mib": np.array(mem, dtype=float), "sm_util_pct": np.array(sm, dtype=float)})


def test_slack_and_violation_formulas() -> None:
    # slack: (10-5)/10 = 0.5, (10-10)/10 = 0, over-use counts 0 slack; violations: 1 of 3
    slack, viol = R.slack_and_violations(np.array([10.0, 10.0, 10.0]), np.array([5.0, 10.0, 12.0]))
    assert slack == pytest.approx(0.5 / 3)
    assert viol == pytest.approx(1 / 3)
    # a zero allocation holds no slack; use on it is a violation (an idle app granted 0 % SM)
    slack, viol = R.slack_and_violations(np.array([0.0, 0.0, 4.0]), np.array([0.0, 1.0, 2.0]))
    assert slack == pytest.approx(0.5 / 3)
    assert viol == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        R.slack_and_violations(np.array([-1.0]), np.array([1.0]))
    with pytest.raises(ValueError):
        R.slack_and_violations(np.array([]), np.array([]))


def test_tiny_trace_static_and_oracle_by_hand() -> None:
    # one app: memory 1000 for 4 s then 2000 for 4 s; SM 50 then 20
    mem = [1000.0] * 4 + [2000.0] * 4
    sm = [50.0] * 4 + [20.0] * 4
    apps, skipped = R.prepare([app_trace("a", mem, sm)])
    assert not skipped and apps[0].ticks == 8
    apps = R.pack(apps, SKU)
    from vgpu.manager.baselines import LastValueForecaster

    # cooperative limits throughout, so an overrun is scored, not fatal
    out = {r["policy"]: r for r in R.replay(apps, SKU, LastValueForecaster(), kill_on_oom=False)}
    # static: grants 2000 MiB / 50 % for ticks 1..7 (tick 0 is not scored)
    # mem slack: ticks 1-3 -> 0.5 each, ticks 4-7 -> 0 -> 1.5 / 7
    assert out["static"]["mem_slack_frac"] == pytest.approx(round(1.5 / 7, 4))
    # sm slack: ticks 1-3 -> 0, ticks 4-7 -> 0.6 each -> 2.4 / 7
    assert out["static"]["sm_slack_frac"] == pytest.approx(round(2.4 / 7, 4))
    assert out["static"]["mem_violation_rate"] == 0.0 and out["static"]["changes_per_hour"] == 0.0
    # oracle: the next 5 s peak with no margin never under-allocates
    assert out["oracle"]["mem_violation_rate"] == 0.0 and out["oracle"]["sm_violation_rate"] == 0.0
    # reactive: the last usage (+10 %) misses the step at tick 4 exactly once
    assert out["reactive"]["mem_violation_rate"] == pytest.approx(round(1 / 7, 4))
    for r in out.values():
        assert float(r["energy_j"]) > 0


def test_vpa_bumps_memory_after_a_violation() -> None:
    mem = [1000.0] * 20 + [3000.0] * 20
    apps, _ = R.prepare([app_trace("a", mem, [10.0] * 40)])
    apps = R.pack(apps, SKU)
    from vgpu.manager.baselines import LastValueForecaster

    runs: dict[str, R.PolicyRun] = {}
    R.replay(apps, SKU, LastValueForecaster(), policies=("vpa",), runs_out=runs, kill_on_oom=False)
    alloc = np.array(runs["vpa"].mem_alloc)
    # one violation at the step (tick 20), then at least max(1.2 x 3000, 3100) from the next tick on
    assert int(np.sum(np.array(runs["vpa"].mem_used) > alloc)) == 1
    assert alloc[20] >= 3600 - 1e-6


def test_pack_keeps_peaks_within_each_gpu() -> None:
    traces = [app_trace(f"a{i}", [30_000.0] * 3, [40.0] * 3) for i in range(5)]
    apps = R.pack(R.prepare(traces)[0], SKU)
    per_dev: dict[int, list[R.ReplayApp]] = {}
    for a in apps:
        per_dev.setdefault(a.device, []).append(a)
    assert len(per_dev) == 3  # 2 + 2 + 1 by SM (40 % each), memory 60 000 <= 81 559
    for group in per_dev.values():
        assert sum(a.sm.max() for a in group) <= 100
        assert sum(a.mem.max() for a in group) <= SKU.mem_total_mib
    with pytest.raises(ValueError, match="more than"):
        R.pack(R.prepare([app_trace("big", [90_000.0] * 3, [1.0] * 3)])[0], SKU)


def test_cli_prints_the_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, [app_trace("x", [1000.0 + 10 * i for i in range(12)], [30.0] * 12),
                       app_trace("y", [500.0] * 12, [5.0] * 6 + [60.0] * 6),
                       app_trace("z", [1.0], [1.0])])
    rc = R.main(["--trace", str(path), "--split", "all", "--forecaster", "vpa_percentile", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in out["policies"]] == list(R.POLICIES)
    keys = {"policy", "mem_slack_frac", "mem_violation_rate", "sm_slack_frac", "sm_violation_rate",
            "changes_per_hour", "energy_j"}
    for p in out["policies"]:
        assert keys <= set(p)
        assert 0 <= p["mem_slack_frac"] <= 1 and 0 <= p["mem_violation_rate"] <= 1
    assert out["forecaster"].startswith("vpa_percentile")
    assert out["apps"] == 2 and out["tick_s"] == 1.0
    assert any("z" in s for s in out["skipped"])


def test_cli_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert R.main(["--trace", str(tmp_path / "missing.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    path = tmp_path / "t.csv"
    write_trace(path, [app_trace("x", [1.0] * 5, [1.0] * 5)])
    assert R.main(["--trace", str(path), "--gpu", "tpu-v9"]) == 2
    assert "unknown GPU SKU" in capsys.readouterr().err
    assert R.main(["--trace", str(path), "--split", "all", "--forecaster", "model",
                   "--checkpoint", str(tmp_path / "none.pt")]) == 2


# the daemon's own policy settings, and `--set` for a trade-off study
def test_predictive_replays_the_settings_the_daemon_plans_with() -> None:
    apps = R.pack(R.prepare([app_trace("a", [1000.0] * 6, [10.0] * 6)])[0], SKU)
    from vgpu.manager.baselines import LastValueForecaster

    runs: dict[str, R.PolicyRun] = {}
    R.replay(apps, SKU, LastValueForecaster(), policies=("predictive",), runs_out=runs)
    assert runs["predictive"].config is PREDICTIVE_CONFIG is ForecastPolicy().config


def test_predictive_bump_covers_a_memory_step_after_its_first_second() -> None:
    # memory climbs 200 MiB a second for 6 s; the last-value forecast sees only the past
    mem = [2000.0] * 10 + [2000.0 + 200 * i for i in range(1, 7)] + [3200.0] * 10
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)
    from vgpu.manager.baselines import LastValueForecaster

    def violations(**overrides: float) -> int:
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, [f"{k}={v}" for k, v in overrides.items()])
        runs: dict[str, R.PolicyRun] = {}
        R.replay(apps, SKU, LastValueForecaster(), policies=("predictive",), configs={"predictive": config},
                 runs_out=runs, kill_on_oom=False)
        return int(np.sum(np.array(runs["predictive"].mem_used) > np.array(runs["predictive"].mem_alloc)))

    # the leading rules off: the bump alone
    off = {"ramp_min_s": 0.0, "mem_lead_frac": 0.0, "start_ramp_frac": 0.0}
    assert violations(**off) == 1
    assert violations(**off, mem_bump_frac=0.0, mem_bump_min_mib=0.0) >= 5  # most seconds of the step


def test_config_overrides_apply_numbers_and_refuse_the_rest() -> None:
    config, changes = R.config_overrides(PREDICTIVE_CONFIG, ["sm_shrink_dwell_s=30", " mem_bump_min_mib = 512"])
    assert config.sm_shrink_dwell_s == 30.0 and config.mem_bump_min_mib == 512.0
    assert config.mem_bump_frac == PREDICTIVE_CONFIG.mem_bump_frac
    assert changes == {"sm_shrink_dwell_s": 30.0, "mem_bump_min_mib": 512.0}
    assert R.config_overrides(PREDICTIVE_CONFIG, []) == (PREDICTIVE_CONFIG, {})
    with pytest.raises(ValueError, match="NAME one of"):
        R.config_overrides(PREDICTIVE_CONFIG, ["no_such=1"])
    with pytest.raises(ValueError, match="NAME one of"):
        R.config_overrides(PREDICTIVE_CONFIG, ["grow_on_overrun=1"])  # a flag, not a number
    with pytest.raises(ValueError, match="NAME=VALUE"):
        R.config_overrides(PREDICTIVE_CONFIG, ["dwell_s"])
    with pytest.raises(ValueError, match="not a number"):
        R.config_overrides(PREDICTIVE_CONFIG, ["dwell_s=soon"])
    with pytest.raises(ValueError, match="dwell_s must be >= 0"):
        R.config_overrides(PREDICTIVE_CONFIG, ["dwell_s=-1"])


def test_cli_set_is_reported_and_a_bad_one_is_a_clear_error(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, [app_trace("x", [1000.0 + 10 * i for i in range(12)], [30.0] * 12)])
    base = ["--trace", str(path), "--split", "all", "--forecaster", "last_value", "--json"]
    assert R.main([*base, "--set", "sm_min_change_pct=0"]) == 0
    assert json.loads(capsys.readouterr().out)["predictive_overrides"] == {"sm_min_change_pct": 0.0}
    assert R.main(base) == 0
    assert json.loads(capsys.readouterr().out)["predictive_overrides"] == {}
    assert R.main([*base, "--set", "sm_bump_pct=-5"]) == 2
    assert "sm_bump_pct must be >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# what users feel: OOM kills and failures, slowdown from contention and power, lead times
# ------------------------------------------------------------------------------------------------
def _predictive(apps: list[R.ReplayApp], forecaster: Forecaster, *sets: str) -> R.Result:
    """The predictive policy alone replayed over `apps`, its shipped settings changed by `--set`-style
    `sets`, out-of-memory events counted but not killing."""
    config, _ = R.config_overrides(PREDICTIVE_CONFIG, list(sets))
    return R.replay(apps, SKU, forecaster, policies=("predictive",), configs={"predictive": config},
                    kill_on_oom=False)[0]


def _lv() -> Forecaster:
    from vgpu.manager.baselines import LastValueForecaster

    return LastValueForecaster()


def test_an_overrun_of_a_hard_limit_ends_the_application() -> None:
    mem = [1000.0] * 20 + [3000.0] * 20
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * 40)])[0], SKU)
    runs: dict[str, R.PolicyRun] = {}
    out = {r["policy"]: r for r in R.replay(apps, SKU, _lv(), policies=("static", "vpa"),
                                            runs_out=runs)}
    assert out["vpa"]["apps_killed_oom"] == 1 and out["vpa"]["oom_events"] == 1
    assert runs["vpa"].apps["a"].killed_at == 20
    assert out["vpa"]["lost_work_s"] == pytest.approx(20.0)
    assert out["static"]["apps_killed_oom"] == 0 and out["static"]["oom_events"] == 0


def test_an_overrun_of_a_cooperative_limit_is_survived_at_a_cost() -> None:
    mem = [1000.0] * 20 + [3000.0] * 20
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * 40)])[0], SKU)
    cooperative, _ = R.config_overrides(PREDICTIVE_CONFIG, ["hard_limit_at_frac=2", "mem_bump_min_mib=0",
                                                            "mem_bump_frac=0", "mem_lead_frac=0"])
    out = R.replay(apps, SKU, _lv(), policies=("predictive",),
                   configs={"predictive": cooperative})[0]
    assert out["apps_killed_oom"] == 0 and out["oom_events"] >= 1
    assert float(out["mean_slowdown"]) > 1.0  # the failed second's work is lost
    hard, _ = R.config_overrides(cooperative, ["hard_limit_at_frac=0"])
    assert R.replay(apps, SKU, _lv(), policies=("predictive",),
                    configs={"predictive": hard})[0]["apps_killed_oom"] == 1


def test_apps_asking_more_sm_than_the_gpu_has_run_slower() -> None:
    traces = [app_trace(f"a{i}", [1000.0] * 30, [90.0] * 30) for i in range(2)]
    apps = [replace(a, device=0) for a in R.prepare(traces)[0]]  # both on one GPU
    out = R.replay(apps, SKU, _lv(), policies=("static",))[0]
    assert out["mean_slowdown"] == pytest.approx(1.8, rel=1e-3)
    alone = R.replay(R.pack(R.prepare(traces)[0], SKU), SKU, _lv(), policies=("static",))[0]
    assert alone["mean_slowdown"] == pytest.approx(1.0)


def test_a_lower_power_limit_slows_a_busy_gpu_by_the_zeus_curve() -> None:
    apps = R.pack(R.prepare([app_trace("a", [1000.0] * 40, [100.0] * 40)])[0], SKU)
    out = {r["policy"]: r for r in R.replay(apps, SKU, _lv(), policies=("static", "oracle"))}
    assert out["static"]["mean_slowdown"] == pytest.approx(1.0)
    assert 1.0 < float(out["oracle"]["mean_slowdown"]) < 1.1  # a busy GPU's limit: within ~5 % on the curve


def test_lead_times_by_hand() -> None:
    used = np.array([100.0, 100, 100, 100, 100, 100, 200, 300, 300, 300])
    # grant grew to 300 at second 4 (two seconds before the rise at 6 and three before 7)
    early = np.array([150.0, 150, 150, 150, 300, 300, 300, 300, 300, 300])
    assert R.lead_times(used, early, window_s=5) == [(2, 0), (3, 1)]
    # grant follows one second late: covers 200 at 7 and 300 at 8
    late = np.array([150.0, 150, 150, 150, 150, 150, 150, 200, 300, 300])
    assert R.lead_times(used, late, window_s=5) == [(-1, 0), (-1, 1)]
    # never covered: minus the seconds left
    never = np.full(10, 150.0)
    assert R.lead_times(used, never, window_s=5) == [(6 - 10, 0), (7 - 10, 1)]
    # a rise the old grant already covered is no rise
    assert R.lead_times(used, np.full(10, 400.0), window_s=5) == []
    # an application starting: no grant at its first second counts as none
    start = np.array([100.0, 500, 500, 500])
    assert R.lead_times(start, np.array([math.nan, 600, 600, 600]), window_s=5) == [(0, 0)]
    assert R.lead_times(start, np.array([math.nan, 300, 600, 600]), window_s=5) == [(-1, 0)]


def test_the_leading_rules_grant_a_ramp_ahead_of_its_rise() -> None:
    # a ramp of 300 MiB a second for 8 s after a flat start (a training job filling its memory)
    mem = [1000.0] * 15 + [1000.0 + 300 * i for i in range(1, 9)] + [3400.0] * 15
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)

    def result(*sets: str) -> R.Result:
        return _predictive(apps, _lv(), *sets)

    led = result()
    bump_only = result("ramp_min_s=0", "mem_lead_frac=0", "start_ramp_frac=0")  # the bump alone trails the ramp
    plain = result("ramp_min_s=0", "mem_lead_frac=0", "start_ramp_frac=0", "mem_bump_frac=0", "mem_bump_min_mib=0")
    assert led["lead_time_median_visible_s"] >= 1 and led["oom_events"] == 0
    assert bump_only["lead_time_median_visible_s"] < 1 and bump_only["oom_events"] > 0
    assert plain["lead_time_median_visible_s"] < 0 and plain["oom_events"] > bump_only["oom_events"]


def test_tick_series_and_priorities_of_a_dense_node() -> None:
    traces = [app_trace(f"a{i}", [20_000.0] * 10 + [50_000.0] * 10, [40.0] * 20) for i in range(3)]
    apps = R.pack_mean(R.prepare(traces)[0], SKU)
    assert len({a.device for a in apps}) < len(apps)  # peaks meet on a GPU
    assert sorted(a.priority for a in apps) == [0, 1, 2]
    runs: dict[str, R.PolicyRun] = {}
    out = {r["policy"]: r for r in R.replay(apps, SKU, _lv(), policies=("static", "predictive"),
                                            runs_out=runs)}
    series = R.tick_series(runs)
    assert len(series["predictive"]["mem_granted_mib"]) == 20
    assert set(series["static"]) >= {"mem_used_mib", "oom_events", "mean_speed"}
    assert "by_priority" in out["predictive"]
    assert set(R.packing(apps)) == {str(a.device) for a in apps}


# ------------------------------------------------------------------------------------------------
# MIG layouts (--mig)
# ------------------------------------------------------------------------------------------------
class _Foresight:
    """A forecaster that knows each application's next 5 s (the P90 is the true peak of each
    horizon), so the MIG replay's timing can be checked by hand."""

    name = "foresight"

    def __init__(self, full: dict[str, list[float]]) -> None:
        self.full = full

    def forecast_batch(self, histories: list[AppTrace]) -> list[Forecast]:
        out = []
        for h in histories:
            mem = self.full[h.app]
            k = len(h) - 1
            ahead = tuple(max(mem[min(k + i, len(mem) - 1)] for i in range(1, j + 1)) for j in range(1, 6))
            out.append(Forecast((1, 2, 3, 4, 5), ahead, ahead, (10.0,) * 5, (10.0,) * 5, "foresight"))
        return out


class _LastValueP90:
    """A forecaster whose P90 is the last usage at every horizon: it never sees a jump coming."""

    name = "last-value-p90"

    def forecast_batch(self, histories: list[AppTrace]) -> list[Forecast]:
        out = []
        for h in histories:
            last = (float(h.columns["mem_used_mib"][-1]),) * 5
            out.append(Forecast((1, 2, 3, 4, 5), last, last, (10.0,) * 5, (10.0,) * 5, "last-value-p90"))
        return out


def test_mig_replay_reconfigures_ahead_of_a_growth_and_static_holds_the_peak() -> None:
    sku = get_sku("a100-80gb")
    grow = [5_000.0] * 30 + [5_000.0 + 1_500 * i for i in range(1, 9)] + [17_000.0] * 30
    flat = [8_000.0] * len(grow)
    traces = [app_trace("grow", grow, [10.0] * len(grow)), app_trace("flat", flat, [10.0] * len(flat))]
    apps = R.pack_mig(R.prepare(traces)[0], sku)
    assert {a.device for a in apps} == {0}
    full = {"grow": grow, "flat": flat}
    exact = replace(PREDICTIVE_CONFIG, mem_margin_frac=0.0, mem_lead_frac=0.0)  # the foresight needs no margin
    out = {r["policy"]: r for r in R.mig_replay(apps, sku, _Foresight(full), reconfig_s=6.0, config=exact)}  # type: ignore[arg-type]
    static, dyn = out["mig-static"], out["mig-predictive"]
    assert static["reconfigurations"] == 0 and static["oom_events"] == 0
    assert dyn["reconfigurations"] >= 1 and dyn["oom_events"] == 0
    assert dyn["lead_time_median_s"] is not None and dyn["lead_time_median_s"] >= 0  # ready before the need
    assert dyn["slices_used"] <= static["slices_used"]
    assert dyn["instance_mem_mib"] < static["instance_mem_mib"]  # the peak's instance only from the growth on


def test_cli_cooperative_counts_every_overrun_and_kills_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, [app_trace("x", [1000.0] * 12 + [3000.0] * 12 + [6000.0] * 12, [30.0] * 36)])
    base = ["--trace", str(path), "--split", "all", "--forecaster", "last_value", "--json"]
    assert R.main(base) == 0
    hard = {p["policy"]: p for p in json.loads(capsys.readouterr().out)["policies"]}
    assert R.main([*base, "--cooperative"]) == 0
    out = json.loads(capsys.readouterr().out)
    coop = {p["policy"]: p for p in out["policies"]}
    assert out["cooperative"] is True
    assert hard["reactive"]["apps_killed_oom"] == 1 and hard["reactive"]["oom_events"] == 1
    assert coop["reactive"]["apps_killed_oom"] == 0 and coop["reactive"]["oom_events"] >= 2


def test_an_sm_share_caps_only_where_the_plan_says_the_gpu_is_contended() -> None:
    # one application whose SM jumps past its share: capped (slowed) only when caps are hard
    sm = [20.0] * 20 + [80.0] * 20
    apps = R.pack(R.prepare([app_trace("a", [1000.0] * 40, sm)])[0], SKU)

    def slowdown(frac: float) -> float:
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, [f"hard_limit_at_frac={frac}", "sm_cap_cut_only=0",
                                                           "sm_cap_at_use_frac=0"])
        runs: dict[str, R.PolicyRun] = {}
        R.replay(apps, SKU, _lv(), policies=("predictive",), configs={"predictive": config}, runs_out=runs)
        return runs["predictive"].apps["a"].slowdown

    assert slowdown(0.0) > slowdown(0.9)


def test_a_start_up_ramp_is_granted_a_multiple_and_its_jump_does_not_overrun() -> None:
    # the context (400 MiB) for 8 s, weights loading at 150 MiB/s for 4 s, then the first steps'
    # activations in one jump to 2,800 MiB: the ramp's rate (1,000 + 3 x 150) falls far short
    mem = [400.0] * 8 + [550.0, 700.0, 850.0, 1000.0] + [2800.0] * 10
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)

    def result(*sets: str) -> R.Result:
        return _predictive(apps, _lv(), *sets)

    assert result()["oom_events"] == 0
    assert result("start_ramp_frac=0")["oom_events"] == 1


def test_a_ramp_in_mid_life_is_granted_ahead_at_its_latest_slope() -> None:
    # a minute flat (past every start-up window), then a ramp whose steps grow by half each second
    # (200, 300, 450, ... MiB): its mean rate trails its latest slope, and a grant extrapolated at
    # the mean covers each second only when it comes
    mem = [2000.0] * 60 + [2200.0, 2500.0, 2950.0, 3625.0, 4637.0, 6156.0, 8434.0] + [8434.0] * 20
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)

    def result(*sets: str) -> R.Result:
        return _predictive(apps, _lv(), *sets)

    led, trailed = result(), result("ramp_last_rate=0")
    assert led["rises_visible"] == trailed["rises_visible"] == 5
    assert led["lead_time_median_visible_s"] == 1.0 and led["lead_time_ahead_frac_visible"] == 1.0
    assert trailed["lead_time_median_visible_s"] == 0.0
    # the first step of the ramp is a surprise either way; nothing after it overruns
    assert led["oom_events"] == trailed["oom_events"] == 1


def test_a_grant_left_far_over_an_ended_ramp_is_taken_back_in_one_change() -> None:
    # the accelerating ramp above, then 40 s flat: its extrapolation left a grant of over twice the use
    mem = [2000.0] * 60 + [2200.0, 2500.0, 2950.0, 3625.0, 4637.0, 6156.0, 8434.0] + [8434.0] * 40
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)

    def grants(*sets: str) -> tuple[R.Result, list[float]]:
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, list(sets))
        runs: dict[str, R.PolicyRun] = {}
        out = R.replay(apps, SKU, _lv(), policies=("predictive",), configs={"predictive": config},
                       kill_on_oom=False, runs_out=runs)[0]
        return out, runs["predictive"].apps["a"].grant_mem

    fast, fast_g = grants("mem_shrink_peak_mult=1.5")
    slow, slow_g = grants()
    assert max(fast_g[1:]) > 2 * 8434  # the ramp's end, extrapolated
    # once the dwell after the ramp's last change is over: down to 1.5 x the peak in one change,
    # where the bounded step takes a quarter of the grant
    assert fast_g[80] == pytest.approx(8434 * 1.5)
    assert slow_g[80] == pytest.approx(slow_g[70] * 0.75) and slow_g[80] > 1.5 * 8434
    assert fast["mem_slack_frac"] < slow["mem_slack_frac"]
    assert fast["oom_events"] == slow["oom_events"] == 1


def test_the_start_up_window_from_first_use_covers_a_job_that_waited_idle() -> None:
    # 20 s of an idle GPU (1 MiB), then the job's context and, a second later, its model
    mem = [1.0] * 20 + [900.0] + [1500.0] * 10
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)
    assert apps[0].first_use == 20

    def result(*sets: str) -> R.Result:
        return _predictive(apps, _lv(), *sets)

    assert result("start_from_use=1")["oom_events"] == 0
    assert result("start_from_use=0")["oom_events"] >= 1


def _gpu_trace(name: str, gpu: str | None, mem: float, sm: float, n: int = 12) -> AppTrace:
    t = app_trace(name, [mem] * n, [sm] * n)
    return replace(t, gpu=gpu)


def test_pack_gpu_follows_the_trace_s_gpu_column() -> None:
    traces = [_gpu_trace("a", "0", 50_000.0, 60.0), _gpu_trace("b", "0", 40_000.0, 60.0),
              _gpu_trace("c", "1", 1_000.0, 10.0), _gpu_trace("d", None, 1_000.0, 10.0),
              _gpu_trace("e", None, 1_000.0, 10.0)]
    apps = {a.app_id: a for a in R.pack_gpu(R.prepare(traces)[0], SKU)}
    # a and b share GPU 0 although their peaks do not fit together; c has GPU 1; the two without
    # a gpu value are packed first-fit by peaks after those
    assert apps["a"].device == apps["b"].device == 0 and apps["c"].device == 1
    assert apps["d"].device == apps["e"].device == 2
    assert sorted(a.priority for a in apps.values()) == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="no gpu column"):
        R.pack_gpu(R.prepare([_gpu_trace("x", None, 1.0, 1.0)])[0], SKU)
    with pytest.raises(ValueError, match="more than"):
        R.pack_gpu(R.prepare([_gpu_trace("big", "0", 90_000.0, 1.0)])[0], SKU)


def test_cli_pack_gpu_prints_the_packing_and_contends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, [_gpu_trace("a", "gpu-x", 1_000.0, 70.0), _gpu_trace("b", "gpu-x", 1_000.0, 70.0),
                       _gpu_trace("c", "gpu-y", 1_000.0, 30.0)])
    argv = ["--trace", str(path), "--split", "all", "--forecaster", "last_value", "--pack", "gpu"]
    assert R.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pack"] == "gpu" and out["gpus"] == 2
    assert out["packing"]["0"] == ["a", "b (priority 1)"] and out["packing"]["1"] == ["c (priority 2)"]
    static = next(p for p in out["policies"] if p["policy"] == "static")
    assert static["mean_slowdown"] > 1.0  # a and b ask 140 % of one GPU's SM
    assert R.main(argv) == 0
    assert "packing (gpu): GPU 0: a, b (priority 1); GPU 1: c (priority 2)" in capsys.readouterr().out
    write_trace(path, [app_trace("a", [1_000.0] * 12, [10.0] * 12)])
    assert R.main([*argv, "--json"]) == 2
    assert "no gpu column" in capsys.readouterr().err


def test_a_contended_gpu_keeps_full_power() -> None:
    # two applications on one GPU, each asking 80 % of its SM: it time-slices, and a lower power
    # limit would slow both on top of that
    traces = [_gpu_trace(n, "0", 1_000.0, 80.0, n=30) for n in ("a", "b")]
    apps = R.pack_gpu(R.prepare(traces)[0], SKU)

    def slowdown(*sets: str) -> float:
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, list(sets))
        out = R.replay(apps, SKU, _lv(), policies=("static", "predictive"), configs={"predictive": config})
        return float(out[1]["mean_slowdown"])

    assert slowdown("contended_full_power=1") < slowdown("contended_full_power=0")


def test_a_forecast_that_keeps_covering_the_usage_is_trusted_without_the_margin() -> None:
    # a serving engine's shape: 60 GB of weights and a cache that moves by 2 GB every 20 s; a
    # forecaster that foresees it covers every second, so after 30 s of it its P90 is granted with 1 %
    # and no lead headroom
    mem = [60_000.0 + (2_000.0 if (i // 20) % 2 else 0.0) + (i % 7) * 50.0 for i in range(200)]
    apps = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)
    fc: Forecaster = _Foresight({"a": mem})  # type: ignore[assignment]

    def run(*sets: str) -> R.Result:
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, list(sets))
        return R.replay(apps, SKU, fc, policies=("predictive",), configs={"predictive": config},
                        kill_on_oom=False)[0]

    assert (PREDICTIVE_CONFIG.mem_trust_s, PREDICTIVE_CONFIG.mem_trust_margin_frac) == (30.0, 0.01)
    trusted = run()
    plain = run("mem_trust_s=0")
    assert trusted["oom_events"] == plain["oom_events"] == 0
    assert trusted["mem_slack_frac"] < plain["mem_slack_frac"] - 0.002


def test_a_cut_share_caps_only_where_the_gpu_s_use_exceeds_it() -> None:
    # a and b take turns at 60 % and 40 % of one GPU: together they never use more than it has, but
    # the forecasts (the last second plus the margin) do not fit, so the lower priority is cut, and
    # a cap leaves it below what it asks the next second
    a_sm = [60.0, 40.0] * 15
    traces = [replace(app_trace("a", [1_000.0] * 30, a_sm), gpu="0"),
              replace(app_trace("b", [1_000.0] * 30, [100.0 - s for s in a_sm]), gpu="0")]
    apps = R.pack_gpu(R.prepare(traces)[0], SKU)

    def slowdown(*sets: str) -> float:
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, ["full_power_at_frac=1", *sets])
        out = R.replay(apps, SKU, _lv(), policies=("predictive",), configs={"predictive": config})
        return float(out[0]["mean_slowdown"])

    assert slowdown("sm_cap_at_use_frac=0") > 1.0
    assert slowdown("sm_cap_at_use_frac=1") == pytest.approx(1.0)


def test_a_gpu_its_plan_fills_keeps_full_power() -> None:
    # one application at 98 % of its GPU: the plan fills the GPU and cuts nothing; the power policy
    # would slow it by up to its bound, full_power_at_frac keeps the maximum limit
    apps = R.pack(R.prepare([app_trace("a", [1_000.0] * 30, [98.0] * 30)])[0], SKU)

    def slowdown(*sets: str) -> float:
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, list(sets))
        return float(R.replay(apps, SKU, _lv(), policies=("predictive",), configs={"predictive": config})[0]["mean_slowdown"])

    assert slowdown("full_power_at_frac=0") > 1.0
    assert slowdown("full_power_at_frac=1") == pytest.approx(1.0)


def test_a_cache_that_bursts_again_is_granted_room_for_the_next_burst() -> None:
    # a serving engine's cache pool at 20 GB that jumps by 10 GB for 20 s every 100 s, which a forecast
    # of the last value never sees coming; without the rule the grant shrinks back before each burst
    cycle = [30_000.0] * 20 + [20_000.0] * 80
    mem = [20_000.0] * 60 + cycle * 4
    bursty = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)
    # a training job's steps that stay: no burst, the rule changes nothing
    steps = [20_000.0] * 60 + [30_000.0] * 100 + [40_000.0] * 300
    stepped = R.pack(R.prepare([app_trace("b", steps, [10.0] * len(steps))])[0], SKU)

    def run(apps: list[R.ReplayApp], *sets: str) -> R.Result:
        return _predictive(apps, _LastValueP90(), *sets)  # type: ignore[arg-type]

    assert PREDICTIVE_CONFIG.mem_burst_window_s == 1200.0
    assert run(bursty)["oom_events"] == 1  # the first burst only
    assert run(bursty, "mem_burst_window_s=0")["oom_events"] == 4
    on, off = run(stepped), run(stepped, "mem_burst_window_s=0")
    assert (on["oom_events"], on["mem_slack_frac"]) == (off["oom_events"], off["mem_slack_frac"])


def test_a_cache_that_jumps_and_stays_flat_gets_its_jumps_grant_back_at_once() -> None:
    # a serving engine's cache grows 1.5 GB in one second every 30 s and stays: each jump extrapolated
    # at its slope for 5 s asks 7.5 GB more, held for the dwell and the slow shrink without the rule
    mem = [60_000.0] * 60
    for _ in range(8):
        mem += [mem[-1] + 1_500.0] * 30
    jumpy = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)
    # a ramp that goes on (1 GB a second for 20 s): its extrapolation stays
    ramp = [20_000.0] * 60 + [20_000.0 + 1_000.0 * i for i in range(1, 21)] + [40_000.0] * 100
    ramping = R.pack(R.prepare([app_trace("b", ramp, [10.0] * len(ramp))])[0], SKU)

    def run(apps: list[R.ReplayApp], *sets: str) -> R.Result:
        return _predictive(apps, _LastValueP90(), *sets)  # type: ignore[arg-type]

    assert PREDICTIVE_CONFIG.ramp_jump_release == 1.0
    on, off = run(jumpy), run(jumpy, "ramp_jump_release=0")
    # each jump is unforeseen by a last-value forecast: overruns either way, none added by the rule
    assert on["oom_events"] <= off["oom_events"]
    assert on["mem_slack_frac"] < off["mem_slack_frac"] - 0.02
    on, off = run(ramping), run(ramping, "ramp_jump_release=0")
    assert (on["oom_events"], on["mem_slack_frac"]) == (off["oom_events"], off["mem_slack_frac"])


def test_a_start_up_that_grows_in_stages_keeps_each_stages_grant_for_the_next() -> None:
    # a job at 10 GB from its first use steps up 2 GB in one second every 3 s from 40 s in, four stages,
    # then stays: each step extrapolated 5 s at its slope covers the next; released at the flat second
    # after each step, every next stage overruns a grant at the forecast of the last value
    mem = [10_000.0] * 40
    for _ in range(4):
        mem += [mem[-1] + 2_000.0] * 3
    mem += [mem[-1]] * 100
    staged = R.pack(R.prepare([app_trace("a", mem, [10.0] * len(mem))])[0], SKU)
    # a serving engine's cache that jumps once, 200 s into its use, and stays: released either way
    late = [60_000.0] * 200 + [61_500.0] * 60
    jumpy = R.pack(R.prepare([app_trace("b", late, [10.0] * len(late))])[0], SKU)

    def run(apps: list[R.ReplayApp], *sets: str) -> R.Result:
        return _predictive(apps, _LastValueP90(), *sets)  # type: ignore[arg-type]

    assert PREDICTIVE_CONFIG.ramp_jump_release_after_s == 90.0
    on, off = run(staged), run(staged, "ramp_jump_release_after_s=0")
    assert on["oom_events"] == 1  # the first step only: no forecast of the last value sees it
    assert off["oom_events"] == 4  # and every later stage, after its grant went back
    assert on["lead_time_median_s"] > off["lead_time_median_s"]
    on, off = run(jumpy), run(jumpy, "ramp_jump_release_after_s=0")
    assert (on["oom_events"], on["mem_slack_frac"]) == (off["oom_events"], off["mem_slack_frac"])
    assert on["mem_slack_frac"] < run(jumpy, "ramp_jump_release=0")["mem_slack_frac"]
