"""What a smaller MIG slice or a lower power limit costs an application, from measurements.

Slices (MISO MIT + MIGPerf MIT, both A100): time per iteration of (model, batch[, input size]) on
MIG slices of 1-7 compute slices. Within one such group the time follows a power law in the number
of compute slices g: t(g) = t(7) * (7 / g) ** k, with one exponent k >= 0 per model (least squares
in log space over its groups), or per model family where the model is unknown, or over all models
as the last fallback. `slice_slowdown` uses the measured ratio where both slices of the group were
measured, else the power law. Held-out error: every measured time predicted from the other slices
of its group with k fitted without that group (leave-one-group-out), as MAPE.

Power (Zeus Apache-2.0, A40/V100/RTX6000/P100): time per epoch and average power of (workload,
batch size) per power limit. The curves are made non-increasing in the limit (a higher limit never
costs time), averaged over the datasets and optimizers of the workload, and interpolated linearly
between measured limits; an unmeasured batch takes the nearest measured one (log scale). Held-out
error: each interior limit predicted from its two neighbours, as MAPE of time per epoch.

Energy: `power_tradeoff` gives, beside the slowdown, the ratio of energy per unit of work (time per
epoch x average power) and of average power, so the allocator can weigh energy saved against time.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vgpu.manager.jobprofiles import load_migperf, model_family

ZEUS_GPUS: tuple[str, ...] = ("a40", "v100", "rtx6000", "p100")
# Zeus workloads by family, for jobs Zeus did not measure.
_ZEUS_FAMILY = {"cnn": "resnet50", "vit": "resnet50", "rnn": "deepspeech2", "transformer": "bert_base_uncased", "recsys": "ncf"}


def compute_slices(slice_name: str) -> int:
    """Compute slices of a MIG profile name ("3g.20gb" -> 3); "full" -> 7."""
    name = slice_name.strip().lower()
    if name == "full":
        return 7
    head = name.split("g.", 1)[0]
    if not head.isdigit() or not 1 <= int(head) <= 8 or "g." not in name:
        raise ValueError(f"not a MIG profile name: {slice_name!r} (expected e.g. '3g.20gb' or 'full')")
    return int(head)


@dataclass(frozen=True)
class Slowdown:
    """Relative time per iteration (to / from); > 1 means slower. `basis` says how it was found:
    "measured" (both points measured), "model" (the model's own fit), "family" (fallback: the
    model's family), "global" (fallback: every model). `fallback` is True for the last two."""

    factor: float
    basis: str
    used: str  # the model / workload whose data gave the answer
    fallback: bool
    note: str = ""


@dataclass(frozen=True)
class PowerTradeoff:
    """Moving a job from one power limit to another: time, energy per unit of work, average power
    (each a ratio to / from), and the absolute figures at both limits where measured."""

    slowdown: Slowdown
    energy_ratio: float
    power_ratio: float
    from_power_w: float  # NaN for the "global" fallback (an average of relative curves)
    to_power_w: float


@dataclass(frozen=True)
class _Group:
    key: tuple[str, ...]
    model: str
    batch: int
    times_s: dict[int, float]  # compute slices -> time per iteration


@dataclass(frozen=True)
class _PowerCurve:
    limits_w: np.ndarray
    time_rel: np.ndarray  # time per epoch / time at the highest limit, non-increasing
    power_w: np.ndarray
    time_s: np.ndarray


def _read_csv(path: Path) -> Iterable[dict[str, str]]:
    with open(path, newline="") as fh:
        yield from csv.DictReader(fh)


def _fit_exponent(groups: Iterable[_Group]) -> float | None:
    """k in log t = c_group - k log g, least squares with a free intercept per group; >= 0."""
    num = den = 0.0
    for g in groups:
        if len(g.times_s) < 2:
            continue
        lg = np.log(np.array(list(g.times_s.keys()), dtype=np.float64))
        lt = np.log(np.array(list(g.times_s.values()), dtype=np.float64))
        lg_c, lt_c = lg - lg.mean(), lt - lt.mean()
        num += float(-(lg_c * lt_c).sum())
        den += float((lg_c**2).sum())
    return max(0.0, num / den) if den > 0 else None


def _batch_exponent(groups: Iterable[_Group], batch: int) -> float | None:
    """The exponent at `batch`: each group's own exponent, interpolated over log batch (small
    batches scale worse with more slices than large ones)."""
    by_batch: dict[int, list[float]] = defaultdict(list)
    for g in groups:
        k = _fit_exponent([g])
        if k is not None:
            by_batch[g.batch].append(k)
    if not by_batch:
        return None
    xs = sorted(by_batch)
    ks = [float(np.mean(by_batch[b])) for b in xs]
    return float(np.interp(math.log(batch), [math.log(b) for b in xs], ks))


def _mape(pairs: list[tuple[float, float]]) -> float:
    return float(np.mean([abs(p - t) / t for t, p in pairs]) * 100.0) if pairs else math.nan


class SlowdownModel:
    """Slice and power-limit slowdowns from MISO, MIGPerf and Zeus, with their held-out error."""

    def __init__(self, groups: list[_Group], curves: dict[tuple[str, str, int], _PowerCurve]) -> None:
        if not groups and not curves:
            raise ValueError("no slice groups and no power curves: nothing to model")
        self._groups = groups
        self._by_model: dict[str, list[_Group]] = defaultdict(list)
        for g in groups:
            self._by_model[g.model].append(g)
        self._k_model = {m: k for m, gs in self._by_model.items() if (k := _fit_exponent(gs)) is not None}
        fam: dict[str, list[_Group]] = defaultdict(list)
        for g in groups:
            fam[model_family(g.model)].append(g)
        self._k_family = {f: k for f, gs in fam.items() if (k := _fit_exponent(gs)) is not None}
        self._k_global = _fit_exponent(groups) or 0.0
        self._curves = curves
        self.errors = {"slice": self._slice_error(), "power": self._power_error()}

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_data(cls, data_root: Path) -> SlowdownModel:
        root = Path(data_root)
        return cls(_load_slice_groups(root), _load_power_curves(root))

    # ---- slices -------------------------------------------------------------------------------
    def _exponent(self, model: str, batch: int | None = None) -> tuple[float, str, str]:
        if model in self._k_model:
            k = _batch_exponent(self._by_model[model], batch) if batch is not None else None
            return (self._k_model[model] if k is None else k), "model", model
        fam = model_family(model)
        if fam in self._k_family:
            return self._k_family[fam], "family", fam
        return self._k_global, "global", "all models"

    def slice_slowdown(self, model: str, batch: int, from_slice: str, to_slice: str) -> Slowdown:
        """Time per iteration on `to_slice` relative to `from_slice` (MIG profile names or "full")."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        g_from, g_to = compute_slices(from_slice), compute_slices(to_slice)
        for g in self._by_model.get(model, []):
            if g.batch == batch and g_from in g.times_s and g_to in g.times_s:
                ratio = g.times_s[g_to] / g.times_s[g_from]
                # measurement noise may make fewer slices look faster: never report that
                bounded = max(1.0, ratio) if g_to < g_from else min(1.0, ratio) if g_to > g_from else 1.0
                note = f"measured ratio {ratio:.3f} bounded to {bounded:.3f}" if bounded != ratio else ""
                return Slowdown(bounded, "measured", model, False, note)
        k, basis, used = self._exponent(model, batch)
        fallback = basis != "model"
        note = f"{model!r} not measured: exponent of {used}" if fallback else ""
        return Slowdown((g_from / g_to) ** k, basis, used, fallback, note)

    def _slice_error(self) -> dict[str, float]:
        pairs: list[tuple[float, float]] = []
        for i, g in enumerate(self._groups):
            if len(g.times_s) < 2:
                continue
            others = [h for j, h in enumerate(self._groups) if j != i and h.model == g.model]
            k = _batch_exponent(others, g.batch)
            if k is None:
                fam = model_family(g.model)
                k = _fit_exponent([h for j, h in enumerate(self._groups) if j != i and model_family(h.model) == fam])
            if k is None:
                continue
            for s, t in g.times_s.items():
                rest = [(s2, t2) for s2, t2 in g.times_s.items() if s2 != s]
                preds = [t2 * (s2 / s) ** k for s2, t2 in rest]
                pairs.append((t, float(np.exp(np.mean(np.log(preds))))))
        return {"mape_pct": round(_mape(pairs), 3), "n": len(pairs), "groups": len(self._groups)}

    # ---- power --------------------------------------------------------------------------------
    def _curve(self, workload: str, batch: int, gpu: str) -> tuple[_PowerCurve, str, str, bool, str]:
        gpu_l = gpu.lower()
        if gpu_l not in {k[0] for k in self._curves}:
            raise ValueError(f"no power data for GPU {gpu!r}; measured: {sorted({k[0] for k in self._curves})}")
        names = {k[1] for k in self._curves if k[0] == gpu_l}
        name, basis, fallback, note = workload, "model", False, ""
        if workload not in names:
            fam = model_family(workload)
            cand = _ZEUS_FAMILY.get(fam)
            fallback = True
            if cand in names:
                name, basis, note = cand, "family", f"{workload!r} not measured: {cand} ({fam}) used"
            else:
                name, basis, note = "__global__", "global", f"{workload!r} not measured: mean of every workload"
        if name == "__global__":
            return self._global_curve(gpu_l), basis, "all workloads", fallback, note
        batches = np.array(sorted(b for (g, n, b) in self._curves if g == gpu_l and n == name))
        nearest = int(batches[np.argmin(np.abs(np.log(batches) - math.log(batch)))])
        if nearest != batch:
            note = (note + "; " if note else "") + f"batch {batch} not measured: nearest {nearest} used"
        return self._curves[(gpu_l, name, nearest)], basis, name, fallback, note

    def _global_curve(self, gpu: str) -> _PowerCurve:
        curves = [c for (g, _, _), c in self._curves.items() if g == gpu]
        limits = np.unique(np.concatenate([c.limits_w for c in curves]))
        rel = np.mean([np.interp(limits, c.limits_w, c.time_rel) for c in curves], axis=0)
        # power relative to each curve's highest: ratios hold, watts do not (PowerTradeoff says NaN)
        power = np.mean([np.interp(limits, c.limits_w, c.power_w / c.power_w.max()) for c in curves], axis=0)
        return _PowerCurve(limits, rel, power, rel)

    def power_tradeoff(self, workload: str, batch: int, from_limit_w: float, to_limit_w: float, gpu: str = "a40") -> PowerTradeoff:
        """Time, energy per unit of work and power when moving from one power limit to another."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        for name, v in (("from_limit_w", from_limit_w), ("to_limit_w", to_limit_w)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of watts, got {v!r}")
        curve, basis, used, fallback, note = self._curve(workload, batch, gpu)
        lo, hi = float(curve.limits_w[0]), float(curve.limits_w[-1])
        clipped = [w for w in (from_limit_w, to_limit_w) if not lo <= w <= hi]
        if clipped:
            note = (note + "; " if note else "") + f"limit(s) {clipped} outside the measured {lo:.0f}-{hi:.0f} W: clamped"

        def at(w: float) -> tuple[float, float]:
            return float(np.interp(w, curve.limits_w, curve.time_rel)), float(np.interp(w, curve.limits_w, curve.power_w))

        (t_from, p_from), (t_to, p_to) = at(from_limit_w), at(to_limit_w)
        slow = Slowdown(t_to / t_from, basis, used, fallback, note)
        watts = (p_from, p_to) if basis != "global" else (math.nan, math.nan)
        return PowerTradeoff(slow, (t_to * p_to) / (t_from * p_from), p_to / p_from, *watts)

    def power_slowdown(self, workload: str, batch: int, from_limit_w: float, to_limit_w: float, gpu: str = "a40") -> Slowdown:
        """Time per iteration at `to_limit_w` relative to `from_limit_w` on `gpu` (a Zeus GPU)."""
        return self.power_tradeoff(workload, batch, from_limit_w, to_limit_w, gpu).slowdown

    def _power_error(self) -> dict[str, float]:
        pairs: list[tuple[float, float]] = []
        for c in self._curves.values():
            for i in range(1, len(c.limits_w) - 1):
                x0, x1 = c.limits_w[i - 1], c.limits_w[i + 1]
                w = (c.limits_w[i] - x0) / (x1 - x0)
                pred = (1 - w) * c.time_s[i - 1] + w * c.time_s[i + 1]
                pairs.append((float(c.time_s[i]), float(pred)))
        return {"mape_pct": round(_mape(pairs), 3), "n": len(pairs), "curves": len(self._curves)}


