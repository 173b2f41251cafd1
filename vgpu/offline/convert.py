"""Converters from the datasets' own formats into canonical traces (../shared/TRACE_FORMAT.md).

Each converter returns a `Conversion`: the applications (`vgpu.traces.AppTrace`), the bad rows it
skipped (file, line, reason) and the input it left out on purpose (failed benchmark runs, rows
outside every run window). With `strict=True` the first bad row raises `TraceFormatError`.
Write the result with `vgpu.traces.write_trace(path, conversion.apps)`.

- `convert_migperf(root)`: MIGPerf/MIGProfiler (A100 MIG slices). Each folder's `dcgm.csv` (1 s DCGM
  GRACT/FBUSD of GPU instance 0) is cut into one application per benchmark run with the
  start/end timestamps of the result tables; GRACT x 100 -> `sm_util_pct`, FBUSD -> `mem_used_mib`,
  the slice's memory -> `mem_total_mib`, the MIG profile -> `gpu`. `t_s` stays Unix seconds.
- `convert_nvidia_smi(path, gpus=N)`: `nvidia-smi --query-gpu=... --format=csv` logs.
- `convert_alibaba(root)`: Alibaba GenTD26 per-pod `pod_gpu_duty_cycle` + `pod_gpu_memory_used_bytes`.
"""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from vgpu.traces import AppTrace, RowIssue, TraceFormatError, damaged_tail_reason, open_text

# --------------------------------------------------------------------------------------------
# shared plumbing


@dataclass(frozen=True)
class Conversion:
    """What a converter produced: applications, the bad rows it skipped, what it left out."""

    apps: list[AppTrace]
    issues: list[RowIssue] = field(default_factory=list)
    rows_read: int = 0
    left_out: Counter[str] = field(default_factory=Counter)
    # where a further log starts inside one file (nvidia-smi: the header line again); not bad rows
    log_starts: list[RowIssue] = field(default_factory=list)
    # what the summary must say although nothing failed (rows that may be on the wrong GPU)
    warnings: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(len(a) for a in self.apps)

    def issue_reasons(self) -> Counter[str]:
        """Bad rows counted by reason (the reason's text up to its first parenthesis)."""
        return Counter(i.reason.split(" (")[0] for i in self.issues)


# The most of one bad row's reason that is kept and printed.
MAX_REASON_CHARS = 300


