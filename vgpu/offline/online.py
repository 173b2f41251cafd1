"""`vgpu eval --online`: the node protocol of ../shared/TRACE_FORMAT.md, as implemented here.

1. **One clock.** The trace's `t_s` is the node's clock (`clock="shared"`). A trace whose clocks are per
   application (`clock="per-app"`) is laid out end to end: applications in the order of their first
   row, each shifted by a whole number of seconds (so its 1 s grid is unchanged) to start one second
   after the previous one's last sample. `clock="auto"` takes the trace's `#meta` `clock` where it has
   one, else per-app when there are several applications and every one starts within its first
   minute (t_s < 60, offsets from its own start), else shared. The report says which and why.
2. **Grid, origins, horizons, metrics** as offline (vgpu/offline/evaluate.py), for every application.
3. **No peeking.** Time advances second by second over the origins. At origin second T a method sees
   only the samples with floor(t_s) <= T (the end of second T, as offline) of every application, and
   the grid seconds <= T; a truth (second k + h) is usable for learning only once k + h <= T. This is
   enforced by construction: `NodeView` copies samples and grid values into buffers as time advances,
   and hands out views of those buffers; what lies past T has not been written (it is NaN), so not
   even a method that reads past the end of an array (or a view's base) can see it.
4. **Every origin counts**, from the node's first application on; a learner pays for its warm-up (a
   learner with nothing learned yet forecasts the last value, P90 included).
5. **Deterministic:** fixed seeds, time order, ties broken by the applications' order.

Methods (`OnlineMethod`: `learn(view, now_s)` when due, then `forecast(view, now_s, apps, target)`):
- `last_value`: P50 the origin value; P90 plus the margin of evaluate.LastValueMarginForecaster
  re-learned every `learn_every_s` from every visible (origin, truth) pair of the node;
- `ewma`, `vpa_percentile`: as offline (they adapt through the application's own history only);
- `gbdt`: evaluate's GbdtForecaster re-fitted every `refit_every_s` on everything visible so far;
- any `Forecaster` (the model): `forecast_batch` on the visible histories; if it has a method
  `learn(histories, now_s)` (the update hook), it is called every `learn_every_s` with every
  application's visible samples;
- `served`: what the daemon serves (manager/experts.py `make_served`, as vgpu/daemon/serve.py builds
  it): the per-application expert mixture over the last value, the model and the node-local slot,
  the slot empty as on a fresh node (no local model promoted yet). It is a `Forecaster` run as above,
  one call per second in time order, so each application's weights and P90 offset learn from its own
  earlier origins, from the truths of seconds that have passed (the mixture scores a second once a
  later second's sample is seen); a new application's P90 offset and scale start from the node prior,
  the running means of the streams the node scored before it (manager/experts.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from vgpu.manager.baselines import MIN_ORIGIN_INDEX, GbdtForecaster, GridForecaster
from vgpu.manager.forecast import HORIZONS_S, Forecaster
from vgpu.offline.evaluate import (
    _FORECAST_FIELDS,
    LastValueMarginForecaster,
    TargetGrid,
    _by_horizon,
    margins_from_grids,
    pooled_metrics,
    too_short,
)
from vgpu.traces import ALL_NUMERIC, TARGETS, AppTrace, Trace, one_second_grid

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
NH = len(HORIZONS_S)


@dataclass(frozen=True)
class NodeLayout:
    apps: list[AppTrace]
    clock: str  # "shared" or "per-app"
    why: str
    shift_s: dict[str, int]


def node_layout(
    apps: Sequence[AppTrace], clock: str = "auto", metadata: Mapping[str, Any] | None = None, gap_s: int = 1
) -> NodeLayout:
    """Protocol step 1 (module docstring)."""
    apps = [a for a in apps if len(a)]
    if clock == "auto":
        stated = (metadata or {}).get("clock")
        if stated in ("shared", "per-app"):
            clock, why = str(stated), f"the trace's metadata says clock={stated}"
        elif len(apps) > 1 and all(float(a.t_s[0]) < 60.0 for a in apps):
            clock, why = "per-app", "every application starts within its first minute (t_s < 60): per-application clocks"
        else:
            clock, why = "shared", "the applications' times lie on one time line (not all start at t_s < 60)"
    else:
        why = "as asked (--clock)"
    if clock not in ("shared", "per-app"):
        raise ValueError(f"clock must be auto, shared or per-app, got {clock!r}")
    if clock == "shared":
        return NodeLayout(list(apps), "shared", why, {a.app: 0 for a in apps})
    out, shifts = [], {}
    cursor = 0
    for a in apps:
        shift = cursor - int(math.floor(float(a.t_s[0])))
        out.append(AppTrace(a.app, a.t_s + shift, dict(a.columns), gpu=a.gpu))
        shifts[a.app] = shift
        cursor = int(math.floor(float(a.t_s[-1]) + shift)) + 1 + gap_s
    return NodeLayout(out, "per-app", why + "; laid end to end in the order of their first rows", shifts)


class NodeView:
    """Everything of the node up to the current second, in buffers filled as time advances."""

    def __init__(self, apps: Sequence[AppTrace]) -> None:
        self.apps = {a.app: a for a in apps}
        self.order = [a.app for a in apps]
        self._t = {a.app: np.full(len(a), np.nan) for a in apps}
        self._cols = {a.app: {c: np.full(len(a), np.nan) for c in a.columns if c in ALL_NUMERIC} for a in apps}
        self._n = dict.fromkeys(self.order, 0)
        self._first_s = {a.app: int(math.floor(float(a.t_s[0]))) for a in apps}
        # the grids are the evaluator's (built from all samples); the view copies them second by second
        self._full_grid: dict[tuple[str, str], tuple[int, FloatArray]] = {}
        self._grid: dict[tuple[str, str], FloatArray] = {}
        self._grid_n: dict[tuple[str, str], int] = {}
        for a in apps:
            for target in TARGETS:
                seconds, values = one_second_grid(a, target)
                if len(values):
                    self._full_grid[(a.app, target)] = (int(seconds[0]), values)
                    self._grid[(a.app, target)] = np.full(len(values), np.nan)
                    self._grid_n[(a.app, target)] = 0
        self._capacity = dict.fromkeys(self.order, math.nan)
        self.now_s: int | None = None
        # applications with an origin this second (either target), in node order; set by the evaluator
        self.origin_apps: tuple[str, ...] = ()

    def advance(self, now_s: int) -> None:
        """Make visible every sample with floor(t_s) <= now_s and every grid second <= now_s."""
        if self.now_s is not None and now_s < self.now_s:
            raise ValueError("time only moves forward")
        self.now_s = now_s
        for app_id in self.order:
            if self._first_s[app_id] > now_s:
                continue
            a = self.apps[app_id]
            n0 = self._n[app_id]
            if n0 < len(a):
                n1 = int(np.searchsorted(a.t_s, now_s + 1, side="left"))
                if n1 > n0:
                    self._t[app_id][n0:n1] = a.t_s[n0:n1]
                    for c, buf in self._cols[app_id].items():
                        buf[n0:n1] = a.columns[c][n0:n1]
                    self._n[app_id] = n1
                    total = a.column("mem_total_mib")[n0:n1]
                    ok = np.isfinite(total) & (total > 0)
                    if ok.any():
                        self._capacity[app_id] = float(np.nanmax([self._capacity[app_id], float(total[ok].max())]))
            for target in TARGETS:
                key = (app_id, target)
                if key not in self._full_grid:
                    continue
                start, values = self._full_grid[key]
                g0 = self._grid_n[key]
                g1 = min(len(values), now_s - start + 1)
                if g1 > g0:
                    self._grid[key][g0:g1] = values[g0:g1]
                    self._grid_n[key] = g1

    def grid(self, app: str, target: str) -> FloatArray:
        """The application's grid up to now (empty if it has none yet)."""
        key = (app, target)
        if key not in self._grid:
            return np.zeros(0)
        return self._grid[key][: self._grid_n[key]]

    def grid_start_s(self, app: str, target: str) -> int:
        return self._full_grid[(app, target)][0]

    def capacity(self, app: str, target: str) -> float:
        return 100.0 if target == "sm_util_pct" else self._capacity[app]

    def history(self, app: str) -> AppTrace:
        n = self._n[app]
        return AppTrace(app, self._t[app][:n], {c: b[:n] for c, b in self._cols[app].items()}, gpu=self.apps[app].gpu)

    def visible_apps(self) -> list[AppTrace]:
        return [self.history(a) for a in self.order if self._n[a] > 0]

    def visible_grids(self, min_index: int = MIN_ORIGIN_INDEX) -> dict[str, list[TargetGrid]]:
        """Every visible grid as a TargetGrid (its origins: those with at least one known truth)."""
        out: dict[str, list[TargetGrid]] = {t: [] for t in TARGETS}
        for app in self.order:
            for target in TARGETS:
                g = self.grid(app, target)
                origins = np.arange(min_index, len(g) - 1, dtype=np.int64)
                if len(origins):
                    out[target].append(TargetGrid(app, np.zeros(0, np.int64), g, origins, self.capacity(app, target)))
        return out