def _load_slice_groups(root: Path) -> list[_Group]:
    times: dict[tuple[str, ...], dict[int, float]] = defaultdict(dict)
    meta: dict[tuple[str, ...], tuple[str, int]] = {}
    miso = root / "miso-a100-mig" / "derived_mig_iteration_time_summary.csv"
    if miso.is_file():
        for row in _read_csv(miso):
            if row["model"] == "dummy":
                continue
            key: tuple[str, ...] = ("miso", row["model"], row["batch_size"])
            times[key][compute_slices(row["mig_slice"])] = float(row["iter_time_median_s"])
            meta[key] = (row["model"], int(row["batch_size"]))
    if (root / "migperf-a100-mig").is_dir():
        for p in load_migperf(root):
            if p.latency_ms is None or not p.latency_ms > 0:
                continue
            j = p.job
            key = ("migperf", p.gpu, j.model_type, j.mode, str(j.batch_size), str(j.input_size))
            times[key][compute_slices(p.slice_name)] = p.latency_ms / 1000.0
            meta[key] = (j.model_type, j.batch_size)
    return [_Group(k, meta[k][0], meta[k][1], dict(sorted(v.items()))) for k, v in sorted(times.items())]


def _load_power_curves(root: Path) -> dict[tuple[str, str, int], _PowerCurve]:
    raw: dict[tuple[str, str, int], dict[tuple[str, str], dict[float, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for gpu in ZEUS_GPUS:
        path = root / "zeus-power-limit" / f"summary_power_{gpu}.csv"
        if not path.is_file():
            continue
        for row in _read_csv(path):
            key = (gpu, row["network"], int(row["batch_size"]))
            raw[key][(row["dataset"], row["optimizer"])][float(row["power_limit"])] = (
                float(row["time_per_epoch"]), float(row["average_power"]),
            )
    curves: dict[tuple[str, str, int], _PowerCurve] = {}
    for key, runs in sorted(raw.items()):
        common = sorted(set.intersection(*(set(r) for r in runs.values())))
        if len(common) < 2:
            continue
        lim = np.array(common)
        rels, pows, times = [], [], []
        for r in runs.values():
            t = np.array([r[w][0] for w in common])
            t = np.maximum.accumulate(t[::-1])[::-1]  # non-increasing in the limit (noise smoothed up)
            rels.append(t / t[-1])
            times.append(t)
            pows.append(np.array([r[w][1] for w in common]))
        curves[key] = _PowerCurve(lim, np.mean(rels, axis=0), np.mean(pows, axis=0), np.mean(times, axis=0))
    return curves
