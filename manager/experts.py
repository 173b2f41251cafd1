"""The served forecast: per application, a mixture of experts weighted by their recent error.

"Never worse than the last value." Each application's forecast is a weighted mean of several
experts' medians: the last value, an EWMA of the 1 s grid, and forecasters given from outside (the
global model, later a node-local model). The weights are learnt online, separately for every
application, target (memory, compute) and horizon (1-5 s), from the experts' own past forecasts
once their truth has arrived: an application no model knows is forecast about as well as by the
last value, one a model knows gets that model's gain.

Weights: exponential weights (Hedge) with fixed share. For one (application, target, horizon)
stream, every scored forecast gives each expert i a loss l_i in [0, 1]: its absolute error divided
by the stream's scale S (below), capped at 1. Then

    w_i <- w_i * exp(-eta * l_i);  w <- w / sum(w);  w <- (1 - alpha) * w + alpha / N

with learning rate `eta` (`MixtureConfig.learning_rate`, 2.0) and share `alpha` (0.01), N experts.
The mixture's median is sum_i w_i p_i, whose absolute loss is convex in the prediction, so its loss
is at most the weighted mean of the experts' losses. Regret (Cesa-Bianchi and Lugosi, "Prediction,
Learning, and Games", 2006, Thm 2.2 and 5.x; Herbster and Warmuth 1998 for fixed share): over T
scored forecasts,

    alpha = 0:  L_mix - min_i L_i <= ln(N) / eta + eta * T / 8
    alpha > 0:  L_mix - L_seq <= ((m + 1) ln N + m ln(1 / alpha) + T ln(1 / (1 - alpha))) / eta + eta * T / 8

for any sequence of experts with m switches (L in normalised loss units). The worst-case term
eta * T / 8 is what a fixed rate pays against an adversary; on forecast errors the weights settle
on the better expert within tens of seconds (tests/test_experts.py measures it). Fixed share keeps
every weight at least alpha / N, so a workload whose best expert changes (a phase change, a
reloaded model) is followed instead of being locked out by old losses.

An expert with no forecast at an origin (NaN: a model not loaded yet, a target it cannot see) is
asleep there: it is left out of that origin's mean and, when the origin is scored, given the
mixture's own loss (sleeping experts, Freund et al. 1997), so its weight relative to the others
does not move.

Scale: S is per stream max(floor, 2 * an exponentially weighted mean (decay 0.98) of the experts'
mean absolute error), updated after each scoring; the floor is 8 MiB for memory and 1 % for
compute. The losses are normalised by a scale known before the truth, so each stays in [0, 1] and
the bound above holds in those units.

P90: the experts' own P90s mixed by the same weights, then conformal on the mixture. Each expert's
P90 (its median where it has none, e.g. the last value; never under its median) is averaged with the
weights of the median, b = sum_i w_i p90_i, so a model whose P90 knows when a change is coming keeps
that knowledge in the served P90 in proportion to its weight. The served P90 is

    P90 = max(mix50, b + S * q),  clipped to [0, capacity],

with q a per-stream offset in units of the stream's scale S (normalised residuals, locally weighted
conformal: Lei et al. 2018), tracked online by adaptive conformal inference in its quantile-tracking
form (Gibbs and Candes 2021; Angelopoulos, Candes and Tibshirani 2023): after each scoring,

    q <- max(q + gamma * (miss - 0.1), -floor),   miss = truth > P90,

with a fixed step `gamma` (`MixtureConfig.conformal_step`, 0.03) and `floor` (`conformal_floor`, 2).
miss is the event that the normalised score (truth - b) / S exceeds q; that score is bounded by
B = capacity / (scale floor) (memory under its capacity, compute under 100 %), so q stays under
B + gamma, and summing the updates gives, over T scorings, mean(miss) - 0.1 <= (B + gamma - q_1) /
(gamma * T) (Angelopoulos et al. 2023, Prop. 1, one-sided: the floor and the max with the median only
lower the P90's misses). q starts at 0 (the experts' own P90s are the starting point). Because the
step is fixed in scale units, a burst of large errors (a start-up ramp, a teardown to 0) moves q by
at most gamma per scoring and the margin S * q shrinks again as S decays; an offset in MiB stepped by
the current scale (the earlier rule) rose by large steps during a burst and fell by small ones once S
had decayed, and stayed inflated for thousands of seconds.

Node prior. A new application's streams do not start from nothing: the mixture keeps, per (target,
horizon), running means over the node's streams of q and S (each scoring round's mean over the
streams it scored, exponentially weighted over rounds with decay `node_prior_decay`, 0.9: about the
last ten rounds, i.e. seconds). A stream created once the node has such a mean starts with q at the
node's mean, and with its scale's running mean seeded by the node's S as if it had already taken in
`node_prior_scorings` (100) scorings; its weights start from the prior as before. So a node of short
applications one after another (a MIGPerf or TITAN X node; jobs of a few minutes) does not pay each
application's own warm-up of the offset, about 670 scorings from 0 to its floor at gamma 0.03 on a
flat series; the offset learnt on the node carries over. The node's mean of q is a mean of values in
[-floor, B + gamma], so a new stream's q_1 lies there too and the bound above holds for each stream
from its own start. The streams of applications created in the same round as the node's first (a
daemon's start) start from 0 and the floor as before. `node_prior_decay` = 0 turns it off.

No peeking. The newest second of a history is still filling (the daemon forecasts while samples
of the current second arrive), so a second's truth is scored only once a sample of a later second
has been seen; the evaluation protocol's prefixes see the same thing one second later.

Bad input. A history with no sample or whose memory and compute are all missing gets an all-NaN
forecast and no state changes. Time going back (a restarted profiler's clock) or jumping forward by
more than `max_gap_s` drops the application's unscored forecasts (logged once per forecaster) and
keeps its weights. State is bounded: at most `max_apps` applications (the longest unseen is
forgotten), and an application the manager forgets (gone silent, or evicted from the windows) is
dropped at once (`forget`, the optional `ForgetsApps` protocol of manager/forecast.py), so an id that
comes back starts from the prior weights and the node prior's offset and scale; the node's running
means are three small arrays and survive forgetting.

Cost: state lives in numpy arrays, one row per application, and each call is a few vectorised
steps over all applications plus the external experts' own forecasts (bench/forecast_latency.py
--mixture times both).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import structlog

from vgpu.log import get_logger
from vgpu.manager.forecast import HORIZONS_S, Forecast, Forecaster, forget_app
from vgpu.traces import INAPP_NUMERIC, TARGETS, AppTrace

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
_FIELDS = ("mem_p50_mib", "sm_p50_pct", "mem_p90_mib", "sm_p90_pct")  # (p50 of targets, p90 of targets)
INTERNAL_EXPERTS = ("last_value", "ewma")
_RING = 8  # origins kept per application: more than the longest horizon
_NONE = np.iinfo(np.int64).min


@dataclass(frozen=True)
class MixtureConfig:
    """The mixture's constants (see the module docstring for what each does)."""

    learning_rate: float = 1.0  # eta
    share: float = 0.002  # fixed-share alpha
    conformal_step: float = 0.03  # gamma: the P90 offset's step (in units of the stream's scale)
    conformal_floor: float = 2.0  # the offset's lower bound, in units of the stream's scale
    coverage: float = 0.9
    scale_decay: float = 0.98
    mem_floor_mib: float = 8.0
    sm_floor_pct: float = 1.0
    ewma_alpha: float = 0.3
    max_apps: int = 1024
    max_gap_s: float = 60.0
    node_prior_decay: float = 0.9  # a new stream's q and S from the node's running means (0: off)
    node_prior_scorings: float = 100.0  # how many scorings the node's scale counts for in a new stream

    def __post_init__(self) -> None:
        if not self.learning_rate > 0 or not 0 <= self.share < 1 or not self.conformal_step > 0:
            raise ValueError("learning_rate and conformal_step must be > 0, share in [0, 1)")
        if not 0 < self.coverage < 1 or not 0 <= self.scale_decay < 1 or not 0 < self.ewma_alpha <= 1:
            raise ValueError("coverage in (0, 1), scale_decay in [0, 1), ewma_alpha in (0, 1]")
        if not self.conformal_floor >= 0:
            raise ValueError("conformal_floor must be >= 0")
        if self.mem_floor_mib <= 0 or self.sm_floor_pct <= 0 or self.max_apps < 1 or self.max_gap_s < 1:
            raise ValueError("floors must be > 0, max_apps >= 1, max_gap_s >= 1")
        if not 0 <= self.node_prior_decay < 1 or not self.node_prior_scorings >= 0:
            raise ValueError("node_prior_decay in [0, 1), node_prior_scorings >= 0")

    def regret_bound(self, n_experts: int, scored: int, switches: int = 0) -> float:
        """The bound of the module docstring on L_mix minus the loss of the best sequence of
        experts with `switches` switches, over `scored` forecasts (normalised loss units)."""
        eta, a, n = self.learning_rate, self.share, n_experts
        if a == 0:
            return math.log(n) / eta + eta * scored / 8
        return ((switches + 1) * math.log(n) + switches * math.log(1 / a)
                + scored * math.log(1 / (1 - a))) / eta + eta * scored / 8