class OnlineMethod(Protocol):
    name: str

    def learn(self, view: NodeView, now_s: int) -> None: ...

    def forecast(self, view: NodeView, now_s: int, apps: Sequence[str], target: str) -> tuple[FloatArray, FloatArray]: ...


def _last(view: NodeView, apps: Sequence[str], target: str) -> tuple[FloatArray, FloatArray]:
    last = np.array([view.grid(a, target)[-1] for a in apps], dtype=np.float64)
    flat = np.repeat(last[:, None], NH, axis=1)
    return flat, flat.copy()


class GridOnline:
    """A grid forecaster that does not learn (ewma, vpa_percentile)."""

    def __init__(self, fc: GridForecaster) -> None:
        self.fc = fc
        self.name = fc.name

    def learn(self, view: NodeView, now_s: int) -> None:
        return None

    def forecast(self, view: NodeView, now_s: int, apps: Sequence[str], target: str) -> tuple[FloatArray, FloatArray]:
        return self.fc.forecast_grids([view.grid(a, target) for a in apps], target)


class MarginOnline:
    """last_value with the fixed-margin P90, the margins re-learned from the node every `every_s`."""

    name = "last_value"

    def __init__(self, every_s: int = 60) -> None:
        self.fc = LastValueMarginForecaster()
        self.every_s = every_s
        self._last_s: int | None = None

    def learn(self, view: NodeView, now_s: int) -> None:
        if self._last_s is None or now_s - self._last_s >= self.every_s:
            self.fc.margins = margins_from_grids(view.visible_grids())
            self._last_s = now_s

    def forecast(self, view: NodeView, now_s: int, apps: Sequence[str], target: str) -> tuple[FloatArray, FloatArray]:
        if not self.fc.fitted:
            return _last(view, apps, target)
        caps = np.array([view.capacity(a, target) for a in apps], dtype=np.float64)
        p50, p90 = self.fc.forecast_grids_cap([view.grid(a, target) for a in apps], target, caps)
        return p50, np.where(np.isfinite(p90), p90, p50)