class _Issues:
    """Collects bad rows; in strict mode the first one raises."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.items: list[RowIssue] = []

    def add(self, path: str | Path, line: int, reason: str) -> None:
        if len(reason) > MAX_REASON_CHARS:  # a reason quotes the row's value, which may be kilobytes
            reason = f"{reason[:MAX_REASON_CHARS]}... ({len(reason)} characters)"
        issue = RowIssue(str(path), line, reason)
        if self.strict:
            raise TraceFormatError(str(issue))
        self.items.append(issue)


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row keyed by stripped header) for each non-blank data row."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            reader = csv.reader(fh)
            try:
                header = [h.strip() for h in next(reader)]
            except StopIteration:
                raise TraceFormatError(f"{path}: empty file") from None
            for line, row in enumerate(reader, start=2):
                if not row or all(not c.strip() for c in row):
                    continue
                yield line, {h: (row[i].strip() if i < len(row) else "") for i, h in enumerate(header)}
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _app(app: str, t_s: ArrayLike, columns: Mapping[str, ArrayLike], gpu: str | None) -> AppTrace:
    return AppTrace(
        app=app,
        t_s=np.asarray(t_s, dtype=np.float64),
        columns={k: np.asarray(v, dtype=np.float64) for k, v in columns.items()},
        gpu=gpu,
    )


# --------------------------------------------------------------------------------------------
# MIGPerf

# Memory of each MIG GPU-instance profile in MiB (../shared/reference/gpu-skus.md, A100 values).
MIG_SLICE_MIB: dict[str, float] = {
    "1g.5gb": 4864,
    "2g.10gb": 9856,
    "3g.20gb": 19968,
    "4g.20gb": 19968,
    "7g.40gb": 40192,
    "1g.10gb": 9856,
    "2g.20gb": 19968,
    "3g.40gb": 40192,
    "4g.40gb": 40192,
    "7g.80gb": 80384,
}
# A100-40GB tables name the slice by its memory (instance_memory / mig columns, `_05g_` file names)
# or by NVIDIA's GPU-instance profile id (`_MIG_profile_N` file names).
_A100_40_BY_GB = {5: "1g.5gb", 10: "2g.10gb", 20: "3g.20gb", 40: "7g.40gb"}
_A100_40_BY_PROFILE_ID = {19: "1g.5gb", 14: "2g.10gb", 9: "3g.20gb", 0: "7g.40gb"}
_A100_80_BY_GB = {10: "1g.10gb", 20: "2g.20gb", 40: "3g.40gb", 80: "7g.80gb"}


@dataclass(frozen=True)
class MigperfRun:
    """One benchmark run, merged from every result table that lists it."""

    gpu_model: str  # "A100-40g" / "A100-80g" (the folder name)
    workload: str  # the dcgm folder relative to the GPU folder, e.g. "train-cv", "infer-bsz"
    model: str
    batch_size: int
    seq_length: int | None
    mig_profile: str
    start_s: int
    end_s: int
    gract_mean: float | None  # as the result table states it (0-1), for checking the slicing
    fb_used_mean_mib: float | None

    @property
    def app_id(self) -> str:
        shape = f"bs{self.batch_size}" + (f"-seq{self.seq_length}" if self.seq_length is not None else "")
        return f"migperf/{self.gpu_model}/{self.workload}/{self.model}/{shape}/{self.mig_profile}"


def _slice_from_name(gpu_model: str, name: str) -> str | None:
    m = re.search(r"_MIG_profile_(\d+)", name)
    if m and gpu_model == "A100-40g":
        return _A100_40_BY_PROFILE_ID.get(int(m.group(1)))
    m = re.search(r"_(\d\d)g_", name)
    if m:
        return (_A100_40_BY_GB if gpu_model == "A100-40g" else _A100_80_BY_GB).get(int(m.group(1)))
    return None


def _slice_from_row(gpu_model: str, row: dict[str, str]) -> str | None:
    profile = row.get("mig_profile", "")
    if profile:
        return profile
    for col in ("instance_memory", "mig"):
        if row.get(col):
            gb = int(float(row[col]))
            return (_A100_40_BY_GB if gpu_model == "A100-40g" else _A100_80_BY_GB).get(gb)
    return None


def _gpu_model(path: Path) -> str:
    for part in path.parts:
        if re.fullmatch(r"A100-\d+g", part):
            return part
    raise TraceFormatError(f"{path}: cannot tell the GPU (no A100-40g / A100-80g folder in the path)")


@dataclass
class _RunFacts:
    """What the result tables say of one run: model, batch and seq from the first row that lists
    it, each other fact from the first row that states it."""

    model: str
    batch: int
    seq: int | None
    slice: str | None = None
    gract: float | None = None
    fb: float | None = None


def migperf_runs(dcgm_dir: Path, issues: _Issues, left_out: Counter[str]) -> list[MigperfRun]:
    """The runs recorded by `dcgm_dir/dcgm.csv`, from every result table below `dcgm_dir`.

    Tables repeat runs (per-slice files, concatenated files, files with and without the DCGM
    means); a run is identified by its (start, end) timestamps and the facts are merged. Failed
    runs (latency 0 / start_timestamp 0) are counted in `left_out`."""
    gpu_model = _gpu_model(dcgm_dir)
    gpu_dir = next(p for p in [dcgm_dir, *dcgm_dir.parents] if p.name == gpu_model)
    workload = "-".join(dcgm_dir.relative_to(gpu_dir).parts).replace("_", "-")
    merged: dict[tuple[int, int], _RunFacts] = {}
    failed: set[tuple[str, int, int | None, str | None]] = set()
    for table in sorted(dcgm_dir.rglob("*.csv")):
        if table.name == "dcgm.csv":
            continue
        name_slice = _slice_from_name(gpu_model, table.name)
        for line, row in _csv_rows(table):
            try:
                start = int(float(row["start_timestamp"]))
                end = int(float(row["end_timestamp"]))
                latency = float(row["latency"])
                batch = int(float(row["batch_size"]))
                seq = int(float(row["seq_length"])) if row.get("seq_length") else None
                row_slice = _slice_from_row(gpu_model, row) or name_slice
                gract = float(row["gract_mean"]) if row.get("gract_mean") else None
                fb = float(row["fb_used_mean"]) if row.get("fb_used_mean") else None
            except (KeyError, ValueError) as exc:
                issues.add(table, line, f"unparsable result row ({exc})")
                continue
            if start == 0 or latency == 0:
                failed.add((row.get("model_name", ""), batch, seq, row_slice))
                continue
            if end <= start:
                issues.add(table, line, f"end_timestamp {end} not after start_timestamp {start}")
                continue
            facts = merged.setdefault((start, end), _RunFacts(row.get("model_name", ""), batch, seq))
            if facts.slice is None:
                facts.slice = row_slice
            if facts.gract is None:
                facts.gract = gract
            if facts.fb is None:
                facts.fb = fb
    left_out["failed run (latency 0, start_timestamp 0)"] += len(failed)
    runs = []
    for (start, end), facts in sorted(merged.items()):
        if facts.slice is None:
            left_out["run whose MIG slice no table states"] += 1
            continue
        runs.append(
            MigperfRun(
                gpu_model=gpu_model,
                workload=workload,
                model=facts.model,
                batch_size=facts.batch,
                seq_length=facts.seq,
                mig_profile=facts.slice,
                start_s=start,
                end_s=end,
                gract_mean=facts.gract,
                fb_used_mean_mib=facts.fb,
            )
        )
    return runs


def read_dcgm(path: Path, issues: _Issues) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """`dcgmi dmon` CSV -> (timestamp_s, gract 0-1, fbusd_mib) sorted by time, and rows read."""
    ts: list[float] = []
    gract: list[float] = []
    fb: list[float] = []
    n = 0
    for line, row in _csv_rows(path):
        n += 1
        try:
            t = _finite(row["TimeStamp"])
            g = _finite(row["GRACT"])
            f = _finite(row["FBUSD"])
        except (KeyError, ValueError) as exc:
            issues.add(path, line, f"unparsable dcgm row ({exc})")
            continue
        if not 0 <= g <= 1:
            issues.add(path, line, f"GRACT outside 0-1 ({g})")
            continue
        if f < 0:
            issues.add(path, line, f"FBUSD is negative ({f})")
            continue
        ts.append(t)
        gract.append(g)
        fb.append(f)
    order = np.argsort(np.asarray(ts), kind="stable")
    return np.asarray(ts)[order], np.asarray(gract)[order], np.asarray(fb)[order], n


def migperf_dcgm_dirs(root: Path) -> list[Path]:
    dirs = sorted(p.parent for p in Path(root).rglob("dcgm.csv"))
    if not dirs:
        raise TraceFormatError(f"{root}: no dcgm.csv below it (is this the MIGPerf data folder?)")
    return dirs


def convert_migperf(root: str | Path, *, strict: bool = False) -> Conversion:
    """One application per successful MIGPerf run (see the module docstring)."""
    issues = _Issues(strict)
    left_out: Counter[str] = Counter()
    apps: list[AppTrace] = []
    rows_read = 0
    seen: Counter[str] = Counter()
    for dcgm_dir in migperf_dcgm_dirs(Path(root)):
        ts, gract, fb, n = read_dcgm(dcgm_dir / "dcgm.csv", issues)
        rows_read += n
        for run in migperf_runs(dcgm_dir, issues, left_out):
            lo = np.searchsorted(ts, run.start_s, side="left")
            hi = np.searchsorted(ts, run.end_s, side="right")
            if hi <= lo:
                left_out["run with no dcgm sample in its window"] += 1
                continue
            app_id = run.app_id
            seen[app_id] += 1
            if seen[app_id] > 1:  # the same configuration benchmarked again
                app_id = f"{app_id}/run{seen[app_id]}"
            apps.append(
                _app(
                    app_id,
                    ts[lo:hi],
                    {
                        "sm_util_pct": gract[lo:hi] * 100.0,
                        "mem_used_mib": fb[lo:hi],
                        "mem_total_mib": np.full(hi - lo, MIG_SLICE_MIB.get(run.mig_profile, math.nan)),
                    },
                    run.mig_profile,
                )
            )
    if not apps:
        raise TraceFormatError(f"{root}: no usable MIGPerf run ({len(issues.items)} bad rows)")
    return Conversion(apps=apps, issues=issues.items, rows_read=rows_read, left_out=left_out)


def migperf_stretch(
    dcgm_csv: str | Path,
    start_s: float,
    end_s: float,
    *,
    app: str,
    gpu: str,
    mem_total_mib: float,
    strict: bool = False,
) -> AppTrace:
    """A continuous stretch [start_s, end_s] of a MIGPerf dcgm.csv as one application, with `t_s`
    rebased to 0 at start_s. Used to cut the bundled demo trace and the test fixture (a stretch
    across run boundaries shows real phase changes: idle, start-up, steady load, tear-down)."""
    ts, gract, fb, _ = read_dcgm(Path(dcgm_csv), _Issues(strict=strict))
    keep = (ts >= start_s) & (ts <= end_s)
    if not keep.any():
        raise TraceFormatError(f"{dcgm_csv}: no sample in [{start_s}, {end_s}]")
    n = int(keep.sum())
    return _app(
        app,
        ts[keep] - start_s,
        {"sm_util_pct": gract[keep] * 100.0, "mem_used_mib": fb[keep], "mem_total_mib": [mem_total_mib] * n},
        gpu,
    )


# --------------------------------------------------------------------------------------------
# nvidia-smi --query-gpu CSV

# query field (as nvidia-smi prints it in the header, units stripped) -> canonical column
NVIDIA_SMI_FIELDS: dict[str, str] = {
    "utilization.gpu": "sm_util_pct",
    "memory.used": "mem_used_mib",
    "memory.total": "mem_total_mib",
    "power.draw": "power_w",
    "power.draw.average": "power_w",
    "power.limit": "power_limit_w",
    "enforced.power.limit": "power_limit_w",
    "utilization.memory": "mem_util_pct",
    "clocks.sm": "sm_clock_mhz",
    "clocks.current.sm": "sm_clock_mhz",
}
_GPU_ID_FIELDS = ("index", "uuid", "pci.bus_id")
_MISSING = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[gpu is lost]"}
_UNIT = re.compile(r"^\s*([-+0-9.eE]+)\s*(w|%|mib|mhz|kb/s)?\s*$", re.IGNORECASE)
_TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S")


class NotNvidiaSmiError(TraceFormatError):
    """The file's header is not that of `nvidia-smi --query-gpu ... --format=csv`."""


