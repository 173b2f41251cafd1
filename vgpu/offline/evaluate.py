"""`vgpu eval`: forecasters scored on canonical traces by the evaluation protocol (docs/evaluation.md).

    vgpu eval --trace PATH [--model PATH] [--split test|val|train|all] [--train-trace PATH ...] [--json]

The protocol, as implemented here:
1. Per application and target, the 1 s grid of `vgpu.traces.one_second_grid` (mean of the samples
   of each second, an empty second carrying the previous value forward).
2. Origins: every grid second from the 10th (index 9) to the second before the last. The forecaster
   sees only the samples with floor(t_s) <= origin second (for grid methods: the grid up to and
   including the origin, which is the same thing). The truth for horizon h is the grid value
   h seconds after the origin; an (origin, h) pair whose truth lies past the grid's end is not scored.
3. Per (target, horizon, method), pooled over applications and origins: MAE, RMSE,
   R2 = 1 - MSE / Var(truth), MAPE in % over truths != 0, coverage_p90 = share of truths <= P90 and
   pinball_p90 = mean of max(0.9 d, -0.1 d) with d = truth - P90 (both null for methods without a
   P90). Rows where a method returned NaN are left out of its `n`. Beside them, not part of the
   protocol: coverage_p90_tol, the same share with a P90 a rounding step under its truth counted as
   covered (`coverage_with_tolerance`).
4. `last_value` carries a P90 once it is fitted on training data (`LastValueMarginForecaster`): the
   origin's value plus, per target and horizon, the 90th percentile of the h-second change over the
   training applications' protocol origins, in units of capacity (memory: the application's
   `mem_total_mib`; compute: 100 %), times the evaluated application's capacity. Where an application
   states no memory capacity, the margin in MiB (the same percentile of the change itself) is added.
   Unfitted, it has no P90, as before.

`vgpu eval --online` runs the node protocol instead (vgpu/offline/online.py) and prints its figures
beside the offline ones.

`evaluate(apps, forecasters)` is the in-process API, `score_origins` the forecasts behind it (for
breakdowns such as bench/error_breakdown.py); `main(argv, prog)` the command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from vgpu.manager.baselines import (
    MIN_ORIGIN_INDEX,
    EwmaForecaster,
    GbdtForecaster,
    GridForecaster,
    LastValueForecaster,
    VpaPercentileForecaster,
)
from vgpu.manager.forecast import HORIZONS_S, Forecast, Forecaster
from vgpu.offline.splits import select, split_of
from vgpu.traces import TARGETS, AppTrace, Trace, TraceFormatError, one_second_grid, read_trace

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# "served": what the daemon serves, the per-application expert mixture (manager/experts.py) over the
# last value and the model (without the model where it does not load), learning online from each
# application's own earlier origins as the daemon does, a new application's P90 offset and scale
# starting from those of the applications scored before it (the node prior)
METHOD_ORDER = ("model", "served", "last_value", "ewma", "vpa_percentile", "gbdt")
DEFAULT_CHUNK = 4096
_FORECAST_FIELDS = {"mem_used_mib": ("mem_p50_mib", "mem_p90_mib"), "sm_util_pct": ("sm_p50_pct", "sm_p90_pct")}


@dataclass(frozen=True)
class TargetGrid:
    """One application's grid for one target and its protocol origins (indices into `values`)."""

    app: str
    seconds: npt.NDArray[np.int64]
    values: FloatArray
    origins: npt.NDArray[np.int64]
    capacity: float = math.nan  # the target's capacity (mem_total_mib; 100 for compute); NaN unknown


@dataclass(frozen=True)
class OriginScores:
    """One method's forecasts of one target at every protocol origin, in grid order (applications
    as given, then origin). `p50`, `p90` and `truth` are (n, len(HORIZONS_S)); a truth past the
    grid's end is NaN and not scored. `app`, `origin` (grid index) and `grid_len` say where each
    row comes from, for breakdowns of where the error lies."""

    p50: FloatArray
    p90: FloatArray
    truth: FloatArray
    app: tuple[str, ...]
    origin: IntArray
    grid_len: IntArray


