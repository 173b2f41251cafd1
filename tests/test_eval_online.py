"""`vgpu eval --online`: one node clock, learning only from what has happened, every origin counted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vgpu.manager.baselines import EwmaForecaster, GbdtForecaster, LastValueForecaster
from vgpu.manager.experts import MixtureConfig, make_served
from vgpu.manager.forecast import HORIZONS_S, Forecast
from vgpu.offline import evaluate as ev
from vgpu.offline import online
from vgpu.traces import AppTrace, write_trace


def job(app: str, n_s: int = 60, start_s: float = 0.0, level: float = 100.0, per_second: int = 2) -> AppTrace:
    """Memory steps up by `level` every 20 s; compute follows a sine; `per_second` samples a second."""
    t = start_s + np.arange(n_s * per_second) / per_second
    k = np.floor(t - start_s)
    return AppTrace(app, t, {"mem_used_mib": level * (1 + k // 20), "sm_util_pct": 50 + 40 * np.sin(k / 5),
                             "mem_total_mib": np.full(len(t), 1000.0)})


class Cheater:
    """Forecasts the truth by reading past the end of what it is given (the arrays' base)."""

    name = "cheater"

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        out = []
        for hist in histories:
            vals = []
            for col in ("mem_used_mib", "sm_util_pct"):
                full = hist.column(col)
                base = full.base if full.base is not None else full
                t_base = hist.t_s.base if hist.t_s.base is not None else hist.t_s
                last = int(math.floor(float(hist.t_s[-1])))
                row = []
                for h in HORIZONS_S:
                    sel = np.floor(np.asarray(t_base, dtype=np.float64)) == last + h
                    v = np.asarray(base)[sel] if len(base) == len(t_base) else np.array([])
                    row.append(float(np.mean(v)) if len(v) and np.isfinite(v).all() else math.nan)
                vals.append(tuple(row))
            out.append(Forecast(HORIZONS_S, vals[0], vals[0], vals[1], vals[1], self.name))
        return out


class Spy:
    """Records the latest sample time it was ever shown, by forecasts and by its learn hook."""

    name = "spy"

    def __init__(self) -> None:
        self.violations: list[tuple[float, float]] = []
        self.learned_at: list[float] = []
        self.now = 0.0

    def learn(self, histories: Sequence[AppTrace], now_s: float) -> None:
        self.learned_at.append(now_s)
        for h in histories:
            if len(h) and h.t_s[-1] >= now_s:
                self.violations.append((float(h.t_s[-1]), now_s))

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        nan = (math.nan,) * len(HORIZONS_S)
        return [Forecast(HORIZONS_S, nan, nan, nan, nan, self.name) for _ in histories]


def _rows(report: dict[str, Any], method: str, key: str = "results", target: str = "mem_used_mib") -> dict[int, dict[str, Any]]:
    return {r["horizon_s"]: r for r in report[key] if r["method"] == method and r["target"] == target}


def test_a_cheater_wins_offline_but_sees_nothing_of_the_future_online() -> None:
    apps = [job("a"), job("b", start_s=30.0, level=50.0)]
    offline = ev.evaluate(apps, [Cheater()])
    assert _rows(offline, "cheater")[5]["mae"] == 0.0  # offline hands out views of whole arrays
    layout = online.node_layout(apps, "shared")
    report = online.evaluate_online(layout, [online.HistoryOnline(Cheater())])
    assert all(r["n"] == 0 for r in report["results"])  # every peek past the origin found nothing


def test_learning_sees_only_samples_up_to_the_origin() -> None:
    apps = [job("a"), job("b", start_s=25.0)]
    spy = Spy()
    online.evaluate_online(online.node_layout(apps, "shared"), [online.HistoryOnline(spy, every_s=7)])
    assert spy.learned_at and spy.violations == []

    current: list[int] = [0]
    seen: list[tuple[float, int]] = []  # (latest sample time a fit saw, the second it fitted at)

    class Spying(GbdtForecaster):
        def fit(self, traces):  # type: ignore[no-untyped-def]
            traces = list(traces)
            seen.append((max(float(t.t_s[-1]) for t in traces), current[0]))
            return super().fit(traces)

    class Gbdt(online.GbdtOnline):
        def learn(self, view: online.NodeView, now_s: int) -> None:
            current[0] = now_s
            super().learn(view, now_s)

    g = Gbdt(refit_every_s=20, make=lambda: Spying(n_estimators=5))
    online.evaluate_online(online.node_layout(apps, "shared"), [g])
    assert g.fits >= 2 and len(seen) == g.fits
    assert all(latest < now + 1 for latest, now in seen)  # nothing after the end of second T


def test_online_last_value_median_equals_offline_and_halves_add_up() -> None:
    apps = [job("a"), job("b", start_s=45.0)]
    off = ev.evaluate(apps, [LastValueForecaster(), EwmaForecaster()])
    rep = online.evaluate_online(online.node_layout(apps, "shared"),
                                 [online.MarginOnline(), online.GridOnline(EwmaForecaster())])
    for method in ("last_value", "ewma"):
        for target in ("mem_used_mib", "sm_util_pct"):
            a, b = _rows(off, method, target=target), _rows(rep, method, target=target)
            for h in HORIZONS_S:
                assert a[h]["n"] == b[h]["n"]
                assert a[h]["mae"] == pytest.approx(b[h]["mae"])
                halves = _rows(rep, method, "first_half", target)[h]["n"] + _rows(rep, method, "second_half", target)[h]["n"]
                assert halves == b[h]["n"]
    # the margin is learned as it goes: a P90 at every origin, learned from the node's past only
    assert _rows(rep, "last_value")[5]["coverage_p90"] is not None


def test_per_app_clocks_are_laid_end_to_end_in_first_row_order() -> None:
    apps = [job("first", n_s=30), job("second", n_s=40, start_s=0.5)]
    layout = online.node_layout(apps)
    assert layout.clock == "per-app" and "end to end" in layout.why
    a, b = layout.apps
    assert a.t_s[0] == 0.0 and b.t_s[0] >= a.t_s[-1] + 1
    assert b.t_s[0] - math.floor(b.t_s[0]) == pytest.approx(0.5)  # whole-second shift: same grid
    shared = online.node_layout([job("x", start_s=1_700_000_000.0), job("y", start_s=1_700_000_010.0)])
    assert shared.clock == "shared"
    assert online.node_layout(apps, metadata={"clock": "shared"}).clock == "shared"
    with pytest.raises(ValueError):
        online.node_layout(apps, "sideways")


def test_online_is_deterministic() -> None:
    apps = [job("a", n_s=80), job("b", n_s=80, start_s=20.0, level=30.0)]

    def run() -> str:
        methods = online.default_methods(["last_value", "ewma", "vpa_percentile", "gbdt"], None, refit_every_s=30)
        return json.dumps(online.evaluate_online(online.node_layout(apps, "shared"), methods))

    assert run() == run()


def test_cli_online_reports_offline_and_online_with_halves(tmp_path: Path) -> None:
    path = tmp_path / "node.csv"
    write_trace(path, [job("j1", n_s=50), job("j2", n_s=50, level=300.0)])
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "eval", "--trace", str(path), "--online", "--json",
                        "--methods", "last_value,ewma,vpa_percentile,gbdt", "--refit-every-s", "30"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"offline", "online"}
    assert out["online"]["clock"] == "per-app" and "end to end" in out["online"]["clock_why"]
    assert {x["method"] for x in out["online"]["results"]} == {"last_value", "ewma", "vpa_percentile", "gbdt"}
    assert out["online"]["first_half"] and out["online"]["second_half"]
    assert "online clock: per-app" in r.stderr


