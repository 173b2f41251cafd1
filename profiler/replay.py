"""A signature source that replays a canonical trace, so the pipeline and the benchmarks run with no GPU.

Each trace row becomes one signature when its time comes: with `speed` 1 the rows come at the trace's own
pace, with `speed` 10 ten times faster (a tick then carries several rows of an application). Every
application's rows keep their own timing; by default all applications share the trace's earliest `t_s`
as origin (`align="global"`), so an application that starts later in the trace starts later in the
replay; `align="per_app"` starts every application at once. `copies` replays each application N times
under distinct ids (`<app>#<i>`) and pids, for load tests; `loop` starts over at the end.

What a row fills (NaN cells stay unset):
    mem_used_mib  -> process.gpu_mem_used_mib and device.mem_used_mib
    sm_util_pct   -> process.sm_util_pct and device.sm_util_pct
    mem_total_mib -> device.mem_total_mib         mem_util_pct -> device.mem_bw_util_pct
    power_w       -> device.power_mw (x1000)      power_limit_w -> device.power_limit_mw (x1000)
    sm_clock_mhz, pcie_tx_kbps, pcie_rx_kbps -> the device fields of the same names
    inapp_<name>  -> in_app.<name> (the in-app counters, e.g. of `vgpu trace synth --kind serving`), where
                     the trace has the column; a value the counter cannot hold is left unset
A trace row describes the application on its device or slice, so device counters repeat the app's own
values. `timestamp_s` is the row's due time on the wall clock (start + trace offset / speed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from vgpu.profiler.source import SeqCounter, set_inapp_values
from vgpu.traces import INAPP_NUMERIC, AppTrace, Trace, read_trace
from vgpu.v1 import signature_pb2

DEFAULT_DEVICE_ID = "GPU-replay-0"


@dataclass
class _Cursor:
    app_id: str
    pid: int
    trace: AppTrace
    device_id: str
    origin_s: float  # trace time that maps to replay time 0 (moves by one lap per loop)
    lap_s: float
    index: int = 0
    laps: int = 0
    # the trace's columns as plain lists (fast per-row access)
    rows: dict[str, list[float]] | None = None
    # (in-app field, its column as a list) for the trace's in-app columns
    inapp: tuple[tuple[str, list[float]], ...] = ()


class ReplaySource:
    """Replays `trace` (a `Trace` or a path to a canonical trace) as signatures; see the module doc."""

    def __init__(
        self,
        trace: Trace | str | Path,
        *,
        speed: float = 1.0,
        copies: int = 1,
        loop: bool = False,
        align: Literal["global", "per_app"] = "global",
        device_id: str | None = None,
        pid_base: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not (speed > 0 and math.isfinite(speed)):
            raise ValueError(f"speed must be a positive number, got {speed}")
        if copies < 1:
            raise ValueError(f"copies must be at least 1, got {copies}")
        if align not in ("global", "per_app"):
            raise ValueError(f"align must be 'global' or 'per_app', got {align!r}")
        self.trace = trace if isinstance(trace, Trace) else read_trace(trace)
        self.speed = speed
        self.loop = loop
        self._clock = clock
        self._wall = wall_clock
        self._seq = SeqCounter()
        global_origin = min(float(a.t_s[0]) for a in self.trace.apps.values() if len(a))
        self._cursors: list[_Cursor] = []
        pid = pid_base
        for name in sorted(self.trace.apps):
            app = self.trace.apps[name]
            if not len(app):
                continue
            origin = global_origin if align == "global" else float(app.t_s[0])
            steps = np.diff(app.t_s)
            lap = float(app.t_s[-1] - origin) + (float(np.median(steps)) if len(steps) else 1.0)
            rows = {c: app.column(c).tolist() for c in _COLUMNS}
            rows["t_s"] = app.t_s.tolist()
            inapp = tuple((c[len("inapp_"):], app.columns[c].tolist()) for c in INAPP_NUMERIC if c in app.columns)
            for c in range(copies):
                self._cursors.append(
                    _Cursor(
                        app_id=name if copies == 1 else f"{name}#{c}",
                        pid=pid,
                        trace=app,
                        device_id=device_id or app.gpu or DEFAULT_DEVICE_ID,
                        origin_s=origin,
                        lap_s=max(lap, 1e-3),
                        rows=rows,
                        inapp=inapp,
                    )
                )
                pid += 1
        self._start_mono: float | None = None
        self._start_wall = 0.0
        self.emitted = 0

    @property
    def app_ids(self) -> list[str]:
        return [c.app_id for c in self._cursors]

    @property
    def done(self) -> bool:
        """Every row replayed (never, with `loop`)."""
        return not self.loop and all(c.index >= len(c.trace) for c in self._cursors)

    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        """The rows that came due since the previous call; the first call starts the replay clock."""
        now = self._clock()
        if self._start_mono is None:
            self._start_mono, self._start_wall = now, self._wall()
        elapsed_trace_s = (now - self._start_mono) * self.speed
        out: list[signature_pb2.BehavioralSignature] = []
        for cur in self._cursors:
            self._advance(cur, elapsed_trace_s, out)
        self.emitted += len(out)
        return out

    def close(self) -> None:
        """Stop replaying: later calls return nothing."""
        self._cursors = []
        self.loop = False

    def _advance(self, cur: _Cursor, elapsed_trace_s: float, out: list[signature_pb2.BehavioralSignature]) -> None:
        assert cur.rows is not None
        t = cur.rows["t_s"]
        n = len(t)
        while True:
            while cur.index < n and t[cur.index] - cur.origin_s <= elapsed_trace_s:
                out.append(self._signature(cur, cur.index))
                cur.index += 1
            if cur.index < n or not self.loop:
                return
            cur.index = 0
            cur.laps += 1
            cur.origin_s -= cur.lap_s  # the next lap's rows are due one lap later
            if t[0] - cur.origin_s > elapsed_trace_s:
                return

    def _signature(self, cur: _Cursor, i: int) -> signature_pb2.BehavioralSignature:
        assert cur.rows is not None
        r = cur.rows
        offset_s = r["t_s"][i] - cur.origin_s
        sig = signature_pb2.BehavioralSignature(
            app_id=cur.app_id,
            pid=cur.pid,
            device_id=cur.device_id,
            timestamp_s=self._start_wall + offset_s / self.speed,
            seq=self._seq.next(cur.app_id),
        )
        mem, sm = r["mem_used_mib"][i], r["sm_util_pct"][i]
        if not math.isnan(mem):
            sig.process.gpu_mem_used_mib = mem
            sig.device.mem_used_mib = mem
        if not math.isnan(sm):
            sig.process.sm_util_pct = sm
            sig.device.sm_util_pct = sm
        d = sig.device
        _set(d, "mem_total_mib", r["mem_total_mib"][i])
        _set(d, "mem_bw_util_pct", r["mem_util_pct"][i])
        _set(d, "power_mw", r["power_w"][i], scale=1000, as_int=True)
        _set(d, "power_limit_mw", r["power_limit_w"][i], scale=1000, as_int=True)
        _set(d, "sm_clock_mhz", r["sm_clock_mhz"][i], as_int=True)
        _set(d, "pcie_tx_kbps", r["pcie_tx_kbps"][i])
        _set(d, "pcie_rx_kbps", r["pcie_rx_kbps"][i])
        if cur.inapp:
            set_inapp_values(sig.in_app, {name: col[i] for name, col in cur.inapp})
        return sig


_COLUMNS = (
    "mem_used_mib",
    "sm_util_pct",
    "mem_total_mib",
    "mem_util_pct",
    "power_w",
    "power_limit_w",
    "sm_clock_mhz",
    "pcie_tx_kbps",
    "pcie_rx_kbps",
)


def _set(msg: signature_pb2.DeviceCounters, name: str, value: float, *, scale: float = 1.0, as_int: bool = False) -> None:
    if math.isnan(value):
        return
    setattr(msg, name, int(round(value * scale)) if as_int else value * scale)
