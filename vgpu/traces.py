"""The canonical trace format (../shared/TRACE_FORMAT.md, v1): reading, writing, the 1 s grid.

Every tool that reads GPU usage history goes through `read_trace`; converters for other formats
write through `write_trace`. A row that cannot be parsed is reported with file, line and reason and
skipped (or, with `strict=True`, fails the read); a file with no usable row is an error.

Two compatible extensions of the format, both optional and ignored by a reader that does not know them:

* **Further columns** (`EXTRA_NUMERIC`): in-app counters an application reports about itself
  (`inapp_*`: the PyTorch allocator's allocated/reserved/active MiB, allocation retries, OOMs, step; a
  serving engine's requests running and waiting, KV cache in use and its pool, tokens in flight), the
  whole device's memory and SM busy beside the application's own (`dev_*`), and the process's host
  counters (`host_*`). They are read and written like the columns of the format, never required, and
  never counted as targets. `NUMERIC` stays the format's own columns (the model's features and the wire
  codec index by it); `ALL_NUMERIC` is both.
* **Metadata lines**: lines before the header that start with `#`. A line `#meta <JSON object>` carries
  the trace's metadata (provenance of a derived series: generator, inputs with their licences, seed,
  assumptions); its keys are merged in order into `Trace.metadata`. Other `#` lines are comments.
  `write_trace(..., metadata=...)` writes one such line.
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
# In-app counters (what the application reports about itself; vgpu.client's InAppCounters and a serving
# engine's metrics), the device's totals beside the application's share, and host counters.
INAPP_NUMERIC = (
    "inapp_torch_allocated_mib",
    "inapp_torch_reserved_mib",
    "inapp_torch_active_mib",
    "inapp_alloc_retries",
    "inapp_oom_count",
    "inapp_step",
    "inapp_requests_running",
    "inapp_requests_waiting",
    "inapp_kv_used_mib",
    "inapp_kv_total_mib",
    "inapp_tokens_in_flight",
)
EXTRA_NUMERIC = (
    *INAPP_NUMERIC,
    "dev_mem_used_mib",
    "dev_sm_util_pct",
    "host_cpu_pct",
    "host_rss_mib",
)
ALL_NUMERIC = NUMERIC + EXTRA_NUMERIC
META_PREFIX = "#meta "
# The longest an application's samples may span, in seconds (about 116 days): the evaluation grid
# has one cell per second of the span (`one_second_grid`), so a single sample far from the others
# (t_s 1e9 after 0) would ask for gigabytes, and one beyond int64 seconds stopped the reader.
MAX_APP_SPAN_S = 10_000_000.0
_PCT_COLUMNS = ("sm_util_pct", "mem_util_pct", "dev_sm_util_pct")
_NONNEGATIVE = (
    "mem_used_mib", "mem_total_mib", "power_w", "power_limit_w", "sm_clock_mhz", "pcie_tx_kbps", "pcie_rx_kbps",
    *INAPP_NUMERIC, "dev_mem_used_mib", "host_cpu_pct", "host_rss_mib",
)

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
            if name not in ALL_NUMERIC:
                raise ValueError(f"unknown column {name!r}")
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values for {n} samples")

    def __len__(self) -> int:
        return len(self.t_s)

    def column(self, name: str) -> FloatArray:
        """The column's values, all NaN where the trace lacks it."""
        if name not in ALL_NUMERIC:
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


# How many skipped rows a command names when it says that it skipped some (`Trace.skipped_rows_note`).
SKIPPED_ROWS_SHOWN = 3


@dataclass(frozen=True)
class Trace:
    apps: dict[str, AppTrace]
    issues: list[RowIssue] = field(default_factory=list)
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(len(a) for a in self.apps.values())

    def skipped_rows_note(self, shown: int = SKIPPED_ROWS_SHOWN) -> str | None:
        """One line for a command to print once: how many bad rows reading skipped, and the first
        `shown` of them as `file:line: reason`; None when none was skipped."""
        if not self.issues:
            return None
        first = "; ".join(str(issue) for issue in self.issues[:shown])
        more = f"; {len(self.issues) - shown} more" if len(self.issues) > shown else ""
        rows = "bad row" if len(self.issues) == 1 else "bad rows"
        return f"{len(self.issues)} {rows} skipped in {self.source} (first: {first}{more})"