def build_grids(apps: Sequence[AppTrace], min_index: int = MIN_ORIGIN_INDEX) -> dict[str, list[TargetGrid]]:
    """Protocol steps 1-2 for every application and target."""
    out: dict[str, list[TargetGrid]] = {t: [] for t in TARGETS}
    for app in apps:
        for target in TARGETS:
            seconds, values = one_second_grid(app, target)
            origins = np.arange(min_index, len(values) - 1, dtype=np.int64)
            if len(origins):
                out[target].append(TargetGrid(app.app, seconds, values, origins, capacity_of(app, target)))
    return out


def too_short(apps: Sequence[AppTrace], min_index: int = MIN_ORIGIN_INDEX) -> str | None:
    """Why no application of `apps` has a protocol origin (None when one has): an origin is a second
    from the (min_index + 1)th of an application's 1 s grid on with the grid value 1 s later, so an
    application needs min_index + 2 grid seconds, min_index + 1 + h for a truth at every horizon up to h."""
    first = min_index + 1 + min(HORIZONS_S)
    longest = 0
    for app in apps:
        for target in TARGETS:
            n = len(one_second_grid(app, target)[1])
            if n >= first:
                return None
            longest = max(longest, n)
    return (f"no application is long enough: the protocol's first origin is the {min_index + 1}th second of an "
            f"application's 1 s grid and a horizon of h s needs h more, so its samples must cover {first} seconds "
            f"({min_index + 1 + max(HORIZONS_S)} for every horizon up to {max(HORIZONS_S)} s); the longest here "
            f"covers {longest}")


def capacity_of(app: AppTrace, target: str) -> float:
    """100 for compute; the largest stated `mem_total_mib` for memory (NaN where none is)."""
    if target == "sm_util_pct":
        return 100.0
    total = app.column("mem_total_mib")
    ok = np.isfinite(total) & (total > 0)
    return float(total[ok].max()) if ok.any() else math.nan


def pinball_p90(p90: FloatArray, truth: FloatArray) -> float:
    """Mean pinball loss of a P90: max(0.9 d, -0.1 d) with d = truth - P90."""
    d = truth - p90
    return float(np.mean(np.maximum(0.9 * d, -0.1 * d)))


class LastValueMarginForecaster(LastValueForecaster):
    """`last_value` with the fixed-margin P90 of the protocol (module docstring, step 4). `fit`
    learns the margins; `forecast_grids_cap` applies them (the evaluator passes each grid's
    capacity); `forecast_grids` without capacities uses the margins in native units."""

    name = "last_value"

    def __init__(self) -> None:
        # (target, horizon index) -> (margin in units of capacity or NaN, margin in native units)
        self.margins: dict[tuple[str, int], tuple[float, float]] = {}

    @property
    def fitted(self) -> bool:
        return bool(self.margins)

    def fit(self, apps: Sequence[AppTrace], min_index: int = MIN_ORIGIN_INDEX) -> LastValueMarginForecaster:
        """Margins from every protocol origin of `apps` whose truth lies in its grid."""
        self.margins = margins_from_grids(build_grids(apps, min_index))
        return self

    def forecast_grids_cap(
        self, grids: Sequence[FloatArray], target: str, capacities: FloatArray
    ) -> tuple[FloatArray, FloatArray]:
        p50, _ = super().forecast_grids(grids, target)
        p90 = np.full_like(p50, np.nan)
        for j in range(len(self.horizons_s)):
            rel, native = self.margins.get((target, j), (math.nan, math.nan))
            add = np.where(np.isfinite(capacities) & math.isfinite(rel), rel * capacities, native)
            p90[:, j] = p50[:, j] + add
        if target == "sm_util_pct":
            p90 = np.minimum(p90, 100.0)
        return p50, p90

    def forecast_grids(self, grids: Sequence[FloatArray], target: str) -> tuple[FloatArray, FloatArray]:
        return self.forecast_grids_cap(grids, target, np.full(len(grids), np.nan))


def margins_from_grids(grids: Mapping[str, Sequence[TargetGrid]]) -> dict[tuple[str, int], tuple[float, float]]:
    """(target, horizon index) -> (90th percentile of the h-second change / capacity over the grids
    that state a capacity (NaN if none does), 90th percentile of the change itself)."""
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for target, tgrids in grids.items():
        for j, h in enumerate(HORIZONS_S):
            rel_parts, abs_parts = [], []
            for g in tgrids:
                idx = g.origins[g.origins + h < len(g.values)]
                change = g.values[idx + h] - g.values[idx]
                abs_parts.append(change)
                if math.isfinite(g.capacity) and g.capacity > 0:
                    rel_parts.append(change / g.capacity)
            absolute = np.concatenate(abs_parts) if abs_parts else np.zeros(0)
            relative = np.concatenate(rel_parts) if rel_parts else np.zeros(0)
            if len(absolute):
                out[(target, j)] = (float(np.percentile(relative, 90)) if len(relative) else math.nan,
                                    float(np.percentile(absolute, 90)))
    return out


