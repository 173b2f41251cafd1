"""Choosing a GPU's power limit from its forecast compute need, by measured power/throughput curves.

The curves come from Zeus (NSDI '23, ../shared/data/zeus-power-limit, Apache-2.0): for each
(workload, batch size) and power limit, the epoch time and average power. Per limit, as a fraction
of the GPU's maximum limit, a `PowerCurve` holds
- `throughput_ratio` r(f) = epoch time at the maximum limit / epoch time at f (1 = no slowdown),
- `power_ratio` p(f) = average power at f / average power at the maximum limit,
taken as a quantile over the workloads (the median by default) and made monotone conservatively
(r(f) is the smallest ratio seen at f or any higher limit).

The choice (`choose_power_limit_mw`), for a forecast need of u = SM busy share at full speed:
- no forecast: the default limit (nothing known, nothing changed);
- idle (u at or under `idle_sm_pct`): the minimum limit;
- otherwise a limit is *fast enough* when its throughput ratio r reaches
  min(1 - slowdown_bound, u / max_busy_frac): a partly busy GPU may run slower as long as its work
  still fits in `max_busy_frac` of the time (no queueing), and a busy GPU never loses more than
  `slowdown_bound` of its speed. Among the fast-enough limits the policy takes the one that spends
  the least energy per unit of work, (busy draw - idle draw) / r: on the A40 median curve that is
  about 58 % of the maximum limit (Zeus's finding: very low limits cost energy, they slow the work
  more than they save power), or the lowest fast-enough limit where that is higher.

The curves were measured on A40/V100/RTX6000/P100; mapping them onto another SKU by the fraction of
its maximum limit is an assumption (no H100 or A100 curve is public). Below the lowest measured
fraction the ratio is extrapolated linearly towards 0, which only makes the choice more cautious.

The allocator applies the choice through `PowerLimitMechanism` (vgpu.allocator.mechanisms.power):
check -> change -> verify, original saved first, restored on stop, dry-run, and a device that
refuses (NoPermission / NotSupported) turns the mechanism off for that device with one log line.
"""

from __future__ import annotations

import bisect
import csv
import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vgpu.device.base import PowerConstraints


@dataclass(frozen=True)
class PowerCurve:
    gpu: str
    limit_frac: tuple[float, ...]  # ascending, the last is 1.0 (the maximum limit)
    throughput_ratio: tuple[float, ...]
    power_ratio: tuple[float, ...]
    # average draw of a busy GPU at its maximum limit, as a fraction of that limit
    busy_power_frac: float
    workloads: int
    source: str

    def __post_init__(self) -> None:
        n = len(self.limit_frac)
        if n < 2 or len(self.throughput_ratio) != n or len(self.power_ratio) != n:
            raise ValueError("a PowerCurve needs at least two points and equal-length tuples")
        if any(b <= a for a, b in zip(self.limit_frac, self.limit_frac[1:], strict=False)):
            raise ValueError("limit_frac must be strictly ascending")
        if not math.isclose(self.limit_frac[-1], 1.0):
            raise ValueError("the last limit_frac must be 1.0 (the maximum limit)")
        if any(b < a - 1e-12 for a, b in zip(self.throughput_ratio, self.throughput_ratio[1:], strict=False)):
            raise ValueError("throughput_ratio must not fall as the limit rises")

    def _interp(self, values: tuple[float, ...], frac: float) -> float:
        if frac >= self.limit_frac[-1]:
            return values[-1]
        if frac <= self.limit_frac[0]:
            return values[0] * max(frac, 0.0) / self.limit_frac[0]
        i = bisect.bisect_right(self.limit_frac, frac)
        f0, f1 = self.limit_frac[i - 1], self.limit_frac[i]
        w = (frac - f0) / (f1 - f0)
        return values[i - 1] * (1 - w) + values[i] * w

    def throughput_at(self, frac: float) -> float:
        return self._interp(self.throughput_ratio, frac)

    def power_ratio_at(self, frac: float) -> float:
        return self._interp(self.power_ratio, frac)


# The median A40 curve of summary_power_a40.csv (53 workloads), as `load_zeus_curve` computes it;
# a fresh clone without ../shared uses this (tests/test_power_policy.py checks it against the data).
DEFAULT_CURVE = PowerCurve(
    gpu="a40",
    limit_frac=(1 / 3, 125 / 300, 0.5, 175 / 300, 200 / 300, 0.75, 250 / 300, 275 / 300, 1.0),
    throughput_ratio=(0.354, 0.509, 0.751, 0.929, 0.956, 0.985, 0.989, 0.995, 1.0),
    power_ratio=(0.538, 0.622, 0.674, 0.776, 0.847, 0.919, 0.961, 0.981, 1.0),
    busy_power_frac=0.675,
    workloads=53,
    source="zeus-power-limit/summary_power_a40.csv (median, built in)",
)