class GzipTail(io.RawIOBase):
    """The decompressed bytes of a gzip file, member after member (gzip's own reader reads them so
    too), that ends where the compressed data does instead of failing the whole read.

    A writer killed mid-member (`vgpu record` to .csv.gz under SIGKILL, OOM or power loss) leaves a
    last member without its end; a damaged disk block breaks one. Every complete line before the
    damage is returned, the unfinished line at it is dropped (its values would be cut short), and
    `damage` says what happened. A file damaged before its first byte of data raises as before: it
    is not a trace cut short but not gzip at all."""

    _CHUNK = 1 << 16

    def __init__(self, raw: io.BufferedIOBase) -> None:
        super().__init__()
        self._raw = raw
        self._z: Any = None  # the current member's decompressor (zlib.decompressobj)
        self._compressed = b""  # read from the file, not yet given to a decompressor
        self._ready = b""  # decompressed, up to the last newline: can be returned
        self._at = 0  # how much of _ready was returned
        self._partial = b""  # decompressed after the last newline
        self._started = False
        self._raw_eof = False
        self._done = False
        self.damage: str | None = None
        self.dropped_bytes = 0  # of the unfinished line at the damage

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._at >= len(self._ready) and not self._done:
            self._ready, self._at = b"", 0
            self._fill()
        n = min(len(buffer), len(self._ready) - self._at)
        buffer[:n] = memoryview(self._ready)[self._at:self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()

    def _fill(self) -> None:
        import zlib

        if not self._compressed and not self._raw_eof:
            self._compressed = self._raw.read(self._CHUNK)
            self._raw_eof = not self._compressed
        if self._z is None or self._z.eof:
            self._compressed = self._compressed.lstrip(b"\0")  # padding after a member, as gzip skips it
            if not self._compressed:
                if self._raw_eof:
                    self._finish(None)
                return
            self._z = zlib.decompressobj(wbits=31)  # one gzip member, header and trailer checked
        if not self._compressed:
            self._finish("the file ends inside a gzip member (written until the writer was killed?)", EOFError)
            return
        chunk, self._compressed = self._compressed, b""
        try:
            out = self._z.decompress(chunk)
        except zlib.error as exc:
            self._finish(f"damaged gzip data ({exc})", OSError)
            return
        if self._z.eof:
            self._compressed = self._z.unused_data
        if out:
            self._started = True
            data = self._partial + out
            cut = data.rfind(b"\n") + 1
            self._ready += data[:cut]
            self._partial = data[cut:]

    def _finish(self, damage: str | None, error: type[Exception] = OSError) -> None:
        self._done = True
        if damage is None:
            self._ready += self._partial
        elif not self._started:
            raise error(damage)
        else:
            self.damage = damage
            self.dropped_bytes = len(self._partial)
        self._partial = b""


def open_text(path: Path) -> tuple[io.TextIOBase, GzipTail | None]:
    """`path` as text (decompressed when its name ends in .gz), and for a .gz the `GzipTail` that
    says, once read, whether the file ended in damage (`damaged_tail_reason`)."""
    if path.suffix == ".gz":
        tail = GzipTail(open(path, "rb"))  # noqa: SIM115 - closed with the wrapper
        return io.TextIOWrapper(io.BufferedReader(tail), encoding="utf-8", newline=""), tail
    return open(path, encoding="utf-8", newline=""), None  # noqa: SIM115


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
    an application or further than MAX_APP_SPAN_S past its first sample) are skipped and listed in `Trace.issues`; with `strict=True` the first one
    raises TraceFormatError.
    """
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(f"{path}: no such file")
    try:
        fh, tail = open_text(path)
        with fh:
            return _read(fh, str(path), strict, tail)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc


def _leading_metadata(
    fh: Iterable[str], name: str, strict: bool
) -> tuple[Iterator[str], dict[str, Any], list[RowIssue], int]:
    """Peel the `#` lines before the header: (the remaining lines, the metadata, issues with
    unreadable `#meta` lines, how many lines were peeled)."""
    lines = iter(fh)
    metadata: dict[str, Any] = {}
    issues: list[RowIssue] = []
    peeled = 0
    for line in lines:
        if not line.startswith("#"):
            return itertools.chain([line], lines), metadata, issues, peeled
        peeled += 1
        if not line.startswith(META_PREFIX):
            continue
        try:
            value = json.loads(line[len(META_PREFIX):])
        except ValueError as exc:
            value, reason = None, f"unreadable metadata line ({exc})"
        else:
            reason = "" if isinstance(value, dict) else "metadata line is not a JSON object"
        if reason:
            issue = RowIssue(name, peeled, reason)
            if strict:
                raise TraceFormatError(str(issue))
            issues.append(issue)
            continue
        assert isinstance(value, dict)
        metadata.update(value)
    return iter(()), metadata, issues, peeled


def _read(fh: Iterable[str], name: str, strict: bool, tail: GzipTail | None = None) -> Trace:
    rest, metadata, issues, peeled = _leading_metadata(fh, name, strict)
    reader = csv.reader(rest)
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
    numeric = [c for c in ALL_NUMERIC if c in index]

    rows: dict[str, list[list[float]]] = {}
    gpus: dict[str, str] = {}
    last_t: dict[str, float] = {}

    def bad(line: int, reason: str) -> None:
        issue = RowIssue(name, line, reason)
        if strict:
            raise TraceFormatError(str(issue))
        issues.append(issue)

    line = peeled + 1
    for line, row in enumerate(reader, start=peeled + 2):
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
        if app in rows and t - rows[app][0][0] > MAX_APP_SPAN_S:
            bad(line, f"t_s {t} is {t - rows[app][0][0]:.4g} s after the first sample of app {app!r}; an application's "
                      f"samples may span at most {MAX_APP_SPAN_S:.0f} s")
            continue
        last_t[app] = t
        rows.setdefault(app, []).append([t] + [math.nan if v is None else v for v in values])
        if "gpu" in index and app not in gpus:
            gpu = row[index["gpu"]].strip()
            if gpu:
                gpus[app] = gpu

    damage = damaged_tail_reason(tail)
    if damage:
        bad(line + 1, damage)
    if not rows:
        raise TraceFormatError(f"{name}: no usable row ({len(issues)} bad rows)")
    apps: dict[str, AppTrace] = {}
    for app, app_rows in rows.items():
        data = np.asarray(app_rows, dtype=np.float64)
        columns = {c: data[:, i + 1] for i, c in enumerate(numeric)}
        apps[app] = AppTrace(app=app, t_s=data[:, 0], columns=columns, gpu=gpus.get(app))
    return Trace(apps=apps, issues=issues, source=name, metadata=metadata)


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


def header_for(apps: Iterable[AppTrace]) -> tuple[str, ...]:
    """The format's header, then the further columns that some application has (in `EXTRA_NUMERIC`
    order): a trace without them is written exactly as before."""
    extras = {c for a in apps for c in a.columns if c in EXTRA_NUMERIC}
    return HEADER + tuple(c for c in EXTRA_NUMERIC if c in extras)


def iter_rows(apps: Iterable[AppTrace], header: Sequence[str] = HEADER) -> Iterator[list[str]]:
    """Rows of the canonical CSV (without header), application by application, with the numeric
    columns of `header` (which starts with t_s, app, gpu)."""
    names = [c for c in header if c in ALL_NUMERIC]
    for trace in apps:
        cols = [trace.column(c) for c in names]
        for i, t in enumerate(trace.t_s):
            yield [_format(float(t)), trace.app, trace.gpu or ""] + [_format(float(c[i])) for c in cols]


def format_value(value: float | None) -> str:
    """A cell of the canonical CSV: empty for a missing value, else the number to 6 decimals."""
    return "" if value is None else _format(float(value))


def damaged_tail_reason(tail: GzipTail | None) -> str | None:
    """The bad-row reason for a gzip file that ended in damage (None when it did not): the rows
    before the damage are kept, what came after it is lost, and that is said."""
    if tail is None or not tail.damage:
        return None
    cut = f", an unfinished row of {tail.dropped_bytes} bytes dropped" if tail.dropped_bytes else ""
    return f"damaged tail: {tail.damage}; the rows before this line are kept{cut}, any after it are lost"


def open_for_writing(path: str | Path) -> io.TextIOWrapper:
    """A text stream to a new trace file (gzip when the name ends in .gz), for writers that add rows
    as they come (`vgpu record`); `write_trace` for whole traces. Its `flush()` puts every row written
    so far in the file, a .gz one too (a gzip sync flush): a writer that dies after it (SIGKILL, OOM)
    leaves rows that `read_trace` reads, its unfinished end reported as a damaged tail."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _open_for_writing(path)