def _header_field(text: str) -> str:
    """'power.draw [W]' -> 'power.draw'."""
    return re.sub(r"\s*\[.*\]\s*$", "", text.strip()).lower()


def parse_smi_value(text: str) -> float | None:
    """'72.36 W' -> 72.36, '0 %' -> 0.0, '131 MiB' -> 131.0, '[N/A]' -> None; ValueError otherwise."""
    if text.strip().lower() in _MISSING:
        return None
    m = _UNIT.match(text)
    if not m:
        raise ValueError(f"not a number with a unit: {text!r}")
    return _finite(m.group(1))


def parse_smi_timestamp(text: str) -> float:
    """nvidia-smi's local-time stamp ('2025/12/04 01:22:31.703') -> seconds since the epoch, read
    as UTC (the recording machine's zone is unknown; only differences matter)."""
    text = text.strip()
    for fmt in _TIME_FORMATS:
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    try:
        return _finite(text)  # already seconds
    except ValueError:
        raise ValueError(f"unrecognised timestamp {text!r}") from None


def _trace_stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".csv"):
        name = name.removesuffix(suffix)
    return name


def convert_nvidia_smi(
    path: str | Path, *, gpus: int | None = None, strict: bool = False, prefix: str | None = None
) -> Conversion:
    """One application per GPU of an nvidia-smi `--query-gpu=... --format=csv` log.

    The GPU is the `index` (or `uuid`, `pci.bus_id`) column where there is one; otherwise the
    data row's position modulo `gpus` (nvidia-smi prints the GPUs in index order each sample),
    so `gpus` is then required. Bad rows still occupy their position (and the conversion warns that
    later rows depend on it); the header line repeated is where a further log starts, and positions
    count from there (`Conversion.log_starts`). App ids are
    `<prefix>/gpu<N>` with the file name (without .csv[.gz]) as the default prefix."""
    return convert_nvidia_smi_paths([Path(path)], gpus=gpus, strict=strict, prefix=prefix)


