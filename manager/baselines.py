"""Baseline forecasters: what the model must beat, and the daemon's fallback when no model loads.

All of them work on the 1 s grid of the evaluation protocol (../shared/TRACE_FORMAT.md, step 1):
a history is reduced per target to its grid up to the origin second, and each method maps that
grid to a median and (where it has one) a P90 for horizons 1-5 s.

- `last_value`: the grid value at the origin, for every horizon. No P90.
- `ewma`: exponentially weighted mean over the grid (alpha 0.3, started at the first value). No P90.
- `vpa_percentile`: a decaying histogram in the manner of the Kubernetes VPA recommender:
  exponentially growing buckets (each 5 % wider than the one before), every grid second added
  with weight 2^((k - k_origin) / half-life), percentiles read as the upper end of the bucket
  where the cumulative weight first reaches the percentile. Median -> p50, 90th -> p90.
- `gbdt`: LightGBM on lag features of the grid, one model per target, horizon and quantile
  (0.5 and 0.9, quantile objective), predicting the change from the origin value; trained with
  `GbdtForecaster.fit(traces)` on the model's own training data.

Every class implements `vgpu.manager.forecast.Forecaster` (`forecast_batch(histories)`), and also
`forecast_grids(grids, target)`, which the evaluator calls with grids it has built once per
application (a prefix of an application's grid equals the grid of the prefix of its samples).
`BaselineForecaster` is the one the manager daemon falls back to.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from vgpu.manager.forecast import HORIZONS_S, Forecast
from vgpu.traces import TARGETS, AppTrace, one_second_grid

FloatArray = npt.NDArray[np.float64]
MIN_ORIGIN_INDEX = 9  # protocol step 2: origins from the 10th second of an application's grid on
_UPPER = {"sm_util_pct": 100.0, "mem_used_mib": math.inf}


@runtime_checkable
class GridForecaster(Protocol):
    """A forecaster that can work from prebuilt 1 s grids (the evaluator's fast path)."""

    name: str

    def forecast_grids(self, grids: Sequence[FloatArray], target: str) -> tuple[FloatArray, FloatArray]:
        """For each grid (its last value is the origin second): (p50, p90), each (len(grids),
        len(HORIZONS_S)); p90 all NaN where the method has none."""
        ...


class _GridBaseline:
    """`forecast_batch` for every grid-based method: grid per target, then `forecast_grids`."""

    name = "baseline"
    horizons_s: tuple[int, ...] = HORIZONS_S

    def forecast_grids(self, grids: Sequence[FloatArray], target: str) -> tuple[FloatArray, FloatArray]:
        raise NotImplementedError

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        n, h = len(histories), len(self.horizons_s)
        out: dict[str, tuple[FloatArray, FloatArray]] = {}
        for target in TARGETS:
            p50 = np.full((n, h), np.nan)
            p90 = np.full((n, h), np.nan)
            rows, grids = [], []
            for i, hist in enumerate(histories):
                _, grid = one_second_grid(hist, target)
                if len(grid):
                    rows.append(i)
                    grids.append(grid)
            if grids:
                a, b = self.forecast_grids(grids, target)
                p50[rows], p90[rows] = a, b
            out[target] = (p50, p90)
        mem50, mem90 = out["mem_used_mib"]
        sm50, sm90 = out["sm_util_pct"]
        return [
            Forecast(
                horizons_s=self.horizons_s,
                mem_p50_mib=tuple(float(v) for v in mem50[i]),
                mem_p90_mib=tuple(float(v) for v in mem90[i]),
                sm_p50_pct=tuple(float(v) for v in sm50[i]),
                sm_p90_pct=tuple(float(v) for v in sm90[i]),
                source=self.name,
            )
            for i in range(n)
        ]

    def _flat(self, values: FloatArray) -> FloatArray:
        return np.repeat(values[:, None], len(self.horizons_s), axis=1)


class LastValueForecaster(_GridBaseline):
    name = "last_value"

    def forecast_grids(self, grids: Sequence[FloatArray], target: str) -> tuple[FloatArray, FloatArray]:
        last = np.array([g[-1] for g in grids], dtype=np.float64)
        return self._flat(last), np.full((len(grids), len(self.horizons_s)), np.nan)


class EwmaForecaster(_GridBaseline):
    """s_0 = x_0, s_k = alpha x_k + (1 - alpha) s_{k-1}; the forecast is s at the origin."""

    name = "ewma"

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._weights: FloatArray = np.zeros(0)

    def _weights_for(self, n: int) -> FloatArray:
        """Weights of x_0..x_{n-1} in s_{n-1}: (1-a)^(n-1) for x_0, a (1-a)^(n-1-k) for k >= 1."""
        if len(self._weights) < n:
            self._weights = self.alpha * (1 - self.alpha) ** np.arange(max(n, 256), dtype=np.float64)
        w = self._weights[:n][::-1].copy()
        w[0] = (1 - self.alpha) ** (n - 1)
        return w

    def ewma(self, grid: FloatArray) -> float:
        return float(np.dot(self._weights_for(len(grid)), grid))

    def forecast_grids(self, grids: Sequence[FloatArray], target: str) -> tuple[FloatArray, FloatArray]:
        values = np.array([self.ewma(g) for g in grids], dtype=np.float64)
        return self._flat(values), np.full((len(grids), len(self.horizons_s)), np.nan)


@dataclass(frozen=True)
class HistogramOptions:
    """Exponential buckets: bucket 0 is [0, first), bucket n starts at first (r^n - 1) / (r - 1)."""

    first_bucket: float
    max_value: float
    ratio: float = 1.05

    @property
    def num_buckets(self) -> int:
        return int(math.ceil(math.log(self.max_value * (self.ratio - 1) / self.first_bucket + 1, self.ratio))) + 1

    def bucket_of(self, values: FloatArray) -> npt.NDArray[np.int64]:
        v = np.maximum(values, 0.0)
        idx = np.floor(np.log(v * (self.ratio - 1) / self.first_bucket + 1) / math.log(self.ratio))
        return np.clip(idx, 0, self.num_buckets - 1).astype(np.int64)

    def bucket_start(self, bucket: npt.NDArray[np.int64] | int) -> FloatArray:
        b = np.asarray(bucket, dtype=np.float64)
        return np.asarray(self.first_bucket * (self.ratio**b - 1) / (self.ratio - 1), dtype=np.float64)


# sm_util_pct: 0.1 % resolution at the bottom up to 100 %; memory: 1 MiB up to 1 TiB.
HISTOGRAMS = {
    "sm_util_pct": HistogramOptions(first_bucket=0.1, max_value=100.0),
    "mem_used_mib": HistogramOptions(first_bucket=1.0, max_value=float(2**20)),
}


class VpaPercentileForecaster(_GridBaseline):
    """Median and P90 of a decaying exponential histogram of the grid (see the module docstring).

    The VPA recommender decays with a 24 h half-life over days of pod history; here the history is
    minutes and the horizon seconds, so the half-life is 60 s by default. No safety margin is added:
    the P90 is reported as it is, so its coverage can be judged."""

    name = "vpa_percentile"

    def __init__(self, half_life_s: float = 60.0, percentiles: tuple[float, float] = (0.5, 0.9)) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self.percentiles = percentiles

    def percentiles_of(self, grid: FloatArray, target: str) -> tuple[float, float]:
        opts = HISTOGRAMS[target]
        buckets = opts.bucket_of(grid)
        age = np.arange(len(grid) - 1, -1, -1, dtype=np.float64)
        weights = np.exp2(-age / self.half_life_s)
        hist = np.bincount(buckets, weights=weights, minlength=opts.num_buckets)
        cum = np.cumsum(hist)
        total = cum[-1]
        found = np.searchsorted(cum, np.array(self.percentiles) * total * (1 - 1e-12), side="left")
        found = np.minimum(found, opts.num_buckets - 1)
        # upper end of the bucket (the last bucket has none: its start)
        ends = np.where(found < opts.num_buckets - 1, opts.bucket_start(found + 1), opts.bucket_start(found))
        upper = _UPPER[target]
        return float(min(ends[0], upper)), float(min(ends[1], upper))

    def forecast_grids(self, grids: Sequence[FloatArray], target: str) -> tuple[FloatArray, FloatArray]:
        values = np.array([self.percentiles_of(g, target) for g in grids], dtype=np.float64).reshape(-1, 2)
        return self._flat(values[:, 0]), self._flat(values[:, 1])


# --------------------------------------------------------------------------------------------
# gradient-boosted trees

GBDT_WINDOW_S = 30
_LAGS = (1, 2, 3, 4, 5, 7, 10, 15, 20, 30)


def lag_features(grids: Sequence[FloatArray], cap_s: int = 600) -> FloatArray:
    """One row per grid, from its last `GBDT_WINDOW_S` seconds (left-padded with the earliest
    value): the origin value, the change since each lag, mean/std/min/max over 5, 10 and 30 s
    (relative to the origin value), the slope over 10 s, and the history length (capped at `cap_s`)."""
    n = len(grids)
    w = np.empty((n, GBDT_WINDOW_S))
    lengths = np.empty(n)
    for i, g in enumerate(grids):
        tail = g[-GBDT_WINDOW_S:]
        w[i, GBDT_WINDOW_S - len(tail) :] = tail
        w[i, : GBDT_WINDOW_S - len(tail)] = tail[0]
        lengths[i] = min(len(g), cap_s)
    return window_features(w, lengths)


def window_features(w: FloatArray, lengths: FloatArray) -> FloatArray:
    """`lag_features` from the windows themselves: (n, `GBDT_WINDOW_S`), left-padded, and the capped
    history lengths."""
    last = w[:, -1]
    cols = [last]
    cols += [last - w[:, -1 - lag] for lag in _LAGS if lag < GBDT_WINDOW_S]
    for span in (5, 10, 30):
        seg = w[:, -span:]
        cols += [seg.mean(axis=1) - last, seg.std(axis=1), seg.min(axis=1) - last, seg.max(axis=1) - last]
    x = np.arange(10, dtype=np.float64) - 4.5
    cols.append((w[:, -10:] * x).sum(axis=1) / (x * x).sum())
    cols.append(np.asarray(lengths, dtype=np.float64))
    return np.stack(cols, axis=1)


def sampled_origins(
    traces: Sequence[AppTrace], target: str, max_origins: int, rng: np.random.Generator,
    horizons_s: Sequence[int] = HORIZONS_S, from_s: float = -math.inf,
) -> tuple[list[FloatArray], FloatArray]:
    """Protocol origins of `traces` whose second is at least `from_s` (each with its whole grid before
    it, so the age and lags are those a forecaster had there), as (prefix grids, truths (n, horizons));
    at most `max_origins`, drawn with `rng` before any prefix is made, so the memory is the grids', not
    one window per application-second."""
    hmax = max(horizons_s)
    grids: list[FloatArray] = []
    lows: list[int] = []
    counts: list[int] = []
    for trace in traces:
        seconds, grid = one_second_grid(trace, target)
        lo = MIN_ORIGIN_INDEX
        if len(grid) and math.isfinite(from_s):
            lo = max(lo, math.ceil(from_s - float(seconds[0])))
        grids.append(grid)
        lows.append(lo)
        counts.append(max(0, len(grid) - hmax - lo))
    total = int(sum(counts))
    if total == 0:
        return [], np.zeros((0, len(horizons_s)))
    chosen = np.arange(total) if total <= max_origins else np.sort(rng.choice(total, max_origins, replace=False))
    ends = np.cumsum(counts)
    which = np.searchsorted(ends, chosen, side="right")
    prefixes: list[FloatArray] = []
    truths = np.empty((len(chosen), len(horizons_s)))
    for row, (k, flat) in enumerate(zip(which.tolist(), chosen.tolist(), strict=True)):
        i = lows[k] + flat - (int(ends[k]) - counts[k])  # the origin's index in its grid
        prefixes.append(grids[k][: i + 1])
        truths[row] = [grids[k][i + h] for h in horizons_s]
    return prefixes, truths


class GbdtForecaster(_GridBaseline):
    """LightGBM quantile regression (0.5, 0.9) of the change from the origin value."""

    name = "gbdt"
    length_cap_s = 600  # the history length feature's cap

    def __init__(
        self,
        *,
        n_estimators: int = 60,
        learning_rate: float = 0.1,
        num_leaves: int = 31,
        max_rows: int = 20_000,
        seed: int = 0,
    ) -> None:
        self.params: dict[str, Any] = {  # LGBMRegressor keyword arguments
            "n_estimators": n_estimators,
            "learning_rate": learning_rate,
            "num_leaves": num_leaves,
            "min_child_samples": 20,
            "max_bin": 63,
            "subsample": 0.8,
            "subsample_freq": 1,
            "colsample_bytree": 0.9,
            "random_state": seed,
            "n_jobs": 1,
            "verbose": -1,
            "deterministic": True,
        }
        self.max_rows = max_rows
        self.seed = seed
        self.models: dict[tuple[str, int, float], object] = {}
        self.trained_on: list[str] = []

    @property
    def fitted(self) -> bool:
        return bool(self.models)

    def fit(self, traces: Iterable[AppTrace]) -> GbdtForecaster:
        """Train on every origin (all horizons known) of every application, subsampled to
        `max_rows` per target. Raises ValueError when there is nothing to train on."""
        import lightgbm as lgb

        traces = list(traces)
        rng = np.random.default_rng(self.seed)
        for target in TARGETS:
            prefixes, y_all = sampled_origins(traces, target, self.max_rows, rng, self.horizons_s)
            if not prefixes:
                continue
            x = lag_features(prefixes, self.length_cap_s)
            last = x[:, 0]
            for j, h in enumerate(self.horizons_s):
                for q in (0.5, 0.9):
                    model = lgb.LGBMRegressor(objective="quantile", alpha=q, **self.params)
                    model.fit(x, y_all[:, j] - last)
                    self.models[(target, h, q)] = model
        if not self.models:
            raise ValueError("no training origin: every trace is shorter than the protocol's 10 s + 5 s")
        self.trained_on = sorted(t.app for t in traces)
        return self

    def forecast_grids(self, grids: Sequence[FloatArray], target: str) -> tuple[FloatArray, FloatArray]:
        n, h = len(grids), len(self.horizons_s)
        p50 = np.full((n, h), np.nan)
        p90 = np.full((n, h), np.nan)
        if n == 0 or (target, self.horizons_s[0], 0.5) not in self.models:
            return p50, p90
        return self.predict_features(lag_features(grids, self.length_cap_s), target)

    def predict_features(self, x: FloatArray, target: str) -> tuple[FloatArray, FloatArray]:
        """(p50, p90) from `lag_features` rows: the origin value plus the predicted changes, within the
        target's range, the P90 never under the median."""
        d50, d90 = self.predict_changes(x, target)
        last = x[:, 0][:, None]
        p50, p90 = last + d50, last + d90
        upper = _UPPER[target]
        p50 = np.clip(p50, 0.0, upper)
        p90 = np.clip(np.maximum(p90, p50), 0.0, upper)
        return p50, p90

    def predict_changes(self, x: FloatArray, target: str) -> tuple[FloatArray, FloatArray]:
        """The models' changes from the origin value, (rows, horizons) for the median and the P90."""
        d50 = np.empty((len(x), len(self.horizons_s)))
        d90 = np.empty_like(d50)
        # one thread: LightGBM's default takes every core, and on a busy node its threads wait for
        # each other (3x slower for the daemon's 64 applications on two loaded cores)
        for j, hz in enumerate(self.horizons_s):
            d50[:, j] = self.models[(target, hz, 0.5)].predict(x, num_threads=1)  # type: ignore[attr-defined]
            d90[:, j] = self.models[(target, hz, 0.9)].predict(x, num_threads=1)  # type: ignore[attr-defined]
        return d50, d90


# The manager daemon's fallback when no model loads: it needs a P90 for its recommendations and no
# training data, which is what the VPA-style percentile gives.
BaselineForecaster = VpaPercentileForecaster

BASELINE_METHODS = ("last_value", "ewma", "vpa_percentile", "gbdt")


def make_baselines(train_traces: Sequence[AppTrace] | None = None) -> list[_GridBaseline]:
    """The four baselines of the protocol; gbdt only when training traces are given."""
    out: list[_GridBaseline] = [LastValueForecaster(), EwmaForecaster(), VpaPercentileForecaster()]
    if train_traces:
        out.append(GbdtForecaster().fit(train_traces))
    return out
