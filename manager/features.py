"""Feature encoding for the forecaster: an application's raw samples -> fixed windows on a 1 s grid.

Every column is put on the evaluation protocol's 1 s grid (../shared/TRACE_FORMAT.md step 1: the
mean of the samples of second k, an empty second carrying the previous value forward) on one time
axis per application. A window is the last `window_s` seconds up to an origin (the origin's second
included); seconds before the application's first sample are zero with `valid` = 0.

Inputs are normalised by capacity where it is known, so one model serves different GPUs and slices:
memory by `mem_total_mib` (or, where the capacity is unknown, by a fallback scale from the history
itself, flagged by `mem_total_known` = 0), compute by 100 %, power by the power limit. A signal the
trace lacks is zero with its `*_present` flag at 0.

Encoding v3 (`FEATURE_VERSION`) adds context the 16 s window cannot hold, the same for every step of
a window (zero where `valid` = 0): the application's age at the origin (seconds since its first
sample, capped at `AGE_CAP_S` = 120 s and scaled to [0, 1]: the manager's window holds 120 s of
samples, so serving and training see the same capped value), and the mean, max, min and std of
memory and compute over the last `CONTEXT_S` = 30 s up to the origin, relative to the origin's value
in the units of `mem_frac_vs_last` / `sm_frac_vs_last`. Encoding v2 (the first 19 channels, computed
the same way) is still produced for checkpoints trained on it (`encode(..., version=2)`).

Encoding v4 adds the application's own leading signals, the in-app counters of the canonical trace
(`vgpu.traces.INAPP_NUMERIC`), each group with a presence flag so that one model serves applications
that report them and those that do not: the PyTorch allocator's allocated and reserved memory (as
fractions of the memory scale; `torch_present`), allocation retries in each second (log;
`retries_present`), a serving engine's requests running and waiting (log; `requests_present`) and its
KV cache in use (a fraction of the pool where `inapp_kv_total_mib` is reported, else of the memory
scale; `kv_present`). v3 and v2 checkpoints read none of them and are encoded as before.

Encoding v5 adds a long context without lengthening the sequence the network reads (the cost of a
forecast grows with the sequence; these are a handful of numpy calls per batch): over the last
`LONG_CONTEXT_S` = 120 s up to the origin (the manager's window), for memory and compute each, the
mean, max and min relative to the origin's value (units of `*_frac_vs_last`), the least-squares slope
(capacity fractions per minute), and the seconds since the last step change (a change between two
consecutive seconds of at least `STEP_MEM_FRAC` = 2 % of the memory scale, or `STEP_SM_FRAC` = 10 %
compute), scaled by 120 s and 1 where there was none in the span. They let a 16 s window tell a job
that has just ramped from one that has been flat for minutes, and a serving engine's slow drift
from noise. v4 and earlier are encoded as before.

Targets are the change from the origin's value in percent of the capacity:
`100 * (value[origin + h] - value[origin]) / capacity` for h in 1..5 s (percentage points for
compute); `mask` marks targets that exist
(both the origin's value and the future second are on the target's own grid).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from vgpu.traces import NUMERIC, AppTrace

FEATURES_V2: tuple[str, ...] = (
    "mem_frac",
    "mem_present",
    "sm_frac",
    "sm_present",
    "power_frac",
    "power_present",
    "mem_util_frac",
    "mem_util_present",
    "sm_clock_frac",
    "sm_clock_present",
    "pcie_tx_log",
    "pcie_rx_log",
    "pcie_present",
    "valid",
    "observed",
    "mem_total_known",
    "mem_scale_log2",
    "mem_frac_vs_last",
    "sm_frac_vs_last",
)
# v3: per-window context, broadcast over the window's valid steps
CONTEXT_FEATURES: tuple[str, ...] = (
    "age_frac",
    "mem_ctx_mean",
    "mem_ctx_max",
    "mem_ctx_min",
    "mem_ctx_std",
    "sm_ctx_mean",
    "sm_ctx_max",
    "sm_ctx_min",
    "sm_ctx_std",
)
FEATURES_V3 = FEATURES_V2 + CONTEXT_FEATURES
# v4: the application's own leading signals (in-app counters of the canonical trace), each group with
# a presence flag, zero where the application does not report them
INAPP_FEATURES: tuple[str, ...] = (
    "torch_allocated_frac",
    "torch_reserved_frac",
    "torch_present",
    "torch_retries_log",
    "retries_present",
    "requests_running_log",
    "requests_waiting_log",
    "requests_present",
    "kv_used_frac",
    "kv_present",
)
FEATURES_V4 = FEATURES_V3 + INAPP_FEATURES
# the trace columns v4 reads beyond vgpu.traces.NUMERIC
INAPP_COLUMNS: tuple[str, ...] = (
    "inapp_torch_allocated_mib",
    "inapp_torch_reserved_mib",
    "inapp_alloc_retries",
    "inapp_requests_running",
    "inapp_requests_waiting",
    "inapp_kv_used_mib",
    "inapp_kv_total_mib",
)
# v5: summaries of the last LONG_CONTEXT_S seconds, broadcast over the window's valid steps like v3's
LONG_FEATURES: tuple[str, ...] = (
    "mem_long_mean",
    "mem_long_max",
    "mem_long_min",
    "mem_long_slope",
    "mem_since_step",
    "sm_long_mean",
    "sm_long_max",
    "sm_long_min",
    "sm_long_slope",
    "sm_since_step",
)
FEATURES_V5 = FEATURES_V4 + LONG_FEATURES
FEATURES_BY_VERSION: dict[int, tuple[str, ...]] = {
    2: FEATURES_V2,
    3: FEATURES_V3,
    4: FEATURES_V4,
    5: FEATURES_V5,
}
# the encoding `encode`, `encode_latest` and `FeatureSpec` use when given none; every version of
# FEATURES_BY_VERSION can be encoded and served (a checkpoint names its own)
FEATURE_VERSION = 3
# the shipped model's encoding (manager/models/default.pt), and so what `vgpu train` writes by default
SHIPPED_FEATURE_VERSION = 5
FEATURES = FEATURES_BY_VERSION[FEATURE_VERSION]
N_FEATURES = len(FEATURES)
TARGET_NAMES: tuple[str, ...] = ("mem_used_mib", "sm_util_pct")
AGE_CAP_S = 120  # the manager keeps 1200 samples (120 s at 10 Hz) per application
CONTEXT_S = 30  # the summaries' span, origin included
LONG_CONTEXT_S = 120  # v5's span, origin included: what the manager's window holds at 10 Hz
STEP_MEM_FRAC = 0.02  # a step change of memory: >= 2 % of the memory scale from one second to the next
STEP_SM_FRAC = 0.10  # of compute: >= 10 percentage points
SLOPE_PER_S = 60.0  # slopes in capacity fractions per minute

# Fixed scales for signals with no capacity in the trace.
SM_CLOCK_SCALE_MHZ = 2000.0
PCIE_LOG_SCALE = 20.0  # log1p(kB/s) / 20 stays under 1 up to ~480 GB/s
COUNT_LOG_SCALE = 8.0  # log1p(requests) / 8 stays under 1 up to ~3000 requests
RETRIES_LOG_SCALE = 5.0  # log1p(allocation retries in the second) / 5
MEM_FALLBACK_MIN_MIB = 1024.0
MEM_FALLBACK_HEADROOM = 1.25  # unknown capacity: 1.25 x the largest memory seen so far
# Targets and outputs are in percent of capacity: changes of a few MiB on a 40 GB device would
# otherwise be ~1e-4, too small for the optimiser's step sizes.
OUTPUT_PER_CAPACITY = 100.0

# what the grids hold: the format's columns and the in-app counters v4 reads
GRID_COLUMNS: tuple[str, ...] = NUMERIC + INAPP_COLUMNS

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


def features_of(version: int) -> tuple[str, ...]:
    """The feature names of an encoding version (ValueError for one this build cannot produce)."""
    try:
        return FEATURES_BY_VERSION[version]
    except KeyError:
        known = ", ".join(f"v{v}" for v in sorted(FEATURES_BY_VERSION))
        raise ValueError(f"unknown feature encoding v{version}; this build encodes {known}") from None


def history_needed_s(window_s: int, version: int = FEATURE_VERSION) -> int:
    """How many recent seconds of a history an encoding reads (the age aside, which needs only the
    history's first sample second)."""
    if version >= 5:
        return max(window_s, LONG_CONTEXT_S)
    return max(window_s, CONTEXT_S) if version >= 3 else window_s


@dataclass(frozen=True)
class FeatureSpec:
    """What the network was trained on; stored in the checkpoint and checked on load."""

    window_s: int
    horizons_s: tuple[int, ...] = (1, 2, 3, 4, 5)
    features: tuple[str, ...] = FEATURES
    targets: tuple[str, ...] = TARGET_NAMES
    version: int = FEATURE_VERSION

    def __post_init__(self) -> None:
        if self.window_s < 2:
            raise ValueError(f"window_s must be at least 2, not {self.window_s}")
        if not self.horizons_s or min(self.horizons_s) < 1:
            raise ValueError(f"horizons_s must be positive, not {self.horizons_s}")

    @classmethod
    def for_version(cls, window_s: int, version: int = FEATURE_VERSION) -> FeatureSpec:
        return cls(window_s=window_s, features=features_of(version), version=version)

    def to_dict(self) -> dict[str, object]:
        return {
            "window_s": self.window_s,
            "horizons_s": list(self.horizons_s),
            "features": list(self.features),
            "targets": list(self.targets),
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> FeatureSpec:
        horizons = data["horizons_s"]
        features = data["features"]
        targets = data["targets"]
        assert isinstance(horizons, list) and isinstance(features, list) and isinstance(targets, list)
        return cls(
            window_s=int(data["window_s"]),  # type: ignore[call-overload]
            horizons_s=tuple(int(h) for h in horizons),
            features=tuple(str(f) for f in features),
            targets=tuple(str(t) for t in targets),
            version=int(data["version"]),  # type: ignore[call-overload]
        )


@dataclass(frozen=True)
class Grid:
    """Several applications' columns on 1 s grids, laid end to end on one flat axis: application i
    owns bins `offsets[i]:offsets[i + 1]`, bin `offsets[i] + k` being second `start_s[i] + k`.

    `values[c]` is the protocol grid of column c: NaN before its first value and after its last
    sample second (so a carried-forward value never invents a future truth). `mem_max_mib` is the
    largest raw memory sample of the application up to and including each second. `first_s` is
    the second of each application's first sample in its whole history (`start_s` unless earlier
    samples were left out of the grid)."""

    offsets: npt.NDArray[np.int64]
    start_s: npt.NDArray[np.int64]
    values: dict[str, F64]
    observed: npt.NDArray[np.bool_]
    mem_max_mib: F64
    first_s: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_apps(self) -> int:
        return len(self.offsets) - 1

    def app_of(self, bins: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return np.searchsorted(self.offsets, bins, side="right") - 1

    def last_bins(self) -> npt.NDArray[np.int64]:
        """Each application's last second (its forecast origin); -1 for an empty application."""
        last = self.offsets[1:] - 1
        return np.where(self.offsets[1:] > self.offsets[:-1], last, -1)


def build_grid(traces: Sequence[AppTrace], columns: Sequence[str] = GRID_COLUMNS) -> Grid:
    """The 1 s grids of many applications at once (a handful of numpy calls, whatever their number);
    `columns` of GRID_COLUMNS (the others' grids all missing)."""
    lengths = np.array([len(t) for t in traces], dtype=np.int64)
    t_all = np.concatenate([t.t_s for t in traces]) if traces else np.zeros(0)
    return _grid(lengths, t_all, _columns(traces, lengths, columns))


def build_recent_grid(traces: Sequence[AppTrace], columns: Sequence[str], window_s: int) -> Grid:
    """`build_grid` of only the samples that windows of `window_s` seconds ending at each application's
    last second need: its samples from the last second with a sample before the window on (that
    second whole, so its mean and anything carried from it are unchanged). A column's values in such a
    window are those of the whole history's grid; `first_s` is still each application's first second,
    `mem_max_mib` the maximum over the kept samples only. An application keeps its whole history where
    a column's first kept sample has no value (a value from before the cut might be carried into the
    window). A window that ends earlier (a column whose samples stop before its application's) may
    reach before the cut: `start_s > first_s` says which applications were cut. Samples out of time
    order, or times that are not finite, keep every history whole."""
    t_whole = np.concatenate([t.t_s for t in traces]) if traces else np.zeros(0)
    lengths = np.array([len(t) for t in traces], dtype=np.int64)
    step = np.diff(t_whole)
    ends = np.cumsum(lengths)
    step[ends[(ends > 0) & (ends < len(t_whole))] - 1] = 0.0  # one application's last to the next one's first
    if not len(t_whole) or not np.isfinite(t_whole).all() or np.any(step < 0):
        return build_grid(traces, columns)
    # per application: two binary searches on its own times, then a look at its first kept sample
    keep_from = np.zeros(len(traces), dtype=np.int64)
    for i, trace in enumerate(traces):
        t = trace.t_s
        if not len(t):
            continue
        j = int(np.searchsorted(t, math.floor(t[-1]) - window_s + 1, side="left"))  # first in the window
        if j == 0:
            continue
        j = int(np.searchsorted(t, math.floor(t[j - 1]), side="left"))  # that second whole
        cols_here = (trace.columns.get(name) for name in columns)
        if all(col is None or math.isfinite(col[j]) for col in cols_here):
            keep_from[i] = j
    if not keep_from.any():
        return build_grid(traces, columns)
    kept = [AppTrace(t.app, t.t_s[j:], {n: c[j:] for n, c in t.columns.items() if n in columns}) if j else t
            for t, j in zip(traces, keep_from.tolist(), strict=True)]
    first_s = np.array([math.floor(t.t_s[0]) if len(t) else 0 for t in traces], dtype=np.int64)
    kept_lengths = lengths - keep_from
    t_kept = np.concatenate([t.t_s for t in kept])
    return _grid(kept_lengths, t_kept, _columns(kept, kept_lengths, columns), first_s=first_s)


def _columns(traces: Sequence[AppTrace], lengths: npt.NDArray[np.int64],
             names: Sequence[str] = GRID_COLUMNS) -> dict[str, F64]:
    """Each numeric column of all traces end to end (NaN where a trace lacks it)."""
    cols: dict[str, F64] = {}
    have: set[str] = set().union(*(t.columns for t in traces))
    for name in names:
        if name not in have:
            continue
        parts = [t.columns.get(name) for t in traces]
        if all(part is None for part in parts):
            continue
        whole = [part for part in parts if part is not None]
        if len(whole) == len(parts):  # every trace has it: one concatenation
            cols[name] = np.concatenate(whole).astype(np.float64, copy=False)
            continue
        cols[name] = np.concatenate(
            [np.full(n, np.nan) if part is None else np.asarray(part, dtype=np.float64)
             for part, n in zip(parts, lengths, strict=True)]
        )
    return cols


def _grid(
    lengths: npt.NDArray[np.int64],
    t_all: F64,
    cols: dict[str, F64],
    mem_seed_mib: F64 | None = None,
    first_s: npt.NDArray[np.int64] | None = None,
) -> Grid:
    """`build_grid` on columns laid end to end (application i owns `lengths[i]` samples).
    `mem_seed_mib` (per application, -inf for none) joins the running memory maximum at each
    application's first second: the largest memory of samples left out before it; `first_s` (per
    application) is the second of its first sample, where samples before were left out."""
    n_apps = len(lengths)
    app_of_sample = np.repeat(np.arange(n_apps), lengths)
    sample_offsets = np.concatenate([[0], np.cumsum(lengths)])
    secs = np.floor(t_all).astype(np.int64)
    order: npt.NDArray[np.int64] | None = None
    step = np.diff(secs)
    # a step from one application's last sample to the next one's first is not out of order
    step[sample_offsets[1:-1][(sample_offsets[1:-1] > 0) & (sample_offsets[1:-1] < len(secs))] - 1] = 0
    if np.any(step < 0):  # samples out of time order: sort within each app
        order = np.lexsort((t_all, app_of_sample))
        secs = secs[order]
    nonempty = lengths > 0
    start = (
        np.where(nonempty, secs[np.minimum(sample_offsets[:-1], max(len(secs) - 1, 0))], 0)
        if len(secs)
        else np.zeros(n_apps, np.int64)
    )
    end = (
        np.where(nonempty, secs[np.maximum(sample_offsets[1:] - 1, 0)], -1)
        if len(secs)
        else np.full(n_apps, -1)
    )
    n_bins = np.where(lengths > 0, end - start + 1, 0)
    offsets = np.concatenate([[0], np.cumsum(n_bins)]).astype(np.int64)
    total = int(offsets[-1])
    bins = (offsets[:-1] - start)[app_of_sample] + secs
    bin_app = np.repeat(np.arange(n_apps), n_bins)
    app_first_bin = offsets[:-1][bin_app]
    arange = np.arange(total)

    all_counts = np.bincount(bins, minlength=total)
    observed = all_counts > 0
    # every second has a sample (the profiler's usual stream): a column with no missing value needs
    # neither carrying forward nor a cut after its last sample, its grid is the per-second mean
    every_second = bool(observed.all())
    # then samples are in bin order (sorted within each application, applications in turn) and bin
    # k's first sample is the count of the bins before it: a column's per-second sums are one
    # reduceat over contiguous runs, and where they are all finite so is every sample
    firsts = np.concatenate([[0], np.cumsum(all_counts[:-1])]) if every_second and total else None
    values: dict[str, F64] = {}
    mem_max = np.full(total, np.nan)
    for name in GRID_COLUMNS:
        col = cols.get(name)
        if col is None and name not in NUMERIC:
            continue  # an in-app column no application has: absent from the grid, read as all missing
        if col is not None and order is not None:
            col = col[order]
        if col is not None and firsts is not None:
            sums = np.add.reduceat(col, firsts)
            if np.isfinite(sums).all():
                values[name] = sums / all_counts
                if name == "mem_used_mib":
                    mem_max = _running_max(col, bins, bin_app, offsets, nonempty, mem_seed_mib, firsts)
                continue
        ok = np.isfinite(col) if col is not None else None
        if col is None or ok is None or not ok.any():
            values[name] = np.full(total, np.nan)
            continue
        if every_second and ok.all():
            values[name] = np.bincount(bins, weights=col, minlength=total) / all_counts
            if name == "mem_used_mib":
                mem_max = _running_max(col, bins, bin_app, offsets, nonempty, mem_seed_mib, firsts)
            continue
        b = bins[ok]
        sums = np.bincount(b, weights=col[ok], minlength=total)
        counts = np.bincount(b, minlength=total)
        have = counts > 0
        grid = np.full(total, np.nan)
        grid[have] = sums[have] / counts[have]
        # carry forward within each application, and stop after the column's last sample second
        fill = np.where(have, arange, -1)
        np.maximum.accumulate(fill, out=fill)
        fill = np.where(fill >= app_first_bin, fill, -1)
        out = np.where(fill >= 0, grid[np.maximum(fill, 0)], np.nan)
        # each application's last bin with a value (bins are sorted): the last ok sample per app
        app_ok = app_of_sample[ok]
        pos = np.searchsorted(app_ok, np.arange(n_apps), side="right") - 1
        mine = (pos >= 0) & (app_ok[np.maximum(pos, 0)] == np.arange(n_apps))
        last_have = np.where(mine, b[np.maximum(pos, 0)], -1)
        out[arange > last_have[bin_app]] = np.nan
        values[name] = out
        if name == "mem_used_mib":
            mem_max = _running_max(col[ok], b, bin_app, offsets, nonempty, mem_seed_mib)
    return Grid(
        offsets=offsets,
        start_s=start,
        values=values,
        observed=observed,
        mem_max_mib=mem_max,
        first_s=start if first_s is None else np.asarray(first_s, dtype=np.int64),
    )


def _running_max(
    mem: F64,
    b: npt.NDArray[np.int64],
    bin_app: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    nonempty: npt.NDArray[np.bool_],
    mem_seed_mib: F64 | None,
    firsts: npt.NDArray[np.int64] | None = None,
) -> F64:
    """The running maximum of memory samples `mem` (in bins `b`, sorted) within each application,
    from `mem_seed_mib` at its first bin on; NaN before its first sample. `firsts`, where given, is
    the position of each bin's first sample (every bin having one)."""
    raw_max = np.full(len(bin_app), -np.inf)
    if firsts is None:
        firsts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    raw_max[b[firsts]] = np.maximum.reduceat(mem, firsts)
    if mem_seed_mib is not None:
        heads = offsets[:-1][nonempty]
        raw_max[heads] = np.maximum(raw_max[heads], mem_seed_mib[nonempty])
    # running max within each application: lift each application above the ones before it
    lift = bin_app.astype(np.float64) * 1e12
    cum = np.maximum.accumulate(raw_max + lift) - lift
    return np.where(np.isfinite(cum) & (cum >= 0), cum, np.nan)


@dataclass(frozen=True)
class Windows:
    """Windows for a set of origins. x: (N, window_s, features of the version) float32; the scales turn a
    normalised target back into units: value = last + y * scale."""

    x: F32
    mem_scale_mib: F64  # (N,)
    last: F64  # (N, 2): origin values of (mem_used_mib, sm_util_pct), NaN where unknown
    origin_bin: npt.NDArray[np.int64]  # (N,) origin, as a bin of the grid

    @property
    def scales(self) -> F64:
        """(N, 2) units per output unit: outputs are in percent of the capacity (memory scale,
        100 % compute), so value = last + output * scale with scale = capacity / 100."""
        return (
            np.stack([self.mem_scale_mib, np.full_like(self.mem_scale_mib, 100.0)], axis=1)
            / OUTPUT_PER_CAPACITY
        )


def _carry(values: F64, app_first_bin: npt.NDArray[np.int64]) -> F64:
    """Carry the last value forward, within each application, over every NaN (inputs may use a
    stale value; targets may not)."""
    finite = np.isfinite(values)
    if finite.all() or not finite.any():
        return values  # nothing to carry (or nothing to carry from)
    idx = np.where(finite, np.arange(len(values)), -1)
    np.maximum.accumulate(idx, out=idx)
    idx = np.where(idx >= app_first_bin, idx, -1)
    return np.where(idx >= 0, values[np.maximum(idx, 0)], np.nan)


def encode(
    grid: Grid, window_s: int, origins: npt.NDArray[np.int64], version: int = FEATURE_VERSION
) -> Windows:
    """Feature windows of `window_s` seconds ending at each origin (bins of the grid), in the
    feature encoding `version` (ValueError for an unknown one)."""
    names = features_of(version)
    origins = np.asarray(origins, dtype=np.int64)
    total = len(grid)
    if len(origins) and (origins.min() < 0 or origins.max() >= total):
        raise IndexError(f"origin outside the grid of {total} bins")
    w = window_s
    n = len(origins)
    if n == 0:
        return Windows(
            x=np.zeros((0, w, len(names)), dtype=np.float32),
            mem_scale_mib=np.zeros(0),
            last=np.zeros((0, 2)),
            origin_bin=origins,
        )
    bin_app = np.repeat(np.arange(grid.n_apps), np.diff(grid.offsets))
    first_bin = grid.offsets[:-1][bin_app]
    origin_first = grid.offsets[:-1][grid.app_of(origins)] if n else np.zeros(0, dtype=np.int64)
    pos = origins[:, None] + np.arange(-w + 1, 1)[None, :]
    valid = pos >= origin_first[:, None]

    at = np.maximum(pos, 0)  # row i ends at bin origins[i]; steps before the application are invalid

    def win(col: F64) -> F64:
        return np.where(valid, col[at], np.nan)

    v = {c: _carry(grid.values[c], first_bin) for c in NUMERIC}
    mem, sm, total_mib = v["mem_used_mib"], v["sm_util_pct"], v["mem_total_mib"]
    total_ok = np.isfinite(total_mib) & (total_mib > 0)
    seen = np.nan_to_num(grid.mem_max_mib[origins], nan=0.0)
    fallback = np.maximum(MEM_FALLBACK_MIN_MIB, MEM_FALLBACK_HEADROOM * seen)
    mem_scale = np.where(total_ok[origins], total_mib[origins], fallback)
    known = total_ok[origins].astype(np.float64)

    x = np.zeros((n, w, len(names)), dtype=np.float32)
    fi = names.index

    def put(name: str, present: str | None, values: F64) -> npt.NDArray[np.bool_]:
        ok = np.isfinite(values)
        x[..., fi(name)] = np.where(ok, values, 0.0)
        if present is not None:
            x[..., fi(present)] = ok
        return ok

    x[..., fi("valid")] = valid
    x[..., fi("observed")] = np.nan_to_num(win(grid.observed.astype(np.float64)))
    mem_frac = win(mem) / mem_scale[:, None]
    put("mem_frac", "mem_present", mem_frac)
    sm_frac = win(sm) / 100.0
    put("sm_frac", "sm_present", sm_frac)
    limit = v["power_limit_w"]
    limit_ok = np.isfinite(limit) & (limit > 0)
    power = np.where(limit_ok, v["power_w"] / np.where(limit_ok, limit, 1.0), np.nan)
    put("power_frac", "power_present", win(power))
    put("mem_util_frac", "mem_util_present", win(v["mem_util_pct"]) / 100.0)
    put("sm_clock_frac", "sm_clock_present", win(v["sm_clock_mhz"]) / SM_CLOCK_SCALE_MHZ)
    ok_tx = put("pcie_tx_log", None, win(np.log1p(v["pcie_tx_kbps"])) / PCIE_LOG_SCALE)
    ok_rx = put("pcie_rx_log", None, win(np.log1p(v["pcie_rx_kbps"])) / PCIE_LOG_SCALE)
    x[..., fi("pcie_present")] = ok_tx | ok_rx
    x[..., fi("mem_total_known")] = known[:, None] * valid
    x[..., fi("mem_scale_log2")] = (np.log2(np.maximum(mem_scale, 1.0)) / 20.0)[:, None] * valid
    last_mem, last_sm = mem[origins], sm[origins]
    put("mem_frac_vs_last", None, mem_frac - (last_mem / mem_scale)[:, None])
    put("sm_frac_vs_last", None, sm_frac - (last_sm / 100.0)[:, None])
    if version >= 3:
        app = grid.app_of(origins)
        origin_s = grid.start_s[app] + (origins - grid.offsets[:-1][app])
        age = np.clip(origin_s - grid.first_s[app], 0, AGE_CAP_S) / AGE_CAP_S
        ctx_pos = origins[:, None] + np.arange(-CONTEXT_S + 1, 1)[None, :]
        in_app = ctx_pos >= origin_first[:, None]
        # memory and compute stacked (2N rows), so each summary is one numpy call for both
        padded = np.full((2, total + CONTEXT_S - 1), np.nan)
        padded[0, CONTEXT_S - 1 :] = mem
        padded[1, CONTEXT_S - 1 :] = sm
        span = sliding_window_view(padded, CONTEXT_S, axis=1)[:, origins]  # (2, N, CONTEXT_S)
        base = np.stack([last_mem, last_sm])[..., None]
        scale = np.stack([mem_scale, np.full(n, 100.0)])[..., None]
        stats = _summaries(((span - base) / scale).reshape(2 * n, CONTEXT_S), np.tile(in_app, (2, 1)))
        context = np.stack([age, *(s[:n] for s in stats), *(s[n:] for s in stats)], axis=1)  # CONTEXT_FEATURES' order
        first_ctx = fi(CONTEXT_FEATURES[0])
        x[..., first_ctx : first_ctx + len(CONTEXT_FEATURES)] = context[:, None, :] * valid[..., None]
    if version >= 4:
        _encode_inapp(grid, win, first_bin, mem_scale, put, x, fi)
    if version >= 5:
        long = _long_context(grid, mem, sm, origins, origin_first, mem_scale, first_bin)
        first_long = fi(LONG_FEATURES[0])
        x[..., first_long : first_long + len(LONG_FEATURES)] = long[:, None, :] * valid[..., None]
    np.clip(x, -10.0, 10.0, out=x)
    return Windows(
        x=x, mem_scale_mib=mem_scale, last=np.stack([last_mem, last_sm], axis=1), origin_bin=origins
    )


def _encode_inapp(
    grid: Grid,
    win: Callable[[F64], F64],
    first_bin: npt.NDArray[np.int64],
    mem_scale: F64,
    put: Callable[[str, str | None, F64], npt.NDArray[np.bool_]],
    x: F32,
    fi: Callable[[str], int],
) -> None:
    """The v4 channels: the PyTorch allocator's allocated and reserved memory (fractions of the
    memory scale), allocation retries per second (log), a serving engine's requests running and
    waiting (log) and KV cache in use (fraction of its pool where reported, else of the memory
    scale). Each group has a presence flag, set at the steps where its signal has a value."""
    have = grid.values.keys()
    if not any(name in have for name in INAPP_COLUMNS):
        return  # every channel zero and every presence flag 0, as `x` already holds
    nan = np.full(len(grid), np.nan)

    def col(name: str) -> F64:
        values = grid.values.get(name)
        return nan if values is None else _carry(values, first_bin)

    scale = mem_scale[:, None]
    ok_a = put("torch_allocated_frac", None, win(col("inapp_torch_allocated_mib")) / scale)
    ok_r = put("torch_reserved_frac", None, win(col("inapp_torch_reserved_mib")) / scale)
    x[..., fi("torch_present")] = ok_a | ok_r
    retries = col("inapp_alloc_retries")
    # the counter is cumulative: its increase over the second before (never negative: a restart)
    rate = np.maximum(np.diff(retries, prepend=np.nan), 0.0)
    rate[first_bin == np.arange(len(grid))] = np.nan  # no second before the application's first
    put("torch_retries_log", "retries_present", win(np.log1p(rate)) / RETRIES_LOG_SCALE)
    ok_run = put("requests_running_log", None, win(np.log1p(col("inapp_requests_running"))) / COUNT_LOG_SCALE)
    ok_wait = put("requests_waiting_log", None, win(np.log1p(col("inapp_requests_waiting"))) / COUNT_LOG_SCALE)
    x[..., fi("requests_present")] = ok_run | ok_wait
    kv_total = col("inapp_kv_total_mib")
    kv_scale = np.where(np.isfinite(kv_total) & (kv_total > 0), kv_total, np.nan)
    kv_used = win(col("inapp_kv_used_mib"))
    kv_den = win(kv_scale)
    put("kv_used_frac", "kv_present", kv_used / np.where(np.isfinite(kv_den), kv_den, scale))


def _long_context(
    grid: Grid,
    mem: F64,
    sm: F64,
    origins: npt.NDArray[np.int64],
    origin_first: npt.NDArray[np.int64],
    mem_scale: F64,
    first_bin: npt.NDArray[np.int64],
) -> F64:
    """The v5 channels (N, len(LONG_FEATURES)) in LONG_FEATURES' order: per target, the mean, max and
    min of the last LONG_CONTEXT_S seconds relative to the origin's value, the least-squares slope,
    and the seconds since the last step change (see the module docstring). Origins are taken in
    chunks so that the (origins x span) temporaries stay bounded in training."""
    chunk = 8192
    if len(origins) > chunk:
        return np.concatenate(
            [
                _long_context(grid, mem, sm, origins[i : i + chunk], origin_first[i : i + chunk],
                              mem_scale[i : i + chunk], first_bin)
                for i in range(0, len(origins), chunk)
            ]
        )
    n, span_s, total = len(origins), LONG_CONTEXT_S, len(grid)
    pos = origins[:, None] + np.arange(-span_s + 1, 1)[None, :]
    inside = pos >= origin_first[:, None]
    padded = np.full((2, total + span_s - 1), np.nan)
    padded[0, span_s - 1 :] = mem
    padded[1, span_s - 1 :] = sm
    span = sliding_window_view(padded, span_s, axis=1)[:, origins]  # (2, N, span_s)
    scale = np.stack([mem_scale, np.full(n, 100.0)])[..., None]
    frac = span / scale
    base = frac[:, :, -1:]
    rel = (frac - base).reshape(2 * n, span_s)
    ok = np.tile(inside, (2, 1)) & np.isfinite(rel)
    mean, hi, lo, _ = _summaries(rel, np.tile(inside, (2, 1)))
    # least-squares slope over the valid seconds, in fractions per minute
    t = np.broadcast_to(np.arange(span_s, dtype=np.float64), rel.shape)
    cnt = ok.sum(axis=1)
    denom = np.maximum(cnt, 1)
    t_mean = np.where(ok, t, 0.0).sum(axis=1) / denom
    dt = np.where(ok, t - t_mean[:, None], 0.0)
    var = (dt * dt).sum(axis=1)
    cov = (dt * np.where(ok, rel, 0.0)).sum(axis=1)
    slope = np.where((cnt >= 2) & (var > 0), cov / np.maximum(var, 1e-12), 0.0) * SLOPE_PER_S
    # seconds since the last step change: the latest second of the span whose change from the second
    # before is at least the threshold times the origin's scale
    since = []
    no_before = first_bin == np.arange(total)  # an application's first second has no change into it
    for values, threshold, sc in ((mem, STEP_MEM_FRAC, mem_scale), (sm, STEP_SM_FRAC, np.full(n, 100.0))):
        jump = np.abs(np.diff(values, prepend=np.nan))
        jump[no_before] = np.nan
        jspan = np.concatenate([np.full(span_s - 1, np.nan), jump])
        change = sliding_window_view(jspan, span_s)[origins]
        hit = inside & np.isfinite(change) & (change >= threshold * sc[:, None])
        latest = np.where(hit.any(axis=1), span_s - 1 - np.argmax(hit[:, ::-1], axis=1), -1)
        since.append(np.where(latest >= 0, (span_s - 1 - latest) / span_s, 1.0))
    return np.stack(
        [mean[:n], hi[:n], lo[:n], slope[:n], since[0], mean[n:], hi[n:], lo[n:], slope[n:], since[1]],
        axis=1,
    )


def _summaries(values: F64, inside: npt.NDArray[np.bool_]) -> list[F64]:
    """Mean, max, min and std of each row's finite values inside (0 for a row with none)."""
    ok = inside & np.isfinite(values)
    count = ok.sum(axis=1)
    some = count > 0
    denom = np.maximum(count, 1)
    z = np.where(ok, values, 0.0)
    mean = z.sum(axis=1) / denom
    hi = np.where(ok, values, -np.inf).max(axis=1)
    lo = np.where(ok, values, np.inf).min(axis=1)
    dev = np.where(ok, values - mean[:, None], 0.0)
    std = np.sqrt((dev * dev).sum(axis=1) / denom)
    return [np.where(some, s, 0.0) for s in (mean, hi, lo, std)]


def targets(grid: Grid, windows: Windows, horizons_s: Sequence[int]) -> tuple[F32, npt.NDArray[np.bool_]]:
    """Normalised change targets (N, 2, H) and their mask for the windows' origins. A target exists
    where the origin has a value and the target's own grid has one h seconds later in the same
    application (never carried past its last sample)."""
    origins = windows.origin_bin
    app_end = grid.offsets[1:][grid.app_of(origins)] if len(origins) else np.zeros(0, dtype=np.int64)
    y = np.zeros((len(origins), 2, len(horizons_s)), dtype=np.float32)
    mask = np.zeros(y.shape, dtype=bool)
    scales = windows.scales
    for ti, name in enumerate(TARGET_NAMES):
        col = grid.values[name]
        last = windows.last[:, ti]
        for hi, h in enumerate(horizons_s):
            idx = origins + h
            inside = idx < app_end
            future = np.full(len(origins), np.nan)
            future[inside] = col[idx[inside]]
            ok = np.isfinite(future) & np.isfinite(last)
            y[ok, ti, hi] = (future[ok] - last[ok]) / scales[ok, ti]
            mask[:, ti, hi] = ok
    return y, mask


def encode_latest(
    histories: Sequence[AppTrace], window_s: int, version: int = FEATURE_VERSION
) -> tuple[Windows, npt.NDArray[np.bool_]]:
    """One window per history, ending at its last second (the forecast origin), in the feature
    encoding `version`. Returns the windows of the non-empty histories and a boolean per history
    saying which those are.

    Only each history's recent seconds (`history_needed_s`) are put on the grid (see `_recent_cut`);
    the windows are the same as from the whole histories."""
    features_of(version)  # an unknown version fails before any work
    lengths = np.array([len(t) for t in histories], dtype=np.int64)
    t_all = np.concatenate([t.t_s for t in histories]) if histories else np.zeros(0)
    cols = _columns(histories, lengths)
    cut = _recent_cut(lengths, t_all, cols, history_needed_s(window_s, version))
    if cut is None:
        grid = _grid(lengths, t_all, cols)
    else:
        keep, kept_lengths, mem_seed, first_s = cut
        grid = _grid(kept_lengths, t_all[keep], {c: v[keep] for c, v in cols.items()}, mem_seed, first_s)
    last = grid.last_bins()
    present = last >= 0
    return encode(grid, window_s, last[present], version), present


def _recent_cut(
    lengths: npt.NDArray[np.int64], t_all: F64, cols: dict[str, F64], window_s: int
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64], F64, npt.NDArray[np.int64]] | None:
    """Which samples the latest windows need: of each application, the samples from the last
    second with a sample before its last `window_s` seconds on (that second whole, so its mean and
    anything carried from it are unchanged). An application keeps its whole history where a column
    it had earlier has no value in that first kept second (the window could carry that older value
    forward). Returns (samples kept, kept per application, largest memory sample left out per
    application (-inf where none), second of each application's first sample (0 where empty)), or
    None to keep everything (samples out of time order, nothing to cut)."""
    n_apps = len(lengths)
    if n_apps == 0 or len(t_all) == 0:
        return None
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ends = starts + lengths
    nonempty = lengths > 0
    # the usual case, histories no longer than the span: nothing before any window, no per-sample
    # work (out of time order or not finite, the full test below keeps everything too)
    first_t = t_all[starts[nonempty]]
    last_t = t_all[ends[nonempty] - 1]
    if np.all(np.floor(first_t) >= np.floor(last_t) - window_s + 1):
        return None
    secs = np.floor(t_all)
    if not np.isfinite(secs).all():
        return None
    app_of_sample = np.repeat(np.arange(n_apps), lengths)
    # one increasing key over all applications, so one searchsorted serves all of them
    span = float(secs.max() - secs.min()) + 2.0
    key = app_of_sample * span + (secs - secs.min())
    if np.any(np.diff(key) < 0):
        return None
    base = np.arange(n_apps) * span - secs.min()
    last_sec = np.where(nonempty, secs[np.maximum(ends - 1, 0)], 0.0)
    before = np.searchsorted(key, base + last_sec - window_s + 1, side="left")  # first in the window
    has_before = nonempty & (before > starts)
    cut_sec = np.where(has_before, secs[np.maximum(before - 1, 0)], 0.0)
    first = np.where(has_before, np.searchsorted(key, base + cut_sec, side="left"), starts)
    first_end = np.where(has_before, np.searchsorted(key, base + cut_sec, side="right"), starts)
    if not np.any(first > starts):
        return None
    # carry from before the cut: a column with a value before it and none in its first second
    cuts = has_before & (first > starts)
    bounds = np.stack([starts, first, first_end], axis=1)[cuts].ravel()
    for col in cols.values():
        if not cuts.any():
            break
        finite = np.isfinite(col)
        if finite.all():
            continue  # a value in every first kept second: nothing to carry from before the cut
        seg = np.logical_or.reduceat(finite, bounds).reshape(-1, 3)
        # segments [start, first) and [first, first_end) are non-empty for every cut application
        back = np.zeros(n_apps, dtype=bool)
        back[cuts] = seg[:, 0] & ~seg[:, 1]
        first = np.where(back, starts, first)
        cuts &= ~back
        bounds = np.stack([starts, first, first_end], axis=1)[cuts].ravel()
    mem_seed = np.full(n_apps, -np.inf)
    mem = cols.get("mem_used_mib")
    if mem is not None and cuts.any():
        prior = np.fmax.reduceat(mem, bounds).reshape(-1, 3)[:, 0]  # NaN where all are missing
        mem_seed[cuts] = np.where(np.isfinite(prior), prior, -np.inf)
    pos = np.arange(len(t_all))
    keep = pos >= first[app_of_sample]
    first_s = np.where(nonempty, secs[np.minimum(starts, len(secs) - 1)], 0.0).astype(np.int64)
    return keep, ends - first, mem_seed, first_s