class GbdtOnline:
    """gbdt re-fitted every `refit_every_s` on every visible application; the last value until the
    first fit succeeds."""

    name = "gbdt"

    def __init__(self, refit_every_s: int = 1800, make: Callable[[], GbdtForecaster] = GbdtForecaster) -> None:
        self.refit_every_s = refit_every_s
        self.make = make
        self.fc: GbdtForecaster | None = None
        self._last_s: int | None = None
        self.fits = 0
        self.fit_s = 0.0

    def learn(self, view: NodeView, now_s: int) -> None:
        if self._last_s is not None and now_s - self._last_s < self.refit_every_s:
            return
        if self._last_s is None:
            self._last_s = now_s  # the first fit is due one period after the node starts
            return
        self._last_s = now_s
        started = time.perf_counter()
        try:
            self.fc = self.make().fit(view.visible_apps())
            self.fits += 1
        except ValueError:
            pass  # nothing to learn from yet
        self.fit_s += time.perf_counter() - started

    def forecast(self, view: NodeView, now_s: int, apps: Sequence[str], target: str) -> tuple[FloatArray, FloatArray]:
        if self.fc is None:
            return _last(view, apps, target)
        p50, p90 = self.fc.forecast_grids([view.grid(a, target) for a in apps], target)
        last50, _ = _last(view, apps, target)
        return np.where(np.isfinite(p50), p50, last50), np.where(np.isfinite(p90), p90, last50)