def convert_nvidia_smi_paths(
    paths: Sequence[Path],
    *,
    gpus: int | None = None,
    strict: bool = False,
    prefix: str | None = None,
    skip_foreign: bool = False,
) -> Conversion:
    """`convert_nvidia_smi` over several files (app ids prefixed by each file's name). With
    `skip_foreign`, a file whose header is not nvidia-smi's is left out (and counted) instead of
    failing the run, for folders that mix logs with derived files. A compressed log cut short (the
    logger killed mid-write) keeps its rows before the damage, which counts as a bad row."""
    issues = _Issues(strict)
    apps: list[AppTrace] = []
    rows_read = 0
    left_out: Counter[str] = Counter()
    log_starts: list[RowIssue] = []
    warnings: list[str] = []
    for path in paths:
        try:
            fh, tail = open_text(path)
            with fh:
                here = _SmiFile(path, gpus, issues, log_starts)
                apps_here = here.read(fh, prefix or f"nvidia-smi/{_trace_stem(path)}")
                damage = damaged_tail_reason(tail)
                if damage:
                    issues.add(path, here.last_line + 1, damage)
        except NotNvidiaSmiError:
            if not skip_foreign:
                raise
            left_out["file that is not nvidia-smi --query-gpu CSV"] += 1
            continue
        except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
            raise TraceFormatError(f"{path}: cannot read: {exc}") from exc
        apps.extend(apps_here)
        rows_read += here.rows
        warnings.extend(here.warnings())
    if not apps:
        raise TraceFormatError(f"{', '.join(map(str, paths))}: no usable row ({len(issues.items)} bad rows)")
    return Conversion(apps=apps, issues=issues.items, rows_read=rows_read, left_out=left_out,
                      log_starts=log_starts, warnings=warnings)


