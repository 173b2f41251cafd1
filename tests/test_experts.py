"""The served expert mixture (manager/experts.py): regret against the last value, a good model's gain,
P90 coverage under the mix, and bad input (no signals, clock jumps, failing experts)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from vgpu.manager.experts import MixtureConfig, MixtureForecaster, make_served
from vgpu.manager.forecast import HORIZONS_S, Forecast
from vgpu.traces import AppTrace

Truth = Callable[[float], float]


class FutureModel:
    """A model that sees the true series' future, with an error of `noise` (sd) and `bias`:
    noise 0 is an oracle, a large noise a model that knows nothing about this workload."""

    name = "model"

    def __init__(self, series: dict[str, np.ndarray], noise: float, bias: float = 0.0, seed: int = 0) -> None:
        self.series, self.noise, self.bias = series, noise, bias
        self.rng = np.random.default_rng(seed)

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        out = []
        for h in histories:
            k = int(math.floor(h.t_s[-1]))
            grid = self.series[h.app]
            fut = [float(grid[min(k + hz, len(grid) - 1)]) + self.bias + float(self.rng.normal(0, self.noise))
                   for hz in HORIZONS_S]
            out.append(Forecast(HORIZONS_S, tuple(fut), tuple(f + 2 * self.noise for f in fut), tuple(fut),
                                tuple(f + 2 * self.noise for f in fut), "model"))
        return out


def _run(mix: MixtureForecaster, grids: dict[str, np.ndarray], per_s: int = 2) -> dict[str, np.ndarray]:
    """Drive the mixture through the evaluation protocol: at origin k, each application's history is
    every sample with floor(t) <= k (`per_s` samples per second equal to the grid value). Returns
    {"mix50", "mix90", "last"} of shape (apps, origins, horizons) and "truth"."""
    apps = sorted(grids)
    n = min(len(g) for g in grids.values())
    res = {k: np.full((len(apps), n, len(HORIZONS_S)), np.nan) for k in ("mix50", "mix90", "last", "truth")}
    for k in range(n):
        hists = []
        for app in apps:
            g = grids[app]
            t = np.repeat(np.arange(k + 1, dtype=np.float64), per_s) + np.tile(np.arange(per_s) / per_s, k + 1)
            v = np.repeat(g[: k + 1], per_s)
            hists.append(AppTrace(app, t, {"mem_used_mib": v, "sm_util_pct": np.clip(v / 100, 0, 100)}))
        for a, f in enumerate(mix.forecast_batch(hists)):
            res["mix50"][a, k] = f.mem_p50_mib
            res["mix90"][a, k] = f.mem_p90_mib
            res["last"][a, k] = grids[apps[a]][k]
            for j, h in enumerate(HORIZONS_S):
                if k + h < n:
                    res["truth"][a, k, j] = grids[apps[a]][k + h]
    return res


def _mae(pred: np.ndarray, truth: np.ndarray, skip: int = 0) -> float:
    p, t = pred[:, skip:], truth[:, skip:]
    ok = np.isfinite(p) & np.isfinite(t)
    return float(np.mean(np.abs(p[ok] - t[ok])))


def _noisy_walk(n: int, seed: int, level: float = 4000.0, step: float = 20.0, noise: float = 30.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return level + np.cumsum(rng.normal(0, step, n)) + rng.normal(0, noise, n)


def test_a_bad_model_is_weighed_out_to_the_last_values_error() -> None:
    grids = {f"a{i}": _noisy_walk(400, i, noise=0.0) for i in range(3)}
    cfg = MixtureConfig()
    mix = MixtureForecaster({"model": FutureModel(grids, noise=400.0, bias=300.0)}, cfg)
    r = _run(mix, grids)
    last, mixed = _mae(r["last"], r["truth"], 60), _mae(r["mix50"], r["truth"], 60)
    model_error = 300.0
    assert mixed <= 1.02 * last, (mixed, last)
    # and the regret bound holds per stream in normalised loss units: the mixture's cumulative
    # normalised loss exceeds the last value's by less than the bound
    scale = cfg.mem_floor_mib
    for j in range(len(HORIZONS_S)):
        ok = np.isfinite(r["truth"][0, :, j])
        extra = float(np.minimum(1, np.abs(r["mix50"][0, ok, j] - r["truth"][0, ok, j]) / scale).sum()
                      - np.minimum(1, np.abs(r["last"][0, ok, j] - r["truth"][0, ok, j]) / scale).sum())
        assert extra <= cfg.regret_bound(3, int(ok.sum()))
    assert mixed < model_error / 4
    w = mix.weights("a0")
    assert w is not None and (w["mem_used_mib"][:, 0] + w["mem_used_mib"][:, 1] > 0.9).all()  # last value, ewma


def test_a_good_model_gives_the_mixture_its_gain() -> None:
    grids = {f"a{i}": _noisy_walk(300, 10 + i) for i in range(3)}
    mix = MixtureForecaster({"model": FutureModel(grids, noise=5.0)})
    r = _run(mix, grids)
    last, mixed = _mae(r["last"], r["truth"], 60), _mae(r["mix50"], r["truth"], 60)
    assert mixed <= 0.3 * last, (mixed, last)
    w = mix.weights("a1")
    assert w is not None and (w["mem_used_mib"][:, 2] > 0.9).all()


def test_p90_coverage_holds_on_a_stationary_noisy_series() -> None:
    rng = np.random.default_rng(3)
    grids = {f"a{i}": 5000.0 + rng.normal(0, 100.0, 600) for i in range(4)}
    mix = MixtureForecaster()  # last value and EWMA only: no expert has a P90 to start from
    r = _run(mix, grids)
    ok = np.isfinite(r["truth"][:, 100:])
    covered = r["truth"][:, 100:][ok] <= r["mix90"][:, 100:][ok]
    assert 0.87 <= covered.mean() <= 0.93, covered.mean()
    assert (r["mix90"] >= r["mix50"] - 1e-9)[np.isfinite(r["mix90"])].all()


def test_no_signals_and_empty_histories_give_nan_forecasts_without_state() -> None:
    mix = MixtureForecaster({"model": None})
    empty = AppTrace("e", np.zeros(0), {})
    nothing = AppTrace("n", np.arange(5.0), {"power_w": np.full(5, 100.0)})
    all_nan = AppTrace("x", np.arange(5.0), {"mem_used_mib": np.full(5, np.nan), "sm_util_pct": np.full(5, np.nan)})
    out = mix.forecast_batch([empty, nothing, all_nan])
    assert all(math.isnan(v) for f in out for v in (*f.mem_p50_mib, *f.sm_p90_pct))
    assert mix.weights("e") is None and mix.weights("n") is None


@pytest.mark.parametrize("jump_s", [-3600.0, 7200.0])
def test_a_clock_jump_drops_unscored_forecasts_and_keeps_serving(jump_s: float) -> None:
    logs: list[tuple[str, dict[str, object]]] = []

    class Rec:
        def warning(self, event: str, **kw: object) -> None:
            logs.append((event, kw))

        def __getattr__(self, name: str) -> Callable[..., None]:
            return lambda *a, **k: None

    mix = MixtureForecaster(logger=Rec())  # type: ignore[arg-type]
    t = np.arange(0.0, 30.0, 0.5)
    v = np.full(len(t), 1000.0)
    for k in range(5, 30):
        mix.forecast_batch([AppTrace("a", t[t < k + 1], {"mem_used_mib": v[t < k + 1]})])
    scored = mix.scored
    assert scored > 0
    # the window after the jump: forward, the old samples and the new; back, only the new (the
    # manager's window refuses a time going back, so the application must have restarted)
    after = t[-1] + jump_s + np.arange(1.0, 11.0)
    t2 = np.concatenate([t, after]) if jump_s > 0 else after
    v2 = np.full(len(t2), 1000.0)
    for k in range(3):
        n = len(t2) - 10 + 4 + 2 * k
        f = mix.forecast_batch([AppTrace("a", t2[:n], {"mem_used_mib": v2[:n]})])[0]
        assert f.mem_p50_mib[0] == pytest.approx(1000.0)
    assert mix.time_resets == 1 and [e for e, _ in logs] == ["mixture_clock_jump"]


def test_a_failing_expert_abstains_and_is_logged_once() -> None:
    class Broken:
        name = "model"

        def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
            raise RuntimeError("boom")

    mix = MixtureForecaster({"model": Broken()})
    t = np.arange(0.0, 20.0, 0.5)
    for k in range(3, 20):
        f = mix.forecast_batch([AppTrace("a", t[t < k + 1], {"sm_util_pct": np.full(int((t < k + 1).sum()), 40.0)})])[0]
        assert f.sm_p50_pct[0] == pytest.approx(40.0) and math.isnan(f.mem_p50_mib[0])
    assert mix.expert_failures == 17


def test_repeated_apps_in_one_batch_go_in_order() -> None:
    """The evaluator's batches hold many origins of one application: the same forecasts as one by one."""
    g = _noisy_walk(40, 5)
    t = np.arange(40.0)
    hists = [AppTrace("a", t[: k + 1], {"mem_used_mib": g[: k + 1]}) for k in range(40)]
    together = MixtureForecaster().forecast_batch(hists)
    one = MixtureForecaster()
    apart = [one.forecast_batch([h])[0] for h in hists]
    assert [f.mem_p90_mib for f in together] == [f.mem_p90_mib for f in apart]