class _State:
    """Every application's online state, one row each, grown by doubling."""

    w: F64  # (rows, targets, horizons, experts) weights
    scale: F64  # (rows, targets, horizons) loss scale S
    scale_m: F64  # (rows, targets, horizons) the scale's running mean before bias correction
    scale_n: F64  # (rows, targets, horizons) scorings taken into it
    q: F64  # (rows, targets, horizons) conformal P90 offset
    pred: F64  # (rows, ring, targets, horizons, experts) experts' medians at stored origins
    mix50: F64  # (rows, ring, targets, horizons)
    mix90: F64
    origin: I64  # (rows, ring) origin second of each stored slot
    done: I64  # (rows,) last second whose truth was taken in
    value: F64  # (rows, targets) grid value of second `done` (carried forward)
    ewma: F64  # (rows, targets) EWMA of the grid up to second `done`
    cap: int

    def __init__(self, prior: F64, cfg: MixtureConfig, capacity: int = 64) -> None:
        self.e = len(prior)
        self.prior = prior
        self.cfg = cfg
        self.rows: OrderedDict[str, int] = OrderedDict()  # least recently forecast first
        self.free: list[int] = []
        self._alloc(capacity)

    def _alloc(self, cap: int) -> None:
        t, h, e, r = len(TARGETS), len(HORIZONS_S), self.e, _RING
        old = getattr(self, "cap", 0)
        arrays = {
            "w": (np.full, (cap, t, h, e), 0.0),
            "scale": (np.full, (cap, t, h), np.nan),
            "q": (np.full, (cap, t, h), np.nan),
            "scale_m": (np.full, (cap, t, h), 0.0),
            "scale_n": (np.full, (cap, t, h), 0.0),
            "pred": (np.full, (cap, r, t, h, e), np.nan),
            "mix50": (np.full, (cap, r, t, h), np.nan),
            "mix90": (np.full, (cap, r, t, h), np.nan),
            "origin": (np.full, (cap, r), _NONE),
            "done": (np.full, (cap,), _NONE),
            "value": (np.full, (cap, t), np.nan),
            "ewma": (np.full, (cap, t), np.nan),
        }
        for name, (make, shape, fill) in arrays.items():
            new = make(shape, fill, dtype=np.int64 if name in ("origin", "done") else np.float64)
            if old:
                new[:old] = getattr(self, name)
            setattr(self, name, new)
        self.w[old:] = self.prior
        if not old:  # the node's running means (module docstring, "Node prior"), before bias correction
            self.node_q = np.zeros((t, h))
            self.node_s = np.zeros((t, h))
            self.node_n = np.zeros((t, h))  # scoring rounds taken into them
        self.free.extend(range(cap - 1, old - 1, -1))
        self.cap = cap

    def reset_row(self, row: int) -> None:
        self.w[row] = self.prior
        for name in ("scale", "q", "pred", "mix50", "mix90", "value", "ewma"):
            getattr(self, name)[row] = np.nan
        self.scale_m[row] = 0.0
        self.scale_n[row] = 0.0
        self.origin[row] = _NONE
        self.done[row] = _NONE
        d = self.cfg.node_prior_decay
        seen = self.node_n > 0
        if d > 0 and seen.any():  # start from the node's streams of the same target and horizon
            corr = np.where(seen, 1 - d ** self.node_n, 1.0)
            self.q[row] = np.where(seen, self.node_q / corr, np.nan)
            n0 = self.cfg.node_prior_scorings
            if n0 > 0:  # the node's scale as n0 scorings already taken into the stream's running mean
                s_node = self.node_s / corr
                self.scale_m[row] = np.where(seen, (1 - self.cfg.scale_decay ** n0) * s_node, 0.0)
                self.scale_n[row] = np.where(seen, n0, 0.0)
                self.scale[row] = np.where(seen, s_node, np.nan)

    def forget_time(self, row: int) -> None:
        """Drop the unscored forecasts and the grid state; keep what was learnt."""
        self.origin[row] = _NONE
        self.done[row] = _NONE
        self.value[row] = np.nan
        self.ewma[row] = np.nan

    def row_of(self, app: str) -> tuple[int, bool]:
        row = self.rows.get(app)
        if row is not None:
            self.rows.move_to_end(app)
            return row, False
        if len(self.rows) >= self.cfg.max_apps:
            _, old = self.rows.popitem(last=False)
            self.free.append(old)
        if not self.free:
            self._alloc(self.cap * 2)
        row = self.free.pop()
        self.reset_row(row)
        self.rows[app] = row
        return row, True