class HistoryOnline:
    """Any Forecaster on the visible raw histories; its `learn(histories, now_s)` hook, where it has
    one, is called every `every_s`. Forecasts of both targets are made in one call per second."""

    def __init__(self, fc: Forecaster, every_s: int = 300) -> None:
        self.fc = fc
        self.name = fc.name
        self.every_s = every_s
        self._last_s: int | None = None
        self._cache: tuple[int, tuple[str, ...], list[Any]] | None = None

    def learn(self, view: NodeView, now_s: int) -> None:
        hook = getattr(self.fc, "learn", None)
        if hook is None:
            return
        if self._last_s is None or now_s - self._last_s >= self.every_s:
            hook(view.visible_apps(), float(now_s + 1))
            self._last_s = now_s

    def forecast(self, view: NodeView, now_s: int, apps: Sequence[str], target: str) -> tuple[FloatArray, FloatArray]:
        if self._cache is None or self._cache[0] != now_s or not set(apps) <= set(self._cache[1]):
            names = tuple(view.origin_apps) if set(apps) <= set(view.origin_apps) else tuple(apps)
            self._cache = (now_s, names, self.fc.forecast_batch([view.history(a) for a in names]))
        _, names, fcs = self._cache
        by_app = dict(zip(names, fcs, strict=True))
        f50, f90 = _FORECAST_FIELDS[target]
        p50 = np.array([_by_horizon(by_app[a], f50) for a in apps], dtype=np.float64).reshape(len(apps), NH)
        p90 = np.array([_by_horizon(by_app[a], f90) for a in apps], dtype=np.float64).reshape(len(apps), NH)
        return p50, p90


class ServedOnline(HistoryOnline):
    """`served` with what the node learns: besides the mixture's own online learning, a node-local
    trees round (manager/nodetrees.py `learn_trees`, as the daemon's learner runs it) every
    `trees_every_s` of node time on everything visible, its promoted trees served in the mixture's
    "trees" slot from the next second on. A round is skipped while nothing new has been seen since
    the last one (a node idle for days runs no rounds)."""

    def __init__(self, fc: Forecaster, every_s: int = 300, trees_every_s: int = 3600,
                 trees_cfg: Any = None) -> None:
        super().__init__(fc, every_s)
        self.trees_every_s = trees_every_s
        self.trees_cfg = trees_cfg
        self.serving: Any = None
        self.rounds: list[dict[str, Any]] = []
        self._trees_last_s: int | None = None
        self._seen = -1

    def learn(self, view: NodeView, now_s: int) -> None:
        super().learn(view, now_s)
        if self.trees_every_s <= 0:
            return
        if self._trees_last_s is None:
            self._trees_last_s = now_s  # the first round is due one period after the node starts
            return
        if now_s - self._trees_last_s < self.trees_every_s:
            return
        self._trees_last_s = now_s
        apps = view.visible_apps()
        seen = sum(len(a) for a in apps)
        if seen == self._seen:
            return
        self._seen = seen
        from vgpu.manager.nodetrees import learn_trees  # noqa: PLC0415 - LightGBM only for this method

        trees, entry = learn_trees(apps, self.serving, self.trees_cfg)
        # the node second and what the round found; not its wall clock or CPU time, so two runs print
        # the same report
        self.rounds.append({"node_s": now_s, **{k: v for k, v in entry.items() if k not in ("at", "fit_cpu_s")}})
        if trees is not None:
            self.serving = trees
            self.fc.set_expert("trees", trees)  # type: ignore[attr-defined]