def test_state_is_bounded_by_max_apps() -> None:
    mix = MixtureForecaster(config=MixtureConfig(max_apps=4))
    t = np.arange(10.0)
    for i in range(10):
        mix.forecast_batch([AppTrace(f"a{i}", t, {"mem_used_mib": np.full(10, 100.0)})])
    assert sum(mix.weights(f"a{i}") is not None for i in range(10)) == 4


def test_the_served_mixture_is_the_last_value_and_the_model() -> None:
    grids = {"a": _noisy_walk(120, 7)}
    served = make_served(FutureModel(grids, noise=5.0))
    assert served.expert_names == ("last_value", "model") and served.name == "mixture"
    assert served.prior.tolist() == pytest.approx([1 / 3, 2 / 3])
    r = _run(served, grids)
    assert _mae(r["mix50"], r["truth"], 30) < 0.5 * _mae(r["last"], r["truth"], 30)
    # without its model (not loaded yet) it serves the last value
    alone = make_served(None)
    alone.forecast_batch([AppTrace("a", np.arange(5.0), {"mem_used_mib": np.full(5, 300.0)})])
    f = alone.forecast_batch([AppTrace("a", np.arange(6.0), {"mem_used_mib": np.full(6, 300.0)})])[0]
    assert f.mem_p50_mib == (300.0,) * 5 and f.source == "mixture"