def _capacity(h: AppTrace) -> float:
    """The application's memory capacity at its last sample (inf where unknown)."""
    total_mib = h.columns.get("mem_total_mib")
    if total_mib is not None and len(total_mib):
        v = float(total_mib[-1])
        if math.isfinite(v) and v > 0:
            return v
    return math.inf


class HistorySink(Protocol):
    """Where the mixture sends each application's complete seconds (manager/history.py)."""

    def add(self, apps: Sequence[str], gpus: Sequence[str], t_s: np.ndarray, values: np.ndarray,
            mem_total_mib: Sequence[float], inapp: Mapping[str, np.ndarray] | None = None) -> None: ...


class MixtureForecaster:
    """The per-application expert mixture of the module docstring, as a `Forecaster`.

    `experts` maps a name to a forecaster (or None: a slot that abstains until `set_expert` fills
    it, e.g. a node-local model still training); the last value and an EWMA are always experts.
    `name` ("mixture" unless given, e.g. "served" in `vgpu eval`) is every forecast's `source`."""

    def __init__(
        self,
        experts: Mapping[str, Forecaster | None] | None = None,
        config: MixtureConfig | None = None,
        *,
        name: str = "mixture",
        prior: Mapping[str, float] | None = None,
        internal: Sequence[str] = INTERNAL_EXPERTS,
        history: HistorySink | None = None,
        logger: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.name = name
        self.history = history
        self.config = config or MixtureConfig()
        self._external: dict[str, Forecaster | None] = dict(experts or {})
        unknown = set(internal) - set(INTERNAL_EXPERTS)
        if "last_value" not in internal or unknown:
            raise ValueError(f"internal experts: last_value and any of {INTERNAL_EXPERTS}, not {internal}")
        self._internal = tuple(n for n in INTERNAL_EXPERTS if n in internal)
        clash = set(self._external) & set(INTERNAL_EXPERTS)
        if clash:
            raise ValueError(f"expert names {sorted(clash)} are the mixture's own")
        self.expert_names: tuple[str, ...] = (*self._internal, *self._external)
        weights = dict(prior or {})
        unknown = set(weights) - set(self.expert_names)
        if unknown or any(not v > 0 for v in weights.values()):
            raise ValueError(f"prior: unknown experts {sorted(unknown)} or a weight not > 0")
        raw = np.array([weights.get(n, 1.0) for n in self.expert_names], dtype=np.float64)
        self.prior = raw / raw.sum()
        self._state = _State(self.prior, self.config)
        self._log = logger or get_logger("vgpu.manager.experts")
        self._logged: set[str] = set()
        self.scored = 0  # (stream, origin) pairs scored
        self.expert_failures = 0
        self.time_resets = 0
        self._lock = threading.Lock()  # one forecast at a time; `forget` does not wait for it
        self._forgotten: list[str] = []  # applications forgotten while a forecast ran

    # --- what the daemon and reports read ---------------------------------------------------------
    def set_expert(self, name: str, forecaster: Forecaster | None) -> None:
        """Put a forecaster in an external slot (one reference store: the next call uses it)."""
        if name not in self._external:
            raise KeyError(f"no expert slot {name!r}; slots: {sorted(self._external)}")
        self._external[name] = forecaster

    def expert(self, name: str) -> Forecaster | None:
        return self._external.get(name)

    def weights(self, app: str) -> dict[str, F64] | None:
        """{target: (horizons, experts) weights} of an application, or None if unknown."""
        row = self._state.rows.get(app)
        if row is None:
            return None
        return {t: self._state.w[row, k].copy() for k, t in enumerate(TARGETS)}

    def forget(self, app: str) -> None:
        """Drop an application's weights, P90 offset, scale and unscored forecasts (and tell the
        external experts that keep state per application): the manager calls it when the application
        is gone, so an id that comes back starts afresh (from the node prior). The manager forgets on
        its event loop while a forecast may be running in a worker thread: then the application is
        dropped at the start of the next call, never in the middle of one (whose rows are in use)."""
        if self._lock.acquire(blocking=False):
            try:
                self._drop(app)
                self._drop_forgotten()
            finally:
                self._lock.release()
        else:
            self._forgotten.append(app)  # list.append is atomic; taken at the next call

    def _drop(self, app: str) -> None:
        row = self._state.rows.pop(app, None)
        if row is not None:
            self._state.free.append(row)
        for fc in self._external.values():
            forget_app(fc, app)

    def _drop_forgotten(self) -> None:
        while self._forgotten:
            self._drop(self._forgotten.pop())

    def _once(self, key: str, event: str, **kw: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            self._log.warning(event, **kw)

    # --- forecasting ------------------------------------------------------------------------------
    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        """One forecast per history. An application that appears more than once (the evaluator's
        successive origins) is forecast in order, one origin per step."""
        with self._lock:
            self._drop_forgotten()
            return self._forecast_batch(histories)

    def _forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        seen: dict[str, int] = {}
        step = [0] * len(histories)
        for i, h in enumerate(histories):
            step[i] = seen.get(h.app, 0)
            seen[h.app] = step[i] + 1
        if len(seen) == len(histories):
            return self._step(histories)
        out: list[Forecast | None] = [None] * len(histories)
        for k in range(max(seen.values())):
            idx = [i for i, s in enumerate(step) if s == k]
            for i, f in zip(idx, self._step([histories[i] for i in idx]), strict=True):
                out[i] = f
        return [f for f in out if f is not None]

    def _step(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        cfg, st = self.config, self._state
        n, nt, nh = len(histories), len(TARGETS), len(HORIZONS_S)
        nan_fc = Forecast(HORIZONS_S, (math.nan,) * nh, (math.nan,) * nh, (math.nan,) * nh, (math.nan,) * nh,
                          self.name)
        # 1. which histories can be forecast, their rows and origin seconds
        live: list[int] = []
        rows: list[int] = []
        cur: list[int] = []
        for i, h in enumerate(histories):
            if not len(h) or not any(c in h.columns for c in TARGETS) or not math.isfinite(float(h.t_s[-1])):
                continue
            row, _ = st.row_of(h.app)
            live.append(i)
            rows.append(row)
            cur.append(int(math.floor(float(h.t_s[-1]))))
        result = [nan_fc] * n
        if not live:
            return result
        rows_a = np.asarray(rows, dtype=np.int64)
        cur_a = np.asarray(cur, dtype=np.int64)
        # 2. clock checks: back in time, or a jump past max_gap_s: forget unscored forecasts
        done = st.done[rows_a]
        known = done != _NONE
        bad = known & ((cur_a <= done) | (cur_a - done > cfg.max_gap_s))
        for k in np.flatnonzero(bad).tolist():
            self.time_resets += 1
            self._once("clock", "mixture_clock_jump", app=histories[live[k]].app, last_second=int(done[k]),
                       now_second=int(cur_a[k]), count=self.time_resets)
            st.forget_time(int(rows_a[k]))
        done = st.done[rows_a]
        first = done == _NONE
        # 3. the samples of each application from its first second not yet taken in (the second
        #    before the origin on first sight), as per-second sums and counts of both targets
        start = np.where(first, cur_a - 1, done + 1)
        ts_parts: list[F64] = []
        val_parts: list[list[F64]] = [[] for _ in TARGETS]
        counts: list[int] = []
        # the in-app counters the histories carry, binned the same way for the node history only
        inapp_cols: tuple[str, ...] = ()
        if self.history is not None:
            present = {c for i in live for c in histories[i].columns if c.startswith("inapp_")}
            inapp_cols = tuple(c for c in INAPP_NUMERIC if c in present)
        inapp_parts: list[list[F64]] = [[] for _ in inapp_cols]
        for k, lo_s in enumerate(start.tolist()):
            h = histories[live[k]]
            lo = int(h.t_s.searchsorted(lo_s))
            ts_parts.append(h.t_s[lo:])
            counts.append(len(h.t_s) - lo)
            for j, c in enumerate(TARGETS):
                col = h.columns.get(c)
                val_parts[j].append(col[lo:] if col is not None else np.full(len(h.t_s) - lo, np.nan))
            for j, c in enumerate(inapp_cols):
                col = h.columns.get(c)
                inapp_parts[j].append(col[lo:] if col is not None else np.full(len(h.t_s) - lo, np.nan))
        t_all = np.concatenate(ts_parts)
        v_all = np.stack([np.concatenate(p) for p in val_parts])  # (targets, samples)
        a_all = np.repeat(np.arange(len(live)), counts)
        span = cur_a - start + 1  # seconds per application, origin included
        offs = np.concatenate([[0], np.cumsum(span)])
        sec = np.floor(t_all).astype(np.int64) - start[a_all]
        b = offs[a_all] + sec
        in_span = (sec >= 0) & (sec < span[a_all])  # a stray older sample: not counted
        ok = np.isfinite(v_all) & in_span[None, :]
        total = int(offs[-1])
        sums = np.stack([np.bincount(b[ok[j]], weights=v_all[j, ok[j]], minlength=total) for j in range(nt)])
        cnts = np.stack([np.bincount(b[ok[j]], minlength=total) for j in range(nt)])
        means = np.where(cnts > 0, sums / np.maximum(cnts, 1), np.nan)
        # 4. every bin but each application's last is a complete second: carry values forward
        #    (from the state's value of the second before), run the EWMA over them, and score the
        #    truths they bring; the origin's bin (still filling) gives the last value
        m_live = len(live)
        alpha = cfg.ewma_alpha
        app_of_bin = np.repeat(np.arange(m_live), span)
        first_bin = offs[:-1]
        grid = means.T  # (bins, targets)
        idx = np.where(np.isfinite(grid), np.arange(total)[:, None], -1)
        np.maximum.accumulate(idx, axis=0, out=idx)
        mine = idx >= first_bin[app_of_bin][:, None]
        carried = np.where(mine, grid[np.maximum(idx, 0), np.arange(nt)[None, :]], st.value[rows_a][app_of_bin])
        ew = st.ewma[rows_a]
        n_done = span - 1  # complete seconds per application
        for j in range(int(n_done.max())):
            on = n_done > j
            x = carried[first_bin[on] + j]
            prev = ew[on]
            ew[on] = np.where(np.isnan(prev), x, np.where(np.isnan(x), prev, alpha * x + (1 - alpha) * prev))
        last_done = np.maximum(offs[1:] - 2, first_bin)
        st.value[rows_a] = np.where((n_done > 0)[:, None], carried[last_done], st.value[rows_a])
        st.ewma[rows_a] = ew
        st.done[rows_a] = cur_a - 1
        origin_val = carried[offs[1:] - 1]  # (apps, targets)
        origin_ewma = np.where(np.isnan(ew), origin_val, alpha * origin_val + (1 - alpha) * ew)
        pos = np.arange(total) - first_bin[app_of_bin]
        scored = (pos < n_done[app_of_bin]) & ~first[app_of_bin]
        cap_mem = [_capacity(histories[i]) for i in live]  # each live application's memory capacity
        if scored.any():
            on_app = app_of_bin[scored]
            self._score(rows_a[on_app], start[on_app] + pos[scored], carried[scored], pos[scored])
            if self.history is not None:
                events = on_app.tolist()
                hist = [histories[live[k]] for k in events]
                inapp: dict[str, F64] = {}
                for j, c in enumerate(inapp_cols):  # each complete second's mean report; empty: NaN
                    x = np.concatenate(inapp_parts[j])
                    okx = np.isfinite(x) & in_span
                    n_x = np.bincount(b[okx], minlength=total)
                    inapp[c] = np.where(n_x > 0, np.bincount(b[okx], weights=x[okx], minlength=total)
                                        / np.maximum(n_x, 1), np.nan)[scored]
                self.history.add([h.app for h in hist], [h.gpu or "" for h in hist], start[on_app] + pos[scored],
                                 carried[scored], [cap_mem[k] for k in events], inapp=inapp or None)
        # 5. the experts' forecasts at the origin: (apps, targets, horizons, experts)
        p50 = np.full((m_live, nt, nh, len(self.expert_names)), np.nan)
        p50[..., 0] = origin_val[:, :, None]
        if "ewma" in self._internal:
            p50[..., 1] = origin_ewma[:, :, None]
        p90 = np.full_like(p50, np.nan)  # each expert's own P90 (its median where it has none)
        sub = [histories[i] for i in live]
        for e, (name, fc) in enumerate(self._external.items(), start=len(self._internal)):
            if fc is None:
                continue
            got = self._expert_forecasts(name, fc, sub)
            if got is None:
                continue
            p50[..., e] = got[:, :nt]
            p90[..., e] = got[:, nt:]
        caps = np.full((m_live, nt, 1), np.inf)
        caps[:, 1] = 100.0
        caps[:, 0, 0] = cap_mem
        # an expert's forecast beyond what the application can use (a node-local file gone wrong) is
        # held to its range, so it cannot inflate the scale and the node prior that later streams start from
        p50 = np.clip(p50, 0.0, caps[..., None])
        p90 = np.clip(p90, 0.0, caps[..., None])
        awake = np.isfinite(p50)
        p90 = np.where(np.isfinite(p90), np.maximum(p90, p50), p50)
        # 6. mix the medians and the experts' own P90s by the same weights; P90 = the mixed P90 plus the
        #    conformal offset q in units of the stream's scale, never under the median, clipped to [0, capacity]
        w = st.w[rows_a]
        wa = np.where(awake, w, 0.0)
        wsum = wa.sum(axis=-1)
        div = np.where(wsum > 0, wsum, 1.0)
        mix50 = np.where(wsum > 0, (wa * np.where(awake, p50, 0.0)).sum(axis=-1) / div, np.nan)
        base90 = np.where(wsum > 0, (wa * np.where(awake, p90, 0.0)).sum(axis=-1) / div, np.nan)
        scale = st.scale[rows_a]
        floors = np.array([cfg.mem_floor_mib, cfg.sm_floor_pct])[None, :, None]
        if np.isnan(scale).any():
            scale = np.where(np.isnan(scale), floors, scale)
            st.scale[rows_a] = scale
        q = st.q[rows_a]
        if np.isnan(q).any():
            q = np.nan_to_num(q)
            st.q[rows_a] = q
        mix50 = np.clip(mix50, 0.0, caps)
        mix90 = np.clip(np.maximum(base90 + scale * q, mix50), 0.0, caps)
        # 7. remember this origin's forecasts for scoring
        slot = cur_a % _RING
        st.pred[rows_a, slot] = p50
        st.mix50[rows_a, slot] = mix50
        st.mix90[rows_a, slot] = mix90
        st.origin[rows_a, slot] = cur_a
        vals = np.concatenate([mix50, mix90], axis=1).tolist()  # (apps, [mem50, sm50, mem90, sm90], H)
        for k, i in enumerate(live):
            m50, s50, m90, s90 = vals[k]
            result[i] = Forecast(HORIZONS_S, tuple(m50), tuple(m90), tuple(s50), tuple(s90), self.name)
        return result

    def _expert_forecasts(self, name: str, fc: Forecaster, histories: Sequence[AppTrace]) -> F64 | None:
        """(apps, [p50 targets, p90 targets], horizons) from an external expert; None when it fails
        (logged once; the expert abstains at this origin)."""
        try:
            arrays = getattr(fc, "forecast_arrays", None)  # the model's numbers without Forecast objects
            if arrays is not None and getattr(fc, "horizons_s", None) == HORIZONS_S:
                got = arrays(histories)
                if got is not None:
                    out_a = np.asarray(got, dtype=np.float64)
                    if out_a.shape != (len(histories), len(_FIELDS), len(HORIZONS_S)):
                        raise ValueError(f"forecasts of shape {out_a.shape} for {len(histories)} histories")
                    return out_a
            fcs = fc.forecast_batch(histories)
            if len(fcs) != len(histories):
                raise ValueError(f"{len(fcs)} forecasts for {len(histories)} histories")
            if all(f.horizons_s == HORIZONS_S for f in fcs):
                return np.array([(f.mem_p50_mib, f.sm_p50_pct, f.mem_p90_mib, f.sm_p90_pct) for f in fcs],
                                dtype=np.float64).reshape(len(fcs), len(_FIELDS), len(HORIZONS_S))
            out = np.full((len(fcs), len(_FIELDS), len(HORIZONS_S)), np.nan)
            for k, f in enumerate(fcs):
                pos = {h: j for j, h in enumerate(f.horizons_s)}
                for a, attr in enumerate(_FIELDS):
                    vals = getattr(f, attr)
                    for j, h in enumerate(HORIZONS_S):
                        if h in pos:
                            out[k, a, j] = vals[pos[h]]
            return out
        except Exception as exc:  # noqa: BLE001 - an expert that fails abstains; the others serve
            self.expert_failures += 1
            self._once(f"expert:{name}", "mixture_expert_failed", expert=name, error=repr(exc))
            return None

    def _score(self, ev_row: I64, ev_sec: I64, ev_y: F64, ev_round: I64) -> None:
        """Score the stored forecasts whose truth second is in the events (application row,
        second, truth per target), in rounds so that one application's seconds go in order."""
        cfg, st = self.config, self._state
        eta, share, prior = cfg.learning_rate, cfg.share, self.prior
        miss_target = 1.0 - cfg.coverage
        floors = np.array([cfg.mem_floor_mib, cfg.sm_floor_pct])[None, :]
        hz = np.asarray(HORIZONS_S, dtype=np.int64)
        for r in range(int(ev_round.max()) + 1):
            pick = ev_round == r
            # every (event, horizon) pair of this round at once: an application has one event per
            # round, so each (row, horizon) is written once
            rows = np.repeat(ev_row[pick], len(hz))
            hh = np.tile(np.arange(len(hz)), int(pick.sum()))
            o = np.repeat(ev_sec[pick], len(hz)) - hz[hh]
            slot = o % _RING
            hit = st.origin[rows, slot] == o
            if not hit.any():
                continue
            rr, ss, hi = rows[hit], slot[hit], hh[hit]
            yy = np.repeat(ev_y[pick], len(hz), axis=0)[hit]  # (k, targets)
            pred = st.pred[rr, ss, :, hi, :]  # (k, targets, experts)
            mix = st.mix50[rr, ss, :, hi]
            p90 = st.mix90[rr, ss, :, hi]
            scale = st.scale[rr, :, hi]
            valid = np.isfinite(yy) & np.isfinite(mix)  # (k, targets)
            if not valid.any():
                continue
            err = np.abs(pred - yy[..., None])
            have = np.isfinite(err)
            mix_loss = np.minimum(1.0, np.abs(mix - yy) / scale)
            loss = np.where(have, np.minimum(1.0, err / scale[..., None]), mix_loss[..., None])
            w_old = st.w[rr, :, hi, :]
            w = w_old * np.exp(-eta * loss)
            w /= w.sum(axis=-1, keepdims=True)
            w = (1 - share) * w + share * prior
            st.w[rr, :, hi, :] = np.where(valid[..., None], w, w_old)
            miss = (yy > p90).astype(np.float64)
            q = st.q[rr, :, hi]
            q_new = np.maximum(np.nan_to_num(q) + cfg.conformal_step * (miss - miss_target), -cfg.conformal_floor)
            st.q[rr, :, hi] = np.where(valid, q_new, q)
            n_have = have.sum(axis=-1)
            mean_err = np.where(have, err, 0.0).sum(axis=-1) / np.maximum(n_have, 1)
            # the scale: a bias-corrected exponentially weighted mean of twice the experts' mean
            # error (right from the first scorings, not pulled towards a starting value)
            d = cfg.scale_decay
            upd = valid & (n_have > 0)
            m_old, n_old = st.scale_m[rr, :, hi], st.scale_n[rr, :, hi]
            m_new = np.where(upd, d * m_old + (1 - d) * 2.0 * mean_err, m_old)
            n_new = n_old + upd
            st.scale_m[rr, :, hi], st.scale_n[rr, :, hi] = m_new, n_new
            st.scale[rr, :, hi] = np.where(n_new > 0, np.maximum(floors, m_new / (1 - d ** np.maximum(n_new, 1))),
                                           scale)
            if cfg.node_prior_decay > 0:
                self._node_update(hi, valid, st.q[rr, :, hi], st.scale[rr, :, hi])
            self.scored += int(valid.sum())

    def _node_update(self, hi: I64, valid: npt.NDArray[np.bool_], q: F64, scale: F64) -> None:
        """Fold one scoring round into the node's running means of q and S: per (target, horizon),
        the mean over the streams scored in the round, exponentially weighted over rounds."""
        st, d = self._state, self.config.node_prior_decay
        nh = len(HORIZONS_S)
        for j in range(len(TARGETS)):
            ok = valid[:, j]
            if not ok.any():
                continue
            h = hi[ok]
            cnt = np.bincount(h, minlength=nh).astype(np.float64)
            on = cnt > 0
            div = np.maximum(cnt, 1.0)
            mean_q = np.bincount(h, weights=q[ok, j], minlength=nh) / div
            mean_s = np.bincount(h, weights=scale[ok, j], minlength=nh) / div
            st.node_q[j] = np.where(on, d * st.node_q[j] + (1 - d) * mean_q, st.node_q[j])
            st.node_s[j] = np.where(on, d * st.node_s[j] + (1 - d) * mean_s, st.node_s[j])
            st.node_n[j] += on


# The served mixture: the last value and the model (the EWMA, the worst of the three at every horizon on
# the MIGPerf validation split, is left out), starting at weights 1 : 2 (before normalising). Both
# chosen on that split: 5 s compute MAE 0.832 x the last value's against 0.843 with the EWMA in, and
# 0.846 from equal starting weights.
SERVED_INTERNAL: tuple[str, ...] = ("last_value",)
SERVED_PRIOR: dict[str, float] = {"last_value": 1.0, "model": 2.0}
LOCAL_SLOTS = ("local", "trees")  # what the node learns: the fine-tuned network, the trees


def make_served(model: Forecaster | None, config: MixtureConfig | None = None, *, name: str = "mixture",
                local: bool = False, history: HistorySink | None = None) -> MixtureForecaster:
    """The daemon's served forecaster: the mixture over the last value and `model` (a slot that
    abstains while None), starting from `SERVED_PRIOR`; with `local`, the node's learnt experts: a
    "local" slot for the node-local model and a "trees" slot for the node-local trees
    (manager/nodetrees.py), each empty until one is promoted, starting at the model's weight;
    `history` receives every complete second (manager/history.py)."""
    experts: dict[str, Forecaster | None] = {"model": model}
    prior = dict(SERVED_PRIOR)
    if local:
        for slot in LOCAL_SLOTS:
            experts[slot] = None
            prior[slot] = SERVED_PRIOR["model"]
    return MixtureForecaster(experts, config, name=name, prior=prior, internal=SERVED_INTERNAL, history=history)


__all__ = ["INTERNAL_EXPERTS", "LOCAL_SLOTS", "SERVED_INTERNAL", "SERVED_PRIOR", "MixtureConfig", "MixtureForecaster", "make_served"]