def truths_of(grid: TargetGrid) -> FloatArray:
    """(len(origins), len(HORIZONS_S)); NaN where origin + h is past the grid's end."""
    idx = grid.origins[:, None] + np.asarray(HORIZONS_S)[None, :]
    ok = idx < len(grid.values)
    out = np.full(idx.shape, np.nan)
    out[ok] = grid.values[idx[ok]]
    return out


# A P90 this close under its truth is a rounding step, not a miss: relative to the truth's size, with 1
# as the smallest scale so that a truth of 0 is not judged to the last bit.
ROUNDING_TOL = 1e-9


def coverage_with_tolerance(p90: FloatArray, truth: FloatArray) -> float:
    """The share of truths at or under the P90 plus `ROUNDING_TOL` x max(1, |truth|). Beside the
    protocol's exact `coverage_p90`, not instead of it: on a series that holds one value for long
    stretches (flat memory, on/off compute) a P90 computed as a weighted mean of experts that all say
    that value can land a rounding step under it, which the exact test counts as a miss that costs no
    pinball loss; this figure says how much of the coverage those carry."""
    return float(np.mean(truth <= p90 + ROUNDING_TOL * np.maximum(1.0, np.abs(truth))))


def pooled_metrics(p50: FloatArray, p90: FloatArray, truth: FloatArray) -> dict[str, float | int | None]:
    """Protocol step 3 for one (target, horizon, method)."""
    ok = np.isfinite(p50) & np.isfinite(truth)
    n = int(ok.sum())
    if n == 0:
        return {"mae": None, "rmse": None, "r2": None, "mape": None, "coverage_p90": None, "coverage_p90_tol": None,
                "pinball_p90": None, "n": 0}
    err = p50[ok] - truth[ok]
    y = truth[ok]
    mse = float(np.mean(err**2))
    var = float(np.var(y))
    nonzero = y != 0
    has90 = np.isfinite(p90) & np.isfinite(truth)
    return {
        "mae": float(np.mean(np.abs(err))),
        "rmse": math.sqrt(mse),
        "r2": 1.0 - mse / var if var > 0 else None,
        "mape": float(np.mean(np.abs(err[nonzero]) / np.abs(y[nonzero])) * 100.0) if nonzero.any() else None,
        "coverage_p90": float(np.mean(truth[has90] <= p90[has90])) if has90.any() else None,
        "coverage_p90_tol": coverage_with_tolerance(p90[has90], truth[has90]) if has90.any() else None,
        "pinball_p90": pinball_p90(p90[has90], truth[has90]) if has90.any() else None,
        "n": n,
    }


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _grid_method_forecasts(
    fc: GridForecaster, tgrids: Sequence[TargetGrid], target: str, chunk: int
) -> tuple[FloatArray, FloatArray]:
    prefixes = [g.values[: i + 1] for g in tgrids for i in g.origins]
    caps = np.array([g.capacity for g in tgrids for _ in g.origins], dtype=np.float64)
    with_cap = getattr(fc, "forecast_grids_cap", None)
    p50 = np.empty((len(prefixes), len(HORIZONS_S)))
    p90 = np.empty_like(p50)
    for s in _chunks(len(prefixes), chunk):
        if with_cap is not None:
            p50[s], p90[s] = with_cap(prefixes[s], target, caps[s])
        else:
            p50[s], p90[s] = fc.forecast_grids(prefixes[s], target)
    return p50, p90


def _prefix(app: AppTrace, end: int) -> AppTrace:
    return AppTrace(app=app.app, t_s=app.t_s[:end], columns={k: v[:end] for k, v in app.columns.items()}, gpu=app.gpu)


