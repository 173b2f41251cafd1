"""The baseline forecasters: last value, EWMA, VPA-style decaying histogram, LightGBM."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from vgpu.manager.baselines import (
    HISTOGRAMS,
    BaselineForecaster,
    EwmaForecaster,
    GbdtForecaster,
    LastValueForecaster,
    VpaPercentileForecaster,
    lag_features,
    make_baselines,
)
from vgpu.manager.forecast import HORIZONS_S, Forecaster
from vgpu.offline.splits import split_of
from vgpu.traces import AppTrace, read_trace

FIXTURE = Path(__file__).parent / "fixtures" / "migperf_runs.csv.gz"


def test_every_baseline_is_a_forecaster() -> None:
    for fc in [*make_baselines(), GbdtForecaster()]:
        assert isinstance(fc, Forecaster)
    assert BaselineForecaster is VpaPercentileForecaster


def test_forecast_batch_gives_nan_for_a_target_the_history_lacks() -> None:
    hist = AppTrace(app="a", t_s=np.arange(12.0), columns={"sm_util_pct": np.arange(12.0)})
    (f,) = LastValueForecaster().forecast_batch([hist])
    assert f.horizons_s == HORIZONS_S and f.source == "last_value"
    assert f.sm_p50_pct == (11.0,) * 5
    assert all(math.isnan(v) for v in f.sm_p90_pct + f.mem_p50_mib + f.mem_p90_mib)
    assert LastValueForecaster().forecast_batch([]) == []


def test_ewma_matches_its_recursion() -> None:
    fc = EwmaForecaster(alpha=0.3)
    assert fc.ewma(np.array([10.0])) == 10.0
    assert fc.ewma(np.array([0.0, 10.0])) == pytest.approx(3.0)
    rng = np.random.default_rng(1)
    for n in (3, 50, 300):
        grid = rng.uniform(0, 100, n)
        s = grid[0]
        for x in grid[1:]:
            s = 0.3 * x + 0.7 * s
        assert fc.ewma(grid) == pytest.approx(s)
    with pytest.raises(ValueError):
        EwmaForecaster(alpha=0.0)


def test_vpa_buckets_grow_five_percent() -> None:
    opts = HISTOGRAMS["sm_util_pct"]
    starts = opts.bucket_start(np.arange(1, 40))
    widths = np.diff(starts)
    assert widths[1:] / widths[:-1] == pytest.approx(np.full(len(widths) - 1, 1.05))
    b = opts.bucket_of(np.array([0.0, 0.05, 50.0, 1e9]))
    assert b[0] == 0 and b[1] == 0 and b[3] == opts.num_buckets - 1
    assert opts.bucket_start(b[2]) <= 50.0 < opts.bucket_start(b[2] + 1)


def test_vpa_percentiles_and_decay() -> None:
    fc = VpaPercentileForecaster(half_life_s=1e9)  # effectively no decay
    p50, p90 = fc.percentiles_of(np.full(40, 50.0), "sm_util_pct")
    assert 50.0 <= p50 <= 50.0 * 1.06 and p90 == p50  # the upper end of 50's bucket
    mixed = np.array([10.0] * 80 + [90.0] * 20)
    p50, p90 = fc.percentiles_of(mixed, "sm_util_pct")
    assert 10.0 <= p50 <= 10.6 and 90.0 <= p90 <= 94.5
    # with a short half-life the recent 90s dominate even the median
    p50_recent, _ = VpaPercentileForecaster(half_life_s=2.0).percentiles_of(mixed, "sm_util_pct")
    assert p50_recent >= 90.0
    p50, _ = fc.percentiles_of(np.full(20, 100.0), "sm_util_pct")
    assert p50 == 100.0  # capped at the target's range
    with pytest.raises(ValueError):
        VpaPercentileForecaster(half_life_s=0)


def test_lag_features_pad_short_grids() -> None:
    x = lag_features([np.array([5.0]), np.arange(40.0)])
    assert x.shape[0] == 2
    assert x[0, 0] == 5.0 and np.all(x[0, 1:-1] == 0.0)  # a constant history: no change anywhere
    assert x[1, 0] == 39.0 and x[1, 1] == 1.0  # change over the last second


def test_gbdt_fits_on_training_runs_and_forecasts_sane_quantiles() -> None:
    trace = read_trace(FIXTURE)
    train = [a for a in trace.apps.values() if split_of(a.app) == "train"]
    fc = GbdtForecaster(n_estimators=20, max_rows=2000).fit(train)
    assert fc.fitted and fc.trained_on == sorted(a.app for a in train)
    test = [a for a in trace.apps.values() if split_of(a.app) == "test"]
    forecasts = fc.forecast_batch(test)
    for f in forecasts:
        for p50, p90 in zip(f.sm_p50_pct, f.sm_p90_pct, strict=True):
            assert 0.0 <= p50 <= p90 <= 100.0
        assert all(m >= 0 for m in f.mem_p50_mib)
    # trained models are deterministic for a seed
    again = GbdtForecaster(n_estimators=20, max_rows=2000).fit(train).forecast_batch(test)
    assert [f.sm_p50_pct for f in again] == [f.sm_p50_pct for f in forecasts]


def test_gbdt_refuses_traces_too_short_to_train_on() -> None:
    short = AppTrace(app="s", t_s=np.arange(12.0), columns={"sm_util_pct": np.ones(12)})
    with pytest.raises(ValueError, match="no training origin"):
        GbdtForecaster().fit([short])
    unfitted = GbdtForecaster().forecast_grids([np.ones(20)], "sm_util_pct")
    assert np.isnan(unfitted[0]).all()