def test_the_p90_margin_comes_back_down_after_a_ramp() -> None:
    """A start-up ramp (a burst of large errors) then a flat series: the P90's margin over the median
    returns to the flat series' scale within a couple of minutes, instead of staying inflated."""
    grids = {f"a{i}": np.concatenate([np.full(30, 1000.0), np.linspace(1000.0, 20000.0, 20), np.full(550, 20000.0)])
             for i in range(2)}
    r = _run(MixtureForecaster(), grids)
    margin = r["mix90"][:, 300:] - r["mix50"][:, 300:]
    assert np.nanmax(margin) < 20.0, np.nanmax(margin)  # under a few multiples of the 8 MiB scale floor
    ok = np.isfinite(r["truth"][:, 300:])
    assert (r["truth"][:, 300:][ok] <= r["mix90"][:, 300:][ok] + 1e-6).mean() >= 0.9


class SharpModel:
    """A model whose median is the last value and whose P90 knows which seconds will rise."""

    name = "model"

    def __init__(self, series: dict[str, np.ndarray]) -> None:
        self.series = series

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        out = []
        for h in histories:
            k = int(math.floor(h.t_s[-1]))
            grid = self.series[h.app]
            now = float(grid[k])
            p90 = tuple(max(now, float(grid[min(k + hz, len(grid) - 1)])) for hz in HORIZONS_S)
            out.append(Forecast(HORIZONS_S, (now,) * 5, p90, (now / 100,) * 5, tuple(v / 100 for v in p90), "model"))
        return out


