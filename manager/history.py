"""The node's own history on disk: every application's 1 s grid, bounded in time and in bytes.

What the node-local learner (manager/nodelearn.py) trains and judges a local model on. Rows are the
canonical trace format (../shared/TRACE_FORMAT.md: `t_s, app, gpu, mem_used_mib, sm_util_pct,
mem_total_mib`, then the in-app counters `inapp_*` of `vgpu.traces.INAPP_NUMERIC`), one per
application and complete second, as the served mixture sees them (manager/experts.py: the mean of
the second's samples, an empty second carrying the previous value; an in-app counter is the mean of
the second's reports and empty where the application reported none that second, so an application
without in-app counters costs an empty cell per counter, which gzip all but removes).

Segments written before the in-app columns existed have the six-column header; they are read as
they are (the in-app columns absent), and one still being written is continued in its own columns.

Files. `<dir>/seg-<k>.csv`, segment k holding the seconds [k * segment_s, (k + 1) * segment_s) of
the node's clock, appended to and never rewritten (once closed, gzipped to `seg-<k>.csv.gz` by
`compress_closed` from a background thread), so `vgpu eval --trace` and `read_trace` read a
segment as it is. Crash safety: a crash leaves at most a partial last line, which the reader leaves
out (a row cut short may still parse) and the next writer cuts off before appending; a segment that cannot be read at all (corrupt, not a trace) is skipped and
logged once, never fatal. Bounds: segments whose last second is older than `horizon_s` are deleted,
then the oldest until the directory holds at most `max_bytes` (the segment being written excepted).

Memory above capacity. A row whose `mem_used_mib` is above the `mem_total_mib` it records (beyond the
slack of `vgpu.wire.mem_limit_mib`) describes no process its device can run: it is not written, and
one found in a file (written before the manager bounded readings by the device, or damaged) is left
out of `read`, so the learner never trains on it. Both are counted (`rows_refused`) and logged once.
"""

from __future__ import annotations

import gzip
import math
import os
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

import numpy as np
import structlog

from vgpu.log import get_logger
from vgpu.traces import INAPP_NUMERIC, AppTrace, Trace, TraceFormatError, read_trace
from vgpu.wire import mem_limit_mib

BASE_COLUMNS = ("t_s", "app", "gpu", "mem_used_mib", "sm_util_pct", "mem_total_mib")
HEADER = ",".join((*BASE_COLUMNS, *INAPP_NUMERIC)) + "\n"
_SEGMENT = re.compile(r"^seg-(\d+)\.csv(\.gz)?$")


def _cell(v: float) -> str:
    return "" if not math.isfinite(v) else f"{v:.6g}"


def _count_cell(v: float) -> str:
    """An in-app cell: counts (steps, tokens, requests) exact up to 10^9."""
    return "" if not math.isfinite(v) else f"{v:.9g}"


def _inapp_of_header(line: str) -> tuple[str, ...] | None:
    """The in-app columns a segment's header names, in its order; None where the header is not one
    this module writes (the base columns first)."""
    names = line.rstrip("\r\n").split(",")
    if tuple(names[: len(BASE_COLUMNS)]) != BASE_COLUMNS:
        return None
    return tuple(n for n in names[len(BASE_COLUMNS):] if n in INAPP_NUMERIC)