def _history_method_forecasts(
    fc: Forecaster, apps: Mapping[str, AppTrace], grids: Mapping[str, Sequence[TargetGrid]], chunk: int
) -> dict[str, tuple[FloatArray, FloatArray]]:
    """Any Forecaster: one call per chunk of (application, origin second) histories, each history
    forecast once for both targets."""
    wanted: dict[str, set[int]] = {}
    for tgrids in grids.values():
        for g in tgrids:
            wanted.setdefault(g.app, set()).update(int(s) for s in g.seconds[g.origins])
    keys = [(app, sec) for app in wanted for sec in sorted(wanted[app])]
    results: dict[tuple[str, int], Forecast] = {}
    for s in _chunks(len(keys), chunk):
        histories = []
        for app_id, sec in keys[s]:
            app = apps[app_id]
            # the samples with floor(t_s) <= sec, i.e. t_s < sec + 1
            histories.append(_prefix(app, int(np.searchsorted(app.t_s, sec + 1, side="left"))))
        forecasts = fc.forecast_batch(histories)
        if len(forecasts) != len(histories):
            raise ValueError(f"{fc.name}: {len(forecasts)} forecasts for {len(histories)} histories")
        results.update(zip(keys[s], forecasts, strict=True))
    out = {}
    for target, tgrids in grids.items():
        f50, f90 = _FORECAST_FIELDS[target]
        fcs = [results[(g.app, int(sec))] for g in tgrids for sec in g.seconds[g.origins]]
        shape = (len(fcs), len(HORIZONS_S))
        out[target] = (np.array([_by_horizon(f, f50) for f in fcs], dtype=np.float64).reshape(shape),
                       np.array([_by_horizon(f, f90) for f in fcs], dtype=np.float64).reshape(shape))
    return out


def _by_app(apps: Trace | Mapping[str, AppTrace] | Sequence[AppTrace]) -> dict[str, AppTrace]:
    if isinstance(apps, Trace):
        return dict(apps.apps)
    if isinstance(apps, Mapping):
        return dict(apps)
    return {a.app: a for a in apps}


def score_origins(
    apps: Trace | Mapping[str, AppTrace] | Sequence[AppTrace],
    forecasters: Sequence[Forecaster],
    *,
    chunk: int = DEFAULT_CHUNK,
    timings: dict[str, float] | None = None,
) -> dict[str, dict[str, OriginScores]]:
    """Protocol steps 1-2: every forecaster's forecasts at every origin, {method: {target: scores}}.
    A forecaster with `forecast_grids` is fed grids directly; any other gets raw-sample histories
    in batches of `chunk`. `timings`, when given, receives seconds spent per method."""
    app_map = _by_app(apps)
    grids = build_grids(list(app_map.values()))
    where: dict[str, tuple[FloatArray, tuple[str, ...], IntArray, IntArray]] = {}
    for target, tgrids in grids.items():
        truth = np.concatenate([truths_of(g) for g in tgrids]) if tgrids else np.zeros((0, len(HORIZONS_S)))
        where[target] = (
            truth,
            tuple(g.app for g in tgrids for _ in g.origins),
            np.concatenate([g.origins for g in tgrids]) if tgrids else np.zeros(0, dtype=np.int64),
            np.concatenate([np.full(len(g.origins), len(g.values)) for g in tgrids]).astype(np.int64)
            if tgrids else np.zeros(0, dtype=np.int64),
        )
    out: dict[str, dict[str, OriginScores]] = {}
    for fc in forecasters:
        started = time.perf_counter()
        if isinstance(fc, GridForecaster) and hasattr(fc, "forecast_grids"):
            preds = {t: _grid_method_forecasts(fc, grids[t], t, chunk) for t in grids}
        else:
            preds = _history_method_forecasts(fc, app_map, grids, chunk)
        out[fc.name] = {t: OriginScores(p50, p90, *where[t]) for t, (p50, p90) in preds.items()}
        if timings is not None:
            timings[fc.name] = time.perf_counter() - started
    return out


def _by_horizon(f: Forecast, name: str) -> list[float]:
    values = dict(zip(f.horizons_s, getattr(f, name), strict=True))
    return [values.get(h, math.nan) for h in HORIZONS_S]