def meta_line(metadata: Mapping[str, Any]) -> str:
    """The `#meta` line (with its newline) for `metadata`."""
    line = META_PREFIX + json.dumps(dict(metadata), sort_keys=True, separators=(",", ":"))
    if "\n" in line:
        raise ValueError("metadata must serialise to one line")
    return line + "\n"


def _open_for_writing(path: Path) -> io.TextIOWrapper:
    """A text stream to `path`; gzip without a time or name in its header, so the same rows give the
    same bytes."""
    raw = open(path, "wb")  # noqa: SIM115 - closed with the wrapper
    if path.suffix != ".gz":
        return io.TextIOWrapper(raw, encoding="utf-8", newline="")
    gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)
    return _ClosingTextWrapper(gz, raw)


class _ClosingTextWrapper(io.TextIOWrapper):
    """Closes the file under the gzip stream too (GzipFile leaves a given fileobj open)."""

    def __init__(self, gz: gzip.GzipFile, raw: io.BufferedWriter) -> None:
        super().__init__(gz, encoding="utf-8", newline="")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def write_trace(path: str | Path, apps: Iterable[AppTrace], *, metadata: Mapping[str, Any] | None = None) -> int:
    """Write a canonical trace (gzip-compressed when the name ends in .gz); returns the row count.
    `metadata` (JSON-serialisable) goes on one `#meta` line before the header."""
    path = Path(path)
    apps = list(apps)
    header = header_for(apps)
    first = meta_line(metadata) if metadata else None
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with _open_for_writing(path) as fh:
        if first is not None:
            fh.write(first)
        writer = csv.writer(fh)
        writer.writerow(header)
        for row in iter_rows(apps, header):
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