class NodeHistory:
    """Appends the node's 1 s grid rows and reads them back (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        horizon_s: float = 7 * 86400.0,
        max_bytes: int = 256 * 2**20,
        segment_s: int = 3600,
        prune_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        logger: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        if horizon_s <= 0 or max_bytes <= 0 or segment_s < 1:
            raise ValueError("horizon_s, max_bytes and segment_s must be > 0")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.horizon_s, self.max_bytes, self.segment_s = horizon_s, max_bytes, segment_s
        self.prune_every_s = prune_every_s
        self._clock = clock
        self._log = logger or get_logger("vgpu.manager.history")
        self._file: TextIO | None = None
        self._segment = -1
        self._inapp: tuple[str, ...] = INAPP_NUMERIC  # the in-app columns of the segment being written
        self._last_prune = -math.inf
        self._skipped: set[str] = set()
        self.rows_written = 0
        self.write_failures = 0
        # rows whose memory is above the capacity they record: each refused write, and each row left out
        # of a `read` (a segment read again counts its rows again)
        self.rows_refused = 0
        self._refused_said = False

    def segments(self) -> list[tuple[int, Path]]:
        """(k, path) of every segment file, oldest first (a segment may have a compressed file and a
        plain one: rows written after compression, or a crash between compressing and deleting;
        `read` drops the duplicate seconds)."""
        out = []
        for p in self.dir.iterdir():
            m = _SEGMENT.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out, key=lambda kp: (kp[0], kp[1].suffix != ".gz"))

    def compress_closed(self) -> list[Path]:
        """Gzip every plain segment but the one being written (about 8 x smaller; `read_trace` reads
        both): written aside, renamed into place, then the plain file deleted, so a crash leaves one
        whole copy. Meant for a background thread (the learner's), not the forecast's."""
        done = []
        for k, p in self.segments():
            if p.suffix != ".csv" or k == self._segment:
                continue
            out = p.with_name(p.name + ".gz")  # seg-k.csv -> seg-k.csv.gz
            tmp = p.with_name(f".{p.name}.gz.tmp")
            try:
                data = p.read_bytes()
                data = data[: data.rfind(b"\n") + 1]  # a crash's partial last line is not kept
                if out.exists():
                    # rows written to a segment after it was compressed (the clock stepped back):
                    # one more gzip member on the end, without the header (gzip reads members as one);
                    # where the two headers differ (an older segment), the plain file stays beside it
                    if _first_line(out) != data[: data.find(b"\n") + 1].decode("utf-8", "replace"):
                        if p.name not in self._skipped:
                            self._skipped.add(p.name)
                            self._log.info("history_segment_left_plain", path=str(p), reason="header differs")
                        continue
                    with gzip.open(out, "ab", compresslevel=6) as fh:
                        fh.write(data[len(HEADER):] if data.startswith(HEADER.encode()) else data)
                else:
                    with gzip.open(tmp, "wb", compresslevel=6) as fh:
                        fh.write(data)
                    os.replace(tmp, out)
                p.unlink()
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                self._log.warning("history_compress_failed", path=str(p), error=repr(exc))
                continue
            done.append(out)
        return done

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for _, p in self.segments() if p.exists())

    # --- writing --------------------------------------------------------------------------------
    def add(self, apps: Sequence[str], gpus: Sequence[str], t_s: np.ndarray, values: np.ndarray,
            mem_total_mib: Sequence[float], inapp: Mapping[str, np.ndarray] | None = None) -> None:
        """Rows of complete seconds: application, device, second, (mem_used_mib, sm_util_pct), the
        capacity, and `inapp`: in-app counters by column name (`inapp_*`), one value per row (NaN
        where none was reported; columns not named are empty). A write that fails (disk full,
        directory gone) is counted and logged once; the caller's tick goes on."""
        if not len(apps):
            return
        try:
            vals = values.tolist()
            secs = t_s.tolist()
            extra = {c: np.asarray(v, dtype=np.float64).tolist() for c, v in (inapp or {}).items() if c in INAPP_NUMERIC}
            if any(len(v) != len(secs) for v in extra.values()):
                raise ValueError("in-app columns must have one value per row")
            rows: dict[int, list[tuple[int, str]]] = {}
            for i, (app, gpu, sec, (mem, sm), total) in enumerate(zip(apps, gpus, secs, vals, mem_total_mib,
                                                                      strict=True)):
                if mem > mem_limit_mib(total):  # NaN on either side compares False: kept
                    self._refused(1, "write", mem, total)
                    continue
                if "," in app or "\n" in app or '"' in app or "," in gpu or "\n" in gpu or '"' in gpu:
                    app, gpu = _quote(app), _quote(gpu)
                seg = int(sec // self.segment_s)
                rows.setdefault(seg, []).append((i, f"{sec:.0f},{app},{gpu},{_cell(mem)},{_cell(sm)},{_cell(total)}"))
            for seg in sorted(rows):
                fh = self._open(seg)
                cols = [extra.get(c) for c in self._inapp]  # the open segment's own in-app columns
                if not any(col is not None for col in cols):  # no counters this call: empty cells
                    empty = "," * len(cols) + "\n"
                    text = "".join(base + empty for _, base in rows[seg])
                else:
                    text = "".join(
                        base + "," + ",".join("" if col is None else _count_cell(col[i]) for col in cols) + "\n"
                        for i, base in rows[seg])
                fh.write(text)
                fh.flush()
                self.rows_written += len(rows[seg])
        except (OSError, ValueError) as exc:  # ValueError: written after close (a stop mid-tick)
            self.write_failures += 1
            if self.write_failures == 1:
                self._log.error("history_write_failed", dir=str(self.dir), error=repr(exc))
            return
        now = self._clock()
        if now - self._last_prune >= self.prune_every_s:
            self._last_prune = now
            self.prune(max(secs))

    def _open(self, seg: int) -> TextIO:
        if self._file is not None and seg == self._segment:
            return self._file
        self.close()
        path = self.dir / f"seg-{seg}.csv"
        fresh = not path.exists() or path.stat().st_size == 0
        fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - the segment stays open while it is written
        inapp: tuple[str, ...] = INAPP_NUMERIC
        if fresh:
            fh.write(HEADER)
        else:
            if not _ends_with_newline(path):
                fh.close()
                _drop_partial_tail(path)  # a crash's partial last line: never read, never continued
                fh = open(path, "a", encoding="utf-8")  # noqa: SIM115
            # continued in the columns its header names (an older segment: without the in-app ones)
            inapp = _inapp_of_header(_first_line(path)) or ()
        self._file, self._segment, self._inapp = fh, seg, inapp
        return fh

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def prune(self, now_s: float) -> list[Path]:
        """Delete segments older than the horizon, then the oldest over the byte cap. Returns them."""
        gone: list[Path] = []
        segs = self.segments()
        for k, p in segs:
            if (k + 1) * self.segment_s <= now_s - self.horizon_s and k != self._segment:
                gone.append(p)
        sizes = {p: p.stat().st_size for _, p in segs if p.exists()}
        total = sum(s for p, s in sizes.items() if p not in gone)
        for k, p in segs:
            if total <= self.max_bytes:
                break
            if p in gone or k == self._segment:
                continue
            gone.append(p)
            total -= sizes.get(p, 0)
        for p in gone:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        if gone:
            self._log.info("history_pruned", removed=[p.name for p in gone], bytes=total)
        return gone

    def _refused(self, n: int, where: str, mem_mib: float, total_mib: float) -> None:
        """`n` rows refused for memory above their capacity: counted, the first logged."""
        self.rows_refused += n
        if not self._refused_said:
            self._refused_said = True
            self._log.warning("history_rows_refused", reason="mem_used_mib above mem_total_mib", at=where,
                              mem_used_mib=mem_mib, mem_total_mib=total_mib, dir=str(self.dir))

    # --- reading --------------------------------------------------------------------------------
    def read(self, since_s: float = -math.inf) -> list[AppTrace]:
        """Every application's rows from `since_s` on, segments in order; a segment that cannot
        be read is skipped (logged once per file), bad rows within one are skipped (a crash's partial
        line among them)."""
        parts: dict[str, list[AppTrace]] = {}
        gpus: dict[str, str | None] = {}
        for k, path in self.segments():
            if (k + 1) * self.segment_s <= since_s:
                continue
            try:
                trace = _read_segment(path)
            # zlib.error: a gzip member whose deflate stream is damaged (a bad header is an OSError)
            except (TraceFormatError, OSError, UnicodeDecodeError, EOFError, zlib.error) as exc:
                if path.name not in self._skipped:
                    self._skipped.add(path.name)
                    self._log.warning("history_segment_skipped", path=str(path), error=str(exc))
                continue
            for app, tr in trace.apps.items():
                parts.setdefault(app, []).append(tr)
                gpus[app] = tr.gpu
        out = []
        for app, trs in parts.items():
            t = np.concatenate([a.t_s for a in trs])
            # one row per second: the first copy of a second kept (files of one segment may repeat it)
            _, first = np.unique(t, return_index=True)
            names = {c for a in trs for c in a.columns}
            cols = {c: np.concatenate([a.column(c) for a in trs])[first] for c in names}
            keep = t[first] >= since_s
            mem, total = cols.get("mem_used_mib"), cols.get("mem_total_mib")
            if mem is not None and total is not None:
                with np.errstate(invalid="ignore"):  # NaN on either side: kept
                    over = keep & (mem > mem_limit_mib(total))
                if over.any():
                    k = int(np.flatnonzero(over)[0])
                    self._refused(int(over.sum()), "read", float(mem[k]), float(total[k]))
                    keep &= ~over
            # an in-app counter the application never reported is no column at all (older segments,
            # applications without counters): the learner's traces carry only what was reported
            kept = {c: v[keep] for c, v in cols.items() if c not in INAPP_NUMERIC or np.isfinite(v[keep]).any()}
            out.append(AppTrace(app, t[first][keep], kept, gpu=gpus[app]))
        return sorted(out, key=lambda a: a.app)


def _quote(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


def _read_segment(path: Path) -> Trace:
    """A segment as a trace, less a partial last line (a row cut short can still parse, as a shorter
    number or with cells missing, so an unterminated line is never read)."""
    if path.suffix == ".gz" or _ends_with_newline(path):
        return read_trace(path)
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / path.name
        whole.write_bytes(data[:cut])
        return read_trace(whole)


def _drop_partial_tail(path: Path) -> None:
    with open(path, "rb+") as fh:
        data = fh.read()
        fh.truncate(data.rfind(b"\n") + 1)


def _first_line(path: Path) -> str:
    """A segment's header line ("" where it cannot be read)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="") as gz:
                return gz.readline()
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:
            return fh.readline()
    except (OSError, EOFError):
        return ""


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() == 0:
            return True
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


__all__ = ["BASE_COLUMNS", "HEADER", "NodeHistory"]