def evaluate(
    apps: Trace | Mapping[str, AppTrace] | Sequence[AppTrace],
    forecasters: Sequence[Forecaster],
    *,
    chunk: int = DEFAULT_CHUNK,
    timings: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Score `forecasters` on `apps` by the protocol. Returns
    {"apps", "samples", "results": [{"target", "horizon_s", "method", "mae", "rmse", "r2", "mape",
    "coverage_p90", "coverage_p90_tol", "n"}]}, rows ordered by target, horizon, then the forecasters' order.
    `chunk` and `timings` as for `score_origins`."""
    app_map = _by_app(apps)
    scores = score_origins(app_map, forecasters, chunk=chunk, timings=timings)
    results = []
    for target in TARGETS:
        for j, h in enumerate(HORIZONS_S):
            for fc in forecasters:
                sc = scores[fc.name][target]
                ok = np.isfinite(sc.truth[:, j])
                row: dict[str, Any] = {"target": target, "horizon_s": h, "method": fc.name}
                row.update(pooled_metrics(sc.p50[ok, j], sc.p90[ok, j], sc.truth[ok, j]))
                results.append(row)
    return {"apps": len(app_map), "samples": sum(len(a) for a in app_map.values()), "results": results}


# --------------------------------------------------------------------------------------------
# the command


def _warn(prog: str, message: str) -> None:
    print(f"{prog}: {message}", file=sys.stderr)


def load_model(path: str | None, prog: str) -> Forecaster | None:
    """The trained model through `vgpu.manager.predictor.load_forecaster` (imported lazily:
    torch is heavy and the baselines need none of it). None, with the reason on stderr, where no
    model is given or it cannot be loaded."""
    try:
        from vgpu.manager import predictor  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - any import failure means: no model rows
        _warn(prog, f"model rows absent: cannot import vgpu.manager.predictor ({exc})")
        return None
    if path is None:
        default = getattr(predictor, "DEFAULT_MODEL_PATH", None) or getattr(predictor, "DEFAULT_CHECKPOINT", None)
        if default is None or not Path(default).exists():
            _warn(prog, "model rows absent: no --model given and no default checkpoint shipped")
            return None
        path = str(default)
    try:
        model = predictor.load_forecaster(path)
    except Exception as exc:  # noqa: BLE001 - a model that does not load is reported, not fatal
        _warn(prog, f"model rows absent: cannot load {path}: {exc}")
        return None
    if getattr(model, "name", None) != "model":
        try:
            model.name = "model"
        except AttributeError:
            return _Renamed(model)
    return model


class _Renamed:
    """Reports a forecaster under the method name `model`."""

    name = "model"

    def __init__(self, inner: Forecaster) -> None:
        self.inner = inner

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        return self.inner.forecast_batch(histories)


def training_traces_of(model: object) -> list[str]:
    """Trace files a model says it was trained on (checkpoint metadata `training`), best effort."""
    meta = None
    for holder in (model, getattr(model, "inner", None)):
        for candidate in (holder, getattr(holder, "checkpoint", None)):
            meta = meta or getattr(candidate, "metadata", None)
    training = getattr(meta, "training", None)
    if not isinstance(training, Mapping):
        return []
    for key in ("traces", "trace_files", "files", "data"):
        entries = training.get(key)
        if isinstance(entries, str):
            entries = [entries]
        if isinstance(entries, list):
            paths = [e if isinstance(e, str) else e.get("path") for e in entries if isinstance(e, str | dict)]
            return [p for p in paths if isinstance(p, str)]
    return []


def gbdt_training_apps(
    train_paths: Sequence[str], eval_trace: Trace, split: str, prog: str, reader: Callable[[str], Trace] = read_trace
) -> tuple[list[AppTrace], str]:
    """The applications gbdt trains on: the "train" split of the given trace files; where none is
    given, the "train" split of the evaluated trace itself (when the evaluation is on a held-out
    split). Returns (apps, a description)."""
    if train_paths:
        apps: list[AppTrace] = []
        for p in train_paths:
            t = reader(p)
            apps += [a for a in t.apps.values() if split_of(a.app) == "train"]
        return apps, f"train split of {', '.join(train_paths)}"
    if split in ("test", "val"):
        return [a for a in eval_trace.apps.values() if split_of(a.app) == "train"], (
            f"train split of {eval_trace.source} (no --train-trace and none named by the model)"
        )
    return [], "none: give --train-trace (evaluating on all applications leaves no held-out training data)"


def _format_table(report: Mapping[str, Any], results_key: str = "results", title: str | None = None) -> str:
    lines = [title or f"{report['apps']} apps, {report['samples']} samples"]
    lines.append(f"{'target':<13} {'h':>2} {'method':<15} {'MAE':>10} {'RMSE':>10} {'R2':>7} {'MAPE%':>8} "
                 f"{'cov90':>6} {'pinb90':>9} {'n':>7}")

    def fmt(v: object, spec: str) -> str:
        return format(v, spec) if isinstance(v, float | int) else format("-", ">" + spec.split(".")[0])

    for r in report[results_key]:
        lines.append(
            f"{r['target']:<13} {r['horizon_s']:>2} {r['method']:<15} {fmt(r['mae'], '10.3f')} "
            f"{fmt(r['rmse'], '10.3f')} {fmt(r['r2'], '7.3f')} {fmt(r['mape'], '8.2f')} "
            f"{fmt(r['coverage_p90'], '6.3f')} {fmt(r.get('pinball_p90'), '9.3f')} {r['n']:>7}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "vgpu eval") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Score the forecaster and the baselines (last value, EWMA, VPA percentile, GBDT) on a canonical trace: "
        "a CSV (or .csv.gz) of one row per application and sample with columns t_s, app, mem_used_mib and/or "
        "sm_util_pct, optional gpu, mem_total_mib, power_w and more. Per target and horizon 1-5 s on a 1 s grid: "
        "MAE, RMSE, R2, MAPE, P90 coverage and pinball loss. The format and the protocol: docs/evaluation.md "
        "(\"The trace format\", \"Evaluation\"); `vgpu trace convert` makes such traces from datasets."))
    parser.add_argument("--trace", required=True, help="canonical trace to evaluate on")
    parser.add_argument("--model", default=None, help="forecaster checkpoint (default: the shipped one)")
    parser.add_argument("--split", default=None, choices=("test", "val", "train", "all"),
                        help="applications to score, by vgpu.offline.splits (default: test; all with --online)")
    parser.add_argument("--train-trace", action="append", default=[],
                        help="trace gbdt and the last value's margin learn from (its train split); repeatable")
    parser.add_argument("--methods", default=",".join(METHOD_ORDER),
                        help=f"comma-separated subset of {','.join(METHOD_ORDER)}")
    parser.add_argument("--online", action="store_true",
                        help="also run the node protocol (one clock, learning as it goes); see vgpu/offline/online.py")
    parser.add_argument("--clock", default="auto", choices=("auto", "shared", "per-app"),
                        help="--online: the trace's clocks (default: from its metadata, else guessed; reported)")
    parser.add_argument("--refit-every-s", type=int, default=1800, help="--online: gbdt re-fit period, node seconds")
    parser.add_argument("--learn-every-s", type=int, default=60,
                        help="--online: how often the last value's margin (and a model's learn hook) learn")
    parser.add_argument("--node-learn-every-s", type=int, default=3600,
                        help="--online: how often `served` runs a node-local trees round, node seconds "
                             "(default 3600, the daemon's manager.learn_interval_s); 0: never")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHOD_ORDER)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {METHOD_ORDER}")
    if args.refit_every_s < 1 or args.learn_every_s < 1 or args.node_learn_every_s < 0:
        parser.error("--refit-every-s and --learn-every-s must be at least 1, --node-learn-every-s at least 0")
    split: Literal["train", "val", "test", "all"] = args.split or ("all" if args.online else "test")

    try:
        trace = read_trace(args.trace)
    except TraceFormatError as exc:
        _warn(prog, str(exc))
        return 1
    note = trace.skipped_rows_note()
    if note:
        _warn(prog, note)
    apps = select(trace.apps, split)
    if not apps:
        _warn(prog, f"no application of {args.trace} falls in the {split!r} split"
              + ("" if args.split else " (the default; --split all scores every application)"))
        return 1
    short = too_short(list(apps.values()))
    if short is not None:  # not one origin: any table would be empty
        _warn(prog, short)
        return 1
    if args.split is None and len(apps) < len(trace.apps):
        # a node's own recording was never trained on, and its owner may expect every application scored
        _warn(prog, f"scoring the {split!r} split: {len(apps)} of {len(trace.apps)} applications (held out from "
              "training by vgpu.offline.splits; --split all scores every one)")

    forecasters: list[Forecaster] = []
    model = load_model(args.model, prog) if "model" in methods or "served" in methods else None
    if model is not None and "model" in methods:
        forecasters.append(model)
    if "served" in methods:
        from vgpu.manager.experts import make_served  # noqa: PLC0415 - only for this method

        forecasters.append(make_served(model, name="served", local=True))  # the local slot empty: a fresh node
    train_apps: list[AppTrace] = []
    described = ""
    if "gbdt" in methods or "last_value" in methods:
        train_paths = list(args.train_trace) or training_traces_of(model)
        try:
            train_apps, described = gbdt_training_apps(train_paths, trace, split, prog)
        except TraceFormatError as exc:
            where = ""
            if not args.train_trace:  # the paths came from the model's metadata: say where they were sought
                sought = ", ".join(f"{p} -> {Path(p).resolve()}" for p in train_paths)
                where = (f" (the model names its training trace(s) {sought}, looked up relative to the working "
                         f"directory {Path.cwd()}; give --train-trace PATH)")
            _warn(prog, f"no training data for gbdt and the last value's margin: {exc}{where}")
    if "last_value" in methods:
        if train_apps:
            forecasters.append(LastValueMarginForecaster().fit(train_apps))
        else:
            forecasters.append(LastValueForecaster())
            _warn(prog, "last_value has no P90: no training data for its margin (give --train-trace)")
    baseline_factories: dict[str, Callable[[], Forecaster]] = {
        "ewma": EwmaForecaster,
        "vpa_percentile": VpaPercentileForecaster,
    }
    forecasters += [baseline_factories[m]() for m in METHOD_ORDER if m in methods and m in baseline_factories]
    if "gbdt" in methods:
        if train_apps:
            started = time.perf_counter()
            try:
                forecasters.append(GbdtForecaster().fit(train_apps))
                _warn(prog, f"gbdt trained on {len(train_apps)} apps ({described}) in "
                      f"{time.perf_counter() - started:.1f} s")
            except ValueError as exc:
                _warn(prog, f"gbdt rows absent: {exc}")
        elif described:
            _warn(prog, f"gbdt rows absent: no training applications ({described})")

    timings: dict[str, float] = {}
    report = evaluate(apps, forecasters, timings=timings)
    _warn(prog, "seconds per method: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    if trace.metadata.get("derived"):
        report["derived"] = True
        report["generator"] = trace.metadata.get("generator")
    if not args.online:
        if args.json:
            print(json.dumps(report))
        else:
            print(_format_table(report))
        return 0

    from vgpu.offline import online  # noqa: PLC0415

    try:
        layout = online.node_layout(list(apps.values()), args.clock, trace.metadata)
        online_methods = online.default_methods(methods, model, refit_every_s=args.refit_every_s,
                                                learn_every_s=args.learn_every_s,
                                                trees_every_s=args.node_learn_every_s)
        online_timings: dict[str, float] = {}
        online_report = online.evaluate_online(layout, online_methods, timings=online_timings)
    except ValueError as exc:
        _warn(prog, f"online: {exc}")
        return 1
    _warn(prog, f"online clock: {layout.clock} ({layout.why})")
    _warn(prog, "online seconds per method: " + ", ".join(f"{k} {v:.1f}" for k, v in online_timings.items()))
    rounds = {m.name: m.rounds for m in online_methods if isinstance(m, online.ServedOnline)}
    if rounds:
        online_report["node_learning"] = rounds
        for name, entries in rounds.items():
            promoted = sum(e.get("event") == "promoted" for e in entries)
            _warn(prog, f"online: {name} ran {len(entries)} node-local trees rounds, {promoted} promoted")
    both = {"offline": report, "online": online_report}
    if args.json:
        print(json.dumps(both))
    else:
        print(_format_table(report, title=f"OFFLINE: {report['apps']} apps, {report['samples']} samples"))
        print()
        head = (f"ONLINE ({online_report['clock']} clock: {online_report['clock_why']}); "
                f"timeline {online_report['timeline_s'][0]}-{online_report['timeline_s'][1]} s")
        print(_format_table(online_report, "results", head))
        for half in ("first_half", "second_half"):
            print()
            print(_format_table(online_report, half, f"ONLINE, {half.replace('_', ' ')} of the timeline "
                                f"(split at {online_report['half_split_s']:.0f} s)"))
    return 0
