"""The canonical trace format (../shared/TRACE_FORMAT.md, v1): reading, writing, the 1 s grid.

Every tool that reads GPU usage history goes through `read_trace`; converters for other formats
write through `write_trace`. A row that cannot be parsed is reported with file, line and reason and
skipped (or, with `strict=True`, fails the read); a file with no usable row is an error.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

TARGETS = ("mem_used_mib", "sm_util_pct")
OPTIONAL_NUMERIC = (
    "mem_total_mib",
    "power_w",
    "power_limit_w",
    "mem_util_pct",
    "sm_clock_mhz",
    "pcie_tx_kbps",
    "pcie_rx_kbps",
)
NUMERIC = TARGETS + OPTIONAL_NUMERIC
HEADER = ("t_s", "app", "gpu", *NUMERIC)
_PCT_COLUMNS = ("sm_util_pct", "mem_util_pct")
_NONNEGATIVE = ("mem_used_mib", "mem_total_mib", "power_w", "power_limit_w", "sm_clock_mhz", "pcie_tx_kbps", "pcie_rx_kbps")

FloatArray = npt.NDArray[np.float64]


class TraceFormatError(ValueError):
    """The file is not a usable canonical trace (or, in strict mode, has a bad row)."""


@dataclass(frozen=True)
class RowIssue:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class AppTrace:
    """One application's samples. Every column array has the length of `t_s`; NaN is missing."""

    app: str
    t_s: FloatArray
    columns: Mapping[str, FloatArray]
    gpu: str | None = None

    def __post_init__(self) -> None:
        n = len(self.t_s)
        for name, values in self.columns.items():
            if name not in NUMERIC:
                raise ValueError(f"unknown column {name!r}")
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values for {n} samples")

    def __len__(self) -> int:
        return len(self.t_s)

    def column(self, name: str) -> FloatArray:
        """The column's values, all NaN where the trace lacks it."""
        if name not in NUMERIC:
            raise KeyError(name)
        values = self.columns.get(name)
        if values is None:
            return np.full(len(self.t_s), np.nan)
        return values

    def has(self, name: str) -> bool:
        values = self.columns.get(name)
        return values is not None and bool(np.isfinite(values).any())

    @property
    def duration_s(self) -> float:
        return float(self.t_s[-1] - self.t_s[0]) if len(self.t_s) else 0.0


@dataclass(frozen=True)
class Trace:
    apps: dict[str, AppTrace]
    issues: list[RowIssue] = field(default_factory=list)
    source: str = ""

    @property
    def samples(self) -> int:
        return sum(len(a) for a in self.apps.values())


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115


def _parse_float(text: str) -> float | None:
    text = text.strip()
    if text == "":
        return None
    value = float(text)  # ValueError on garbage; the caller reports it
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def read_trace(path: str | Path, *, strict: bool = False) -> Trace:
    """Read a canonical trace (CSV or CSV.gz).

    Bad rows (unparsable numbers, out-of-range values, no target value, time going backwards within
    an application) are skipped and listed in `Trace.issues`; with `strict=True` the first one
    raises TraceFormatError.
    """
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file")
    try:
        with _open_text(path) as fh:
            return _read(fh, str(path), strict)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc


def _read(fh: Iterable[str], name: str, strict: bool) -> Trace:
    reader = csv.reader(fh)
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise TraceFormatError(f"{name}: empty file") from None
    index = {h: i for i, h in enumerate(header)}
    for required in ("t_s", "app"):
        if required not in index:
            raise TraceFormatError(f"{name}: header lacks the required column {required!r}")
    if not any(t in index for t in TARGETS):
        raise TraceFormatError(f"{name}: header has neither target column {TARGETS}")
    numeric = [c for c in NUMERIC if c in index]

    issues: list[RowIssue] = []
    rows: dict[str, list[list[float]]] = {}
    gpus: dict[str, str] = {}
    last_t: dict[str, float] = {}

    def bad(line: int, reason: str) -> None:
        issue = RowIssue(name, line, reason)
        if strict:
            raise TraceFormatError(str(issue))
        issues.append(issue)

    for line, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(header):
            row = row + [""] * (len(header) - len(row))
        app = row[index["app"]].strip()
        if not app:
            bad(line, "empty app")
            continue
        try:
            t = _parse_float(row[index["t_s"]])
            values = [_parse_float(row[index[c]]) for c in numeric]
        except ValueError as exc:
            bad(line, f"unparsable number ({exc})")
            continue
        if t is None:
            bad(line, "empty t_s")
            continue
        problem = _check_values(dict(zip(numeric, values, strict=True)))
        if problem:
            bad(line, problem)
            continue
        if app in last_t and t < last_t[app]:
            bad(line, f"t_s {t} goes back in time for app {app!r} (last {last_t[app]})")
            continue
        last_t[app] = t
        rows.setdefault(app, []).append([t] + [math.nan if v is None else v for v in values])
        if "gpu" in index and app not in gpus:
            gpu = row[index["gpu"]].strip()
            if gpu:
                gpus[app] = gpu

    if not rows:
        raise TraceFormatError(f"{name}: no usable row ({len(issues)} bad rows)")
    apps: dict[str, AppTrace] = {}
    for app, app_rows in rows.items():
        data = np.asarray(app_rows, dtype=np.float64)
        columns = {c: data[:, i + 1] for i, c in enumerate(numeric)}
        apps[app] = AppTrace(app=app, t_s=data[:, 0], columns=columns, gpu=gpus.get(app))
    return Trace(apps=apps, issues=issues, source=name)


def _check_values(values: Mapping[str, float | None]) -> str | None:
    if all(values.get(t) is None for t in TARGETS):
        return "no target value (mem_used_mib and sm_util_pct both empty)"
    for c in _NONNEGATIVE:
        v = values.get(c)
        if v is not None and v < 0:
            return f"{c} is negative ({v})"
    for c in _PCT_COLUMNS:
        v = values.get(c)
        if v is not None and not 0 <= v <= 100:
            return f"{c} outside 0-100 ({v})"
    return None


def _format(value: float) -> str:
    if math.isnan(value):
        return ""
    return repr(round(value, 6))


def iter_rows(apps: Iterable[AppTrace]) -> Iterator[list[str]]:
    """Rows of the canonical CSV (without header), application by application."""
    for trace in apps:
        cols = [trace.column(c) for c in NUMERIC]
        for i, t in enumerate(trace.t_s):
            yield [_format(float(t)), trace.app, trace.gpu or ""] + [_format(float(c[i])) for c in cols]


def write_trace(path: str | Path, apps: Iterable[AppTrace]) -> int:
    """Write a canonical trace (gzip-compressed when the name ends in .gz); returns the row count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open(path, "wt", encoding="utf-8", newline="") if path.suffix == ".gz" else open(
        path, "w", encoding="utf-8", newline=""
    )
    n = 0
    with opener as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        for row in iter_rows(apps):
            writer.writerow(row)
            n += 1
    return n


def one_second_grid(trace: AppTrace, column: str) -> tuple[npt.NDArray[np.int64], FloatArray]:
    """Protocol step 1: the value of second k is the mean of samples with floor(t_s) == k; an empty
    second carries the previous value forward. Returns (seconds, values) from the first second that
    has a value; both empty if the column has none."""
    values = trace.column(column)
    ok = np.isfinite(values)
    if not ok.any():
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    secs = np.floor(trace.t_s[ok]).astype(np.int64)
    vals = values[ok]
    start, end = int(secs.min()), int(secs.max())
    sums = np.bincount(secs - start, weights=vals, minlength=end - start + 1)
    counts = np.bincount(secs - start, minlength=end - start + 1)
    grid = np.full(end - start + 1, np.nan)
    have = counts > 0
    grid[have] = sums[have] / counts[have]
    # carry forward: index of the last filled second at or before each second
    idx = np.where(have, np.arange(len(grid)), 0)
    np.maximum.accumulate(idx, out=idx)
    return np.arange(start, end + 1, dtype=np.int64), grid[idx]