def load_zeus_curve(data_dir: str | Path, gpu: str = "a40", quantile: float = 0.5) -> PowerCurve:
    """Build a `PowerCurve` from `summary_power_<gpu>.csv`. Workloads lacking the maximum limit are
    left out; a file without any usable workload is a ValueError."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    path = Path(data_dir) / f"summary_power_{gpu}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no Zeus power summary for {gpu!r}")
    runs: dict[tuple[str, str, str], dict[float, tuple[float, float]]] = defaultdict(dict)
    with path.open(newline="", encoding="utf-8") as fh:
        for line, row in enumerate(csv.DictReader(fh), start=2):
            try:
                key = (row["dataset"], row["network"], row["batch_size"])
                pl, t, p = float(row["power_limit"]), float(row["time_per_epoch"]), float(row["average_power"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: unusable row ({exc})") from exc
            if t > 0 and p > 0 and pl > 0:
                runs[key][pl] = (t, p)
    limits = sorted({pl for r in runs.values() for pl in r})
    if not limits:
        raise ValueError(f"{path}: no usable row")
    top = limits[-1]
    usable = [r for r in runs.values() if top in r]
    if not usable:
        raise ValueError(f"{path}: no workload was measured at the maximum limit {top} W")
    ratios, powers = [], []
    for pl in limits:
        rs = [r[top][0] / r[pl][0] for r in usable if pl in r]
        ps = [r[pl][1] / r[top][1] for r in usable if pl in r]
        ratios.append(float(np.quantile(rs, quantile)) if rs else math.nan)
        powers.append(float(np.quantile(ps, 0.5)) if ps else math.nan)
    keep = [i for i, r in enumerate(ratios) if not math.isnan(r)]
    ratio = [min(ratios[j] for j in keep if j >= i) for i in keep]  # monotone, conservative
    busy = float(np.median([r[top][1] / top for r in usable]))
    return PowerCurve(
        gpu=gpu,
        limit_frac=tuple(limits[i] / top for i in keep),
        throughput_ratio=tuple(round(min(v, 1.0), 3) for v in ratio),
        power_ratio=tuple(round(powers[i], 3) for i in keep),
        busy_power_frac=round(busy, 3),
        workloads=len(usable),
        source=f"zeus-power-limit/summary_power_{gpu}.csv (q={quantile})",
    )


@dataclass(frozen=True)
class PowerPolicyConfig:
    slowdown_bound: float = 0.05  # a busy GPU keeps at least 95 % of its full-limit speed
    max_busy_frac: float = 0.9  # a partly busy GPU may slow until its work fills 90 % of the time
    idle_sm_pct: float = 5.0
    step_mw: int = 5000  # limits are chosen on a 5 W grid
    # an idle board's draw as a fraction of its maximum limit (H100 SXM: about 70 W of 700 W)
    idle_power_frac: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.slowdown_bound < 1:
            raise ValueError("slowdown_bound must be in [0, 1)")
        if not 0 < self.max_busy_frac <= 1:
            raise ValueError("max_busy_frac must be in (0, 1]")
        if self.step_mw <= 0:
            raise ValueError("step_mw must be > 0")


@dataclass(frozen=True)
class PowerChoice:
    limit_mw: int
    required_ratio: float  # the throughput ratio the limit had to reach
    throughput_ratio: float  # what the curve gives at the chosen limit
    reason: str  # "no forecast" | "idle" | "busy" | "partly busy" | "energy-optimal"


def choose_power_limit_mw(
    need_sm_pct: float,
    constraints: PowerConstraints,
    curve: PowerCurve = DEFAULT_CURVE,
    config: PowerPolicyConfig | None = None,
) -> PowerChoice:
    """The power limit for a GPU whose forecast compute need is `need_sm_pct` (see module doc)."""
    config = config or PowerPolicyConfig()
    lo, hi = constraints.min_mw, constraints.max_mw
    if lo > hi:
        raise ValueError(f"power constraints are inverted: min {lo} mW > max {hi} mW")
    if math.isnan(need_sm_pct):
        d = min(max(constraints.default_mw, lo), hi)
        return PowerChoice(d, math.nan, curve.throughput_at(d / hi), "no forecast")
    need = min(max(need_sm_pct, 0.0), 100.0) / 100.0
    if need_sm_pct <= config.idle_sm_pct:
        return PowerChoice(lo, 0.0, curve.throughput_at(lo / hi), "idle")
    busy_cap = 1.0 - config.slowdown_bound
    required = min(busy_cap, need / config.max_busy_frac)
    table = _limit_table(lo, hi, config.step_mw, config.idle_power_frac, curve)
    # the grid's throughputs never fall as the limit rises: the fast-enough limits are a suffix
    first = bisect.bisect_left(table.throughput, required - 1e-12)
    if first == len(table.limits):
        return PowerChoice(hi, required, curve.throughput_at(1.0), "busy")
    # among the limits fast enough, the one with the least energy per unit of work (ties: lowest)
    chosen = table.limits[table.best_from[first]]
    lowest_feasible = table.limits[first]
    if chosen > lowest_feasible:
        reason = "energy-optimal"
    else:
        reason = "busy" if required >= busy_cap else "partly busy"
    return PowerChoice(int(chosen), required, curve.throughput_at(chosen / hi), reason)


def _busy_w(limit_mw: int, max_mw: int, idle_w: float, curve: PowerCurve) -> float:
    """A busy GPU's draw under this limit: p(f) x busy_power_frac x the maximum, within [idle, limit]."""
    draw = curve.power_ratio_at(limit_mw / max_mw) * curve.busy_power_frac * max_mw / 1000.0
    return max(min(draw, limit_mw / 1000.0), idle_w)