def test_the_served_p90_keeps_a_models_sharp_p90() -> None:
    """Rare, large rises a model's P90 sees coming: the served P90 follows the model's P90 rather than
    a margin of constant width, so its pinball loss is far under the last value's with a fixed margin."""
    rng = np.random.default_rng(5)
    grids = {}
    for i in range(3):
        g = np.full(600, 4000.0)
        for s in rng.choice(np.arange(20, 590), 12, replace=False):
            g[s:s + 3] += 3000.0
        grids[f"a{i}"] = g

    def pinball(mix: MixtureForecaster) -> float:
        r = _run(mix, grids)
        d = r["truth"][:, 100:] - r["mix90"][:, 100:]
        ok = np.isfinite(d)
        return float(np.mean(np.maximum(0.9 * d[ok], -0.1 * d[ok])))

    served, constant = pinball(make_served(SharpModel(grids))), pinball(MixtureForecaster())
    assert served < 0.6 * constant, (served, constant)


class MeanModel:
    """A model that knows each application's level but not its noise: median the level, and a P90
    equal to its median (it under-covers, as a model whose P90 does not know the workload does)."""

    name = "model"

    def __init__(self, levels: dict[str, float]) -> None:
        self.levels = levels

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        out = []
        for h in histories:
            m = self.levels[h.app]
            out.append(Forecast(HORIZONS_S, (m,) * 5, (m,) * 5, (m / 100,) * 5, (m / 100,) * 5, "model"))
        return out


def _one_after_another(mix: MixtureForecaster, grids: dict[str, np.ndarray], first: int) -> float:
    """Run applications one after another on one node clock, each forgotten when it ends (as the
    manager does); returns the P90's coverage (memory, every horizon) over the first `first` origins
    of every application but the first."""
    hit, n = 0, 0
    for a, (app, g) in enumerate(grids.items()):
        start = a * 1000.0
        for k in range(len(g) - 1):
            t = start + np.repeat(np.arange(k + 1, dtype=np.float64), 2) + np.tile([0.0, 0.5], k + 1)
            v = np.repeat(g[: k + 1], 2)
            f = mix.forecast_batch([AppTrace(app, t, {"mem_used_mib": v, "sm_util_pct": v / 100})])[0]
            if a and k < first:
                for j, h in enumerate(HORIZONS_S):
                    if k + h < len(g):
                        hit += int(g[k + h] <= f.mem_p90_mib[j])
                        n += 1
        mix.forget(app)
    return hit / n


def test_a_new_application_starts_from_the_nodes_p90_offset() -> None:
    """Short applications one after another whose model P90 under-covers: each new application's P90
    offset and scale start from what the node's earlier applications learnt, so its first minute is
    covered near 0.9; starting every application from a zero offset leaves its first minute far under."""
    rng = np.random.default_rng(11)
    levels = {f"job{i}": 3000.0 + 500.0 * i for i in range(8)}
    grids = {app: level + rng.normal(0.0, 60.0, 120) for app, level in levels.items()}
    on = _one_after_another(make_served(MeanModel(levels)), grids, first=60)
    off = _one_after_another(make_served(MeanModel(levels), MixtureConfig(node_prior_decay=0.0)), grids, first=60)
    assert on >= 0.8, (on, off)
    assert off < on - 0.15, (on, off)


@pytest.mark.parametrize(("decay", "scorings"), [(1.0, 100.0), (-0.1, 100.0), (0.9, -1.0)])
def test_node_prior_settings_are_checked(decay: float, scorings: float) -> None:
    with pytest.raises(ValueError, match="node_prior"):
        MixtureConfig(node_prior_decay=decay, node_prior_scorings=scorings)