def evaluate_online(
    layout: NodeLayout,
    methods: Sequence[OnlineMethod],
    *,
    min_index: int = MIN_ORIGIN_INDEX,
    timings: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Score `methods` by the node protocol; see the module docstring. Returns {"apps", "samples",
    "clock", "clock_why", "origins", "timeline_s", "results", "first_half", "second_half"}."""
    view = NodeView(layout.apps)
    # every (app, target) origin, in absolute seconds, with its truths from the evaluator's grids
    per_second: dict[int, dict[str, list[str]]] = {}
    truth_of: dict[tuple[str, str], tuple[int, FloatArray]] = {}
    for app in layout.apps:
        for target in TARGETS:
            seconds, values = one_second_grid(app, target)
            if len(values) < min_index + 2:
                continue
            truth_of[(app.app, target)] = (int(seconds[0]), values)
            for k in range(min_index, len(values) - 1):
                per_second.setdefault(int(seconds[k]), {t: [] for t in TARGETS})[target].append(app.app)
    if not per_second:
        raise ValueError(too_short(layout.apps, min_index) or "no origin")
    seconds_sorted = sorted(per_second)
    first_s, last_s = seconds_sorted[0], seconds_sorted[-1]
    mid_s = (first_s + last_s) / 2.0
    rows: dict[str, dict[str, list[tuple[int, FloatArray, FloatArray, FloatArray]]]] = {
        m.name: {t: [] for t in TARGETS} for m in methods
    }
    spent = dict.fromkeys((m.name for m in methods), 0.0)
    hz = np.asarray(HORIZONS_S)
    for now in seconds_sorted:
        view.advance(now)
        wanted = per_second[now]
        alive = {a for t in TARGETS for a in wanted[t]}
        view.origin_apps = tuple(a for a in view.order if a in alive)
        truths: dict[str, FloatArray] = {}
        for target in TARGETS:
            out = np.full((len(wanted[target]), NH), np.nan)
            for i, a in enumerate(wanted[target]):
                start, values = truth_of[(a, target)]
                idx = now - start + hz
                ok = idx < len(values)
                out[i, ok] = values[idx[ok]]
            truths[target] = out
        for m in methods:
            started = time.perf_counter()
            m.learn(view, now)
            for target in TARGETS:
                apps = wanted[target]
                if not apps:
                    continue
                p50, p90 = m.forecast(view, now, apps, target)
                rows[m.name][target].append((now, np.asarray(p50, dtype=np.float64), np.asarray(p90, dtype=np.float64),
                                             truths[target]))
            spent[m.name] += time.perf_counter() - started
    if timings is not None:
        timings.update(spent)

    def table(select: Callable[[int], bool]) -> list[dict[str, Any]]:
        results = []
        for target in TARGETS:
            for j, h in enumerate(HORIZONS_S):
                for m in methods:
                    parts = [(p50, p90, tr) for now, p50, p90, tr in rows[m.name][target] if select(now)]
                    if parts:
                        p50 = np.concatenate([p[0][:, j] for p in parts])
                        p90 = np.concatenate([p[1][:, j] for p in parts])
                        tr = np.concatenate([p[2][:, j] for p in parts])
                    else:
                        p50 = p90 = tr = np.zeros(0)
                    ok = np.isfinite(tr)
                    row: dict[str, Any] = {"target": target, "horizon_s": h, "method": m.name}
                    row.update(pooled_metrics(p50[ok], p90[ok], tr[ok]))
                    results.append(row)
        return results

    return {
        "apps": len(layout.apps),
        "samples": sum(len(a) for a in layout.apps),
        "clock": layout.clock,
        "clock_why": layout.why,
        "origins": sum(len(v[t]) for v in per_second.values() for t in TARGETS),
        "timeline_s": [first_s, last_s],
        "half_split_s": mid_s,
        "results": table(lambda now: True),
        "first_half": table(lambda now: now < mid_s),
        "second_half": table(lambda now: now >= mid_s),
    }


def default_methods(
    names: Sequence[str], model: Forecaster | None, *, refit_every_s: int = 1800, learn_every_s: int = 60,
    trees_every_s: int = 3600,
) -> list[OnlineMethod]:
    """The online methods in the protocol's order: model, served, last_value, ewma, vpa_percentile,
    gbdt. `served` is the daemon's mixture (module docstring) over `model` (the mixture's model slot
    abstains where `model` is None, as in a daemon whose model did not load)."""
    from vgpu.manager.baselines import EwmaForecaster, VpaPercentileForecaster  # noqa: PLC0415

    out: list[OnlineMethod] = []
    if model is not None and "model" in names:
        out.append(HistoryOnline(model, every_s=learn_every_s))
    if "served" in names:
        from vgpu.manager.experts import make_served  # noqa: PLC0415 - only for this method

        out.append(ServedOnline(make_served(model, name="served", local=True), every_s=learn_every_s,
                                trees_every_s=trees_every_s))
    if "last_value" in names:
        out.append(MarginOnline(every_s=learn_every_s))
    if "ewma" in names:
        out.append(GridOnline(EwmaForecaster()))
    if "vpa_percentile" in names:
        out.append(GridOnline(VpaPercentileForecaster()))
    if "gbdt" in names:
        out.append(GbdtOnline(refit_every_s=refit_every_s))
    return out


def layout_of(trace: Trace | Sequence[AppTrace], clock: str = "auto") -> NodeLayout:
    if isinstance(trace, Trace):
        return node_layout(list(trace.apps.values()), clock, trace.metadata)
    return node_layout(list(trace), clock)