class Ahead:
    """A model that knows each job's memory step (at every 20th second) 3 s ahead: a model the served
    mixture should come to trust, so that the served forecast is not the last value's."""

    name = "model"

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        out = []
        for h in histories:
            k = math.floor(float(h.t_s[-1]) - float(h.t_s[0]))
            level = float(h.column("mem_used_mib")[-1]) / (1 + k // 20)
            mem = tuple(level * (1 + (k + hz) // 20) for hz in HORIZONS_S)
            sm = float(h.column("sm_util_pct")[-1])
            out.append(Forecast(HORIZONS_S, mem, mem, (sm,) * len(HORIZONS_S), (sm,) * len(HORIZONS_S), self.name))
        return out


def test_online_scores_the_served_mixture_as_the_daemon_builds_it() -> None:
    apps = [job("a", n_s=120), job("b", n_s=120, start_s=60.0, level=40.0)]
    methods = online.default_methods(["model", "served", "last_value"], Ahead())
    assert [m.name for m in methods] == ["model", "served", "last_value"]
    served = next(m for m in methods if m.name == "served")
    assert isinstance(served, online.ServedOnline)
    # the daemon's mixture (vgpu/daemon/serve.py): last value, model and the node's learnt slots, empty
    # on a fresh node (a node two minutes old runs no trees round: the first is due after an hour)
    assert served.fc.expert_names == ("last_value", "model", "local", "trees")  # type: ignore[attr-defined]
    assert served.fc.expert("local") is None  # type: ignore[attr-defined]
    rep = online.evaluate_online(online.node_layout(apps, "shared"), methods)
    assert served.rounds == [] and served.fc.expert("trees") is None  # type: ignore[attr-defined]
    for target in ("mem_used_mib", "sm_util_pct"):
        s, lv = _rows(rep, "served", target=target), _rows(rep, "last_value", target=target)
        for h in HORIZONS_S:
            assert s[h]["n"] == lv[h]["n"] > 0 and s[h]["coverage_p90"] is not None and s[h]["pinball_p90"] is not None
            assert _rows(rep, "served", "first_half", target)[h]["n"] + _rows(rep, "served", "second_half", target)[h]["n"] \
                == s[h]["n"]
    # the mixture learns to follow the model that sees the steps coming: better than the last value
    mem = _rows(rep, "served")
    assert mem[3]["mae"] < 0.8 * _rows(rep, "last_value")[3]["mae"]
    # without the node prior (which hands a new application what the node's streams learnt, so it
    # depends on how the applications overlap in time) each application's state learns from its own
    # origins only, in time order, so the mixture online and offline agree (the model is not refitted)
    alone = MixtureConfig(node_prior_decay=0.0)
    rep_alone = online.evaluate_online(online.node_layout(apps, "shared"),
                                       [online.HistoryOnline(make_served(Ahead(), alone, name="served", local=True))])
    off = ev.evaluate(apps, [make_served(Ahead(), alone, name="served", local=True)])
    for target in ("mem_used_mib", "sm_util_pct"):
        a, b = _rows(off, "served", target=target), _rows(rep_alone, "served", target=target)
        for h in HORIZONS_S:
            assert a[h]["n"] == b[h]["n"]
            assert a[h]["mae"] == pytest.approx(b[h]["mae"]) and a[h]["pinball_p90"] == pytest.approx(b[h]["pinball_p90"])


def test_cli_online_reports_served(tmp_path: Path) -> None:
    path = tmp_path / "node.csv"
    write_trace(path, [job("j1", n_s=50), job("j2", n_s=50, level=300.0)])
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "eval", "--trace", str(path), "--online", "--json",
                        "--model", str(tmp_path / "absent.pt"), "--methods", "served,last_value"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["online"]
    assert {x["method"] for x in out["results"]} == {"served", "last_value"}
    # without a model the served mixture is the last value alone: its median is the last value's
    s, lv = _rows(out, "served"), _rows(out, "last_value")
    assert all(s[h]["mae"] == pytest.approx(lv[h]["mae"]) and s[h]["coverage_p90"] is not None for h in HORIZONS_S)
    assert {x["method"] for x in out["second_half"]} == {"served", "last_value"}