class _SmiFile:
    """One nvidia-smi log file read into per-GPU series.

    Without a GPU id column a data row's GPU is its position in the current log modulo `gpus`. A
    line equal to the header is where a further log starts (a restarted `nvidia-smi -l` appending
    to the same file, or `cat` of two logs): positions count from 0 again there, and its rows are
    series of their own (`<file>/log2/gpu0`, ...), in whatever order the logs' times run. A skipped row keeps
    its position, which is right when the bad line stood for one sample. A line with every field and
    a timestamp did (a value out of range, `garbage` for a number); one with too few or too many
    fields, or no timestamp, may be a line cut short and continued on the next, or two lines run
    together, which shift every later row to the wrong GPU; a time going back for one GPU is what
    such a shift looks like. Under position assignment those become a warning, and so do rows whose
    times show them dealt to the wrong GPUs (`_misaligned`)."""

    def __init__(self, path: Path, gpus: int | None, issues: _Issues, log_starts: list[RowIssue]) -> None:
        self.path = path
        self.gpus = gpus
        self.issues = issues
        self.log_starts = log_starts
        self.rows = 0  # data rows read (header lines not counted)
        self.last_line = 1
        self.by_position = False
        self.suspects: list[tuple[int, int]] = []  # (log, line) of bad rows that may shift positions
        self.last_row: dict[int, int] = {}  # log -> line of its last row kept
        self.log = 0  # logs begun before the current one
        # under position assignment, (log, sample) -> [first t, last t, rows, first line] of its rows read
        self.samples: dict[tuple[int, int], list[float]] = {}

    def _bad(self, line: int, reason: str, *, may_shift: bool = False) -> None:
        """A skipped row; `may_shift`: the line may not have been one whole sample."""
        self.issues.add(self.path, line, reason)
        if self.by_position and may_shift:
            self.suspects.append((self.log, line))

    def warnings(self) -> list[str]:
        out = self._misaligned()
        # only a bad row with rows of its log after it: the last line of a log cut short moves nothing
        suspects = [line for log, line in self.suspects if self.last_row.get(log, 0) > line]
        if not suspects:
            return out
        return out + [
            f"{self.path}: GPU assigned by row position (--gpus {self.gpus}), and {len(suspects)} bad rows may "
            f"not have been one sample each (fields missing or extra, no timestamp, time going back); from "
            f"line {suspects[0]} on, rows are on the right GPU only if each was (a line cut short or two "
            "lines run together shift every later row): check those lines, or log an index column "
            "(--query-gpu=index,...)"
        ]

    def _misaligned(self) -> list[str]:
        """A warning when rows look dealt to the wrong GPUs by their times: nvidia-smi prints all
        GPUs of a sample within milliseconds, samples an interval apart, so the rows taken for one
        sample should lie far closer together than the interval. Rows shifted by one put the end of
        one sample with the start of the next, the interval apart; that happens with no bad row
        left, e.g. a logger killed mid-sample and restarted without a header."""
        spreads: list[tuple[float, int]] = []  # (time from first to last row, its first line)
        gaps: list[float] = []
        previous: tuple[tuple[int, int], float] | None = None
        for key in sorted(self.samples):
            first_t, last_t, rows, first_line = self.samples[key]
            if rows > 1:
                spreads.append((last_t - first_t, int(first_line)))
            if previous is not None and previous[0] == (key[0], key[1] - 1):
                gaps.append(first_t - previous[1])
            previous = key, first_t
        if len(spreads) < 3 or not gaps:
            return []
        interval = float(np.median(gaps))
        apart = [line for spread, line in spreads if spread > interval / 2]
        if interval <= 0 or len(apart) < max(3, len(spreads) // 10):
            return []
        return [
            f"{self.path}: {len(apart)} of {len(spreads)} samples (the first at line {min(apart)}) have rows further "
            f"apart than half the sampling interval ({interval:.3g} s): rows look dealt to the wrong GPUs (a "
            f"sample cut short, e.g. a logger killed and restarted without a header); log an index column "
            "(--query-gpu=index,...)"
        ]

    def read(self, fh: Iterable[str], prefix: str) -> list[AppTrace]:
        path, gpus = self.path, self.gpus
        reader = csv.reader(fh)
        try:
            first = next(reader)
        except StopIteration:
            raise TraceFormatError(f"{path}: empty file") from None
        header = [_header_field(h) for h in first]
        if "timestamp" not in header:
            raise NotNvidiaSmiError(f"{path}: header lacks 'timestamp' (is this nvidia-smi --query-gpu CSV?)")
        columns = {i: NVIDIA_SMI_FIELDS[h] for i, h in enumerate(header) if h in NVIDIA_SMI_FIELDS}
        if not {"sm_util_pct", "mem_used_mib"} & set(columns.values()):
            raise NotNvidiaSmiError(f"{path}: header has neither utilization.gpu nor memory.used")
        id_col = next((header.index(f) for f in _GPU_ID_FIELDS if f in header), None)
        if id_col is None and gpus is None:
            raise TraceFormatError(
                f"{path}: no GPU index column; give the number of GPUs (--gpus N) to assign rows by position"
            )
        self.by_position = id_col is None and (gpus or 1) > 1
        t_col = header.index("timestamp")
        # (log, gpu) -> the series: each further log in the file is a recording of its own (a restart
        # of nvidia-smi, `cat` of two days' logs, in either order), never joined across the gap
        per_gpu: dict[tuple[int, str], tuple[list[float], dict[str, list[float]]]] = {}
        targets = set(columns.values())
        position = 0
        for line, row in enumerate(reader, start=2):
            self.last_line = line
            if not row or all(not c.strip() for c in row):
                continue
            # NUL bytes are what a log killed mid-write leaves before the next log's header (no newline);
            # the whole row is compared only where a header can be (a data row has a time there)
            if (len(row) == len(header) and "timestamp" in row[t_col].lower()
                    and [_header_field(c.replace("\x00", "")) for c in row] == header):
                self.log_starts.append(RowIssue(str(path), line, "the header again: a further log starts here"))
                position = 0
                self.log += 1
                continue
            slot = position
            position += 1
            self.rows += 1
            if len(row) != len(header):
                self._bad(line, f"{len(row)} fields for {len(header)} columns", may_shift=True)
                continue
            gpu = row[id_col].strip() if id_col is not None else str(slot % (gpus or 1))
            try:
                t = parse_smi_timestamp(row[t_col])
            except ValueError as exc:
                self._bad(line, f"unparsable value ({exc})", may_shift=True)
                continue
            try:
                values = {col: parse_smi_value(row[i]) for i, col in columns.items()}
            except ValueError as exc:
                self._bad(line, f"unparsable value ({exc})")
                continue
            problem = _range_problem(values)
            if problem:
                self._bad(line, problem)
                continue
            series = per_gpu.get((self.log, gpu))
            if series is None:
                series = per_gpu[(self.log, gpu)] = ([], {c: [] for c in targets})
            t_list, cols = series
            if t_list and t < t_list[-1]:
                self._bad(line, f"time goes back for GPU {gpu} ({t} after {t_list[-1]})", may_shift=True)
                continue
            t_list.append(t)
            self.last_row[self.log] = line
            if self.by_position:
                key = (self.log, slot // (gpus or 1))
                seen = self.samples.get(key)
                if seen is None:
                    self.samples[key] = [t, t, 1, line]
                else:
                    seen[0], seen[1], seen[2] = min(seen[0], t), max(seen[1], t), seen[2] + 1
            for col in cols:
                v = values.get(col)
                cols[col].append(math.nan if v is None else v)
        return [
            _app(f"{prefix}/gpu{gpu}" if log == 0 else f"{prefix}/log{log + 1}/gpu{gpu}", t_list, cols, gpu)
            for (log, gpu), (t_list, cols) in sorted(per_gpu.items())
            if t_list
        ]


def _range_problem(values: dict[str, float | None]) -> str | None:
    if values.get("sm_util_pct") is None and values.get("mem_used_mib") is None:
        return "no target value (utilization.gpu and memory.used both missing)"
    for col, v in values.items():
        if v is None:
            continue
        if col.endswith("_pct") and not 0 <= v <= 100:
            return f"{col} outside 0-100 ({v})"
        if v < 0:
            return f"{col} is negative ({v})"
    return None


# --------------------------------------------------------------------------------------------
# Alibaba GenTD26

ALIBABA_UTIL_FILE = "pod_gpu_duty_cycle_anon.csv.gz"
ALIBABA_MEM_FILE = "pod_gpu_memory_used_bytes_anon.csv.gz"
_MIB = 1024.0 * 1024.0


def _read_pod_series(
    path: Path, issues: _Issues, *, scale: float, pct: bool
) -> tuple[dict[tuple[str, float], float], int]:
    import gzip
    import io

    out: dict[tuple[str, float], float] = {}
    n = 0
    opener = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115
    try:
        with io.TextIOWrapper(opener, encoding="utf-8", newline="") as fh:
            reader = csv.reader(fh)
            try:
                header = [h.strip() for h in next(reader)]
            except StopIteration:
                raise TraceFormatError(f"{path}: empty file") from None
            missing = {"value", "timestamp_anon", "container_ip"} - set(header)
            if missing:
                raise TraceFormatError(f"{path}: header lacks {sorted(missing)}")
            iv, it, ip = (header.index(c) for c in ("value", "timestamp_anon", "container_ip"))
            for line, row in enumerate(reader, start=2):
                if not row or all(not c.strip() for c in row):
                    continue
                n += 1
                try:
                    pod = row[ip].strip()
                    t = _finite(row[it])
                    v = _finite(row[iv]) * scale
                except (IndexError, ValueError) as exc:
                    issues.add(path, line, f"unparsable row ({exc})")
                    continue
                if not pod:
                    issues.add(path, line, "empty container_ip")
                elif v < 0:
                    issues.add(path, line, f"value is negative ({v})")
                elif pct and v > 100:
                    issues.add(path, line, f"duty cycle outside 0-100 ({v})")
                elif (pod, t) in out:
                    issues.add(path, line, f"duplicate sample for pod {pod[:12]} at {t}")
                else:
                    out[(pod, t)] = v
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc
    return out, n


def convert_alibaba(root: str | Path, *, strict: bool = False) -> Conversion:
    """One application per pod of Alibaba GenTD26: `pod_gpu_duty_cycle` (%) -> `sm_util_pct` and
    `pod_gpu_memory_used_bytes` / 2^20 -> `mem_used_mib`, joined on (container_ip, timestamp)
    (a sample with only one of the two keeps the other empty). App id `alibaba/pod/<hash>`."""
    root = Path(root)
    util_path, mem_path = root / ALIBABA_UTIL_FILE, root / ALIBABA_MEM_FILE
    for p in (util_path, mem_path):
        if not p.exists():
            raise TraceFormatError(f"{p}: no such file (is {root} the GenTD26 folder?)")
    issues = _Issues(strict)
    util, n_util = _read_pod_series(util_path, issues, scale=1.0, pct=True)
    mem, n_mem = _read_pod_series(mem_path, issues, scale=1.0 / _MIB, pct=False)
    keys = sorted(set(util) | set(mem))
    apps: list[AppTrace] = []
    start = 0
    while start < len(keys):
        pod = keys[start][0]
        end = start
        while end < len(keys) and keys[end][0] == pod:
            end += 1
        span = keys[start:end]
        apps.append(
            _app(
                f"alibaba/pod/{pod}",
                [t for _, t in span],
                {
                    "sm_util_pct": [util.get(k, math.nan) for k in span],
                    "mem_used_mib": [mem.get(k, math.nan) for k in span],
                },
                None,
            )
        )
        start = end
    if not apps:
        raise TraceFormatError(f"{root}: no usable row ({len(issues.items)} bad rows)")
    return Conversion(apps=apps, issues=issues.items, rows_read=n_util + n_mem)


# --------------------------------------------------------------------------------------------
# the bundled demo trace and the test fixture (both cut from MIGPerf, MIT)


@dataclass(frozen=True)
class Stretch:
    """A continuous stretch of one MIGPerf dcgm.csv, [start_s, end_s] in Unix seconds."""

    app: str
    folder: str  # the dcgm.csv folder relative to the MIGPerf data root
    start_s: int
    end_s: int
    mig_profile: str
    note: str


# Each stretch crosses run boundaries on one slice, so it shows real phase changes.
DEMO_STRETCHES: tuple[Stretch, ...] = (
    Stretch("resnet50-train", "A100-80g/train/cv", 1661699350, 1661699580, "7g.80gb",
            "end of batch 64, batch 128 run, start of batch 256: memory steps 8.2 -> 14.7 -> 28 GiB"),
    Stretch("bert-train", "A100-80g/train/nlp", 1661757290, 1661757500, "7g.80gb",
            "end of batch 128, idle gap, batch 256 run: memory 9.2 GiB -> idle -> 14.5 GiB"),
    Stretch("vit-infer", "A100-80g/infer/cv", 1661684890, 1661685100, "7g.80gb",
            "vision transformer inference, batch 8 -> 16 -> 32: high compute, small memory steps"),
    Stretch("bert-infer", "A100-80g/infer/nlp", 1661746600, 1661746800, "7g.80gb",
            "BERT inference batch 1 (41 % busy), 20 s idle, batch 2 (69 % busy)"),
    Stretch("vit-finetune", "A100-40g/finetune_vit", 1657289960, 1657290230, "2g.10gb",
            "ViT fine-tuning on a 2g.10gb slice: end of batch 8, 99 s idle, batch 16 run"),
)

# Whole runs (converter output) for the test fixture: two families per split kind and workload.
FIXTURE_APPS: tuple[str, ...] = (
    # train split
    "migperf/A100-80g/train-cv/resnet50/bs64/3g.40gb",
    "migperf/A100-80g/train-nlp/bert-base/bs32-seq128/7g.80gb",
    "migperf/A100-80g/infer-cv/vision_transformer/bs32/2g.20gb",
    "migperf/A100-40g/finetune-vit/vision_transformer/bs16/3g.20gb",
    # val split
    "migperf/A100-80g/infer-nlp/bert-base/bs8-seq64/1g.10gb",
    # test split
    "migperf/A100-80g/train-nlp/bert-base/bs128-seq64/7g.80gb",
    "migperf/A100-80g/infer-cv/resnet50/bs128/3g.40gb",
    "migperf/A100-40g/infer-seq/bert-base-multilingual-cased/bs32-seq256/7g.40gb",
)


def cut_demo(root: str | Path) -> list[AppTrace]:
    """The bundled demo trace's applications, each rebased to t_s = 0 at its stretch's start."""
    root = Path(root)
    return [
        migperf_stretch(
            root / s.folder / "dcgm.csv", s.start_s, s.end_s,
            app=s.app, gpu=s.mig_profile, mem_total_mib=MIG_SLICE_MIB[s.mig_profile],
        )
        for s in DEMO_STRETCHES
    ]


def cut_fixture(root: str | Path) -> list[AppTrace]:
    """The test fixture's applications: FIXTURE_APPS as `convert_migperf` produces them."""
    apps = {a.app: a for a in convert_migperf(root).apps}
    missing = [a for a in FIXTURE_APPS if a not in apps]
    if missing:
        raise TraceFormatError(f"{root}: the fixture's runs {missing} are not in the data")
    return [apps[a] for a in FIXTURE_APPS]