def _energy_per_work(limit_mw: int, max_mw: int, idle_w: float, curve: PowerCurve) -> float:
    """(busy draw - idle draw) / speed at this limit: the energy one unit of work adds."""
    return (_busy_w(limit_mw, max_mw, idle_w, curve) - idle_w) / max(curve.throughput_at(limit_mw / max_mw), 1e-6)


@dataclass(frozen=True)
class _LimitTable:
    """The candidate limits of one device on the step grid, their throughput ratios (never falling,
    as the curve's), and for each index i the index of the least-energy limit among limits[i:]
    (ties: the lowest limit). What a choice needs, computed once per (constraints, curve, config)."""

    limits: tuple[int, ...]
    throughput: tuple[float, ...]
    best_from: tuple[int, ...]


@functools.lru_cache(maxsize=64)
def _limit_table(lo: int, hi: int, step: int, idle_power_frac: float, curve: PowerCurve) -> _LimitTable:
    limits = _grid(lo, hi, step)
    idle_w = idle_power_frac * hi / 1000.0
    energy = [round(_energy_per_work(x, hi, idle_w, curve), 9) for x in limits]
    best = [0] * len(limits)
    best[-1] = len(limits) - 1
    for i in range(len(limits) - 2, -1, -1):
        best[i] = i if energy[i] <= energy[best[i + 1]] else best[i + 1]
    return _LimitTable(tuple(limits), tuple(curve.throughput_at(x / hi) for x in limits), tuple(best))


def _grid(lo: int, hi: int, step: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(min(hi, (out[-1] // step + 1) * step))
    return out


@dataclass(frozen=True)
class PowerDraw:
    power_w: float
    busy_frac: float  # share of the time busy under the limit (capped at 1)
    slowdown_frac: float  # share of the work that could not be done in time (0 when it fits)


def power_draw(
    need_sm_pct: float,
    limit_mw: int,
    constraints: PowerConstraints,
    idle_w: float,
    curve: PowerCurve = DEFAULT_CURVE,
) -> PowerDraw:
    """Simulated board power of a GPU doing `need_sm_pct` of full-speed work under `limit_mw`.

    Under the limit the work takes 1/r as long (busy share u/r, capped at 1) and a busy GPU draws
    p(f) x `busy_power_frac` x the maximum limit; idle time draws `idle_w`. Energy per unit of
    work is thus proportional to p/r, as in Zeus's measurements."""
    r = max(curve.throughput_at(limit_mw / constraints.max_mw), 1e-6)
    u = min(max(need_sm_pct, 0.0), 100.0) / 100.0
    busy = min(1.0, u / r)
    busy_w = _busy_w(limit_mw, constraints.max_mw, idle_w, curve)
    slowdown = max(0.0, 1.0 - r / u) if u > r else 0.0
    return PowerDraw(idle_w + busy * (busy_w - idle_w), busy, slowdown)
