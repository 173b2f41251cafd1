"""A bounded in-memory history per application and device: use, forecast and grant at each forecast
tick, and the grant changes and OOM events between them. Pure: no I/O, no clock of its own.

What operators see of it: `vgpu top`'s sparklines, `vgpu report`'s pictures (both through the
`GetAppHistory` RPC) and the overrun / OOM counters of the metrics.

An *overrun* is a tick at which the application used more memory than it was granted when the use
was measured. An *OOM event* is the first tick of a run of overruns: with per-application memory
caps on (cgroup limits, MPS, a cooperative memory fraction), that is where an allocation fails.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import numpy as np

# Use counts as above the grant only past this slack (MiB): readings and grants are rounded.
OVERRUN_SLACK_MIB = 1.0


@dataclass(frozen=True)
class HistoryPoint:
    t_s: float
    mem_used_mib: float = math.nan
    mem_p50_mib: float = math.nan
    mem_p90_mib: float = math.nan
    mem_granted_mib: float = math.nan
    sm_used_pct: float = math.nan
    sm_p90_pct: float = math.nan
    sm_granted_pct: float = math.nan


@dataclass(frozen=True)
class HistoryEvent:
    t_s: float
    kind: str  # "granted", "resized", "released" or "oom"
    detail: str = ""
    mem_granted_mib: float = math.nan


_COLUMNS = len(fields(HistoryPoint))


class _Ring:
    """The last `cap` points as float64 columns (8 x 8 bytes a point: 3600 points are 225 KiB). The
    storage starts small and doubles up to `cap`, so a short-lived application costs what it used."""

    _FIRST = 64

    def __init__(self, cap: int) -> None:
        self.data = np.empty((_COLUMNS, min(cap, self._FIRST)))
        self.cap = cap
        self.head = 0  # index of the oldest point
        self.n = 0

    def append(self, point: HistoryPoint) -> None:
        size = self.data.shape[1]
        if self.n == size and size < self.cap:  # full but allowed to grow: still in order from 0
            grown = np.empty((_COLUMNS, min(self.cap, 2 * size)))
            grown[:, :size] = self.data
            self.data = grown
        i = (self.head + self.n) % self.cap
        self.data[:, i] = (point.t_s, point.mem_used_mib, point.mem_p50_mib, point.mem_p90_mib,
                           point.mem_granted_mib, point.sm_used_pct, point.sm_p90_pct, point.sm_granted_pct)
        if self.n < self.cap:
            self.n += 1
        else:
            self.head = (self.head + 1) % self.cap

    def ordered(self) -> np.ndarray:
        idx = (self.head + np.arange(self.n)) % self.cap
        return self.data[:, idx]


_COLUMN_NAMES = tuple(f.name for f in fields(HistoryPoint))


@dataclass
class AppSeries:
    """One application's history on one device (a copy, oldest point first). The points are kept as
    columns (`column`): a reply of every series holds up to 256 x 3600 points, and a Python object
    per point made each such `GetAppHistory` hold the event loop for seconds; `points` builds the
    objects when asked."""

    app_id: str
    device_id: str
    columns: np.ndarray  # (len(HistoryPoint fields), points), float64, in HistoryPoint's field order
    events: tuple[HistoryEvent, ...]
    overruns: int = 0
    ooms: int = 0

    def column(self, name: str) -> np.ndarray:
        """One field of every point, oldest first (`name`: a HistoryPoint field)."""
        col: np.ndarray = self.columns[_COLUMN_NAMES.index(name)]
        return col

    @property
    def points(self) -> tuple[HistoryPoint, ...]:
        return tuple(HistoryPoint(*row) for row in self.columns.T.tolist())


@dataclass
class _Series:
    ring: _Ring
    events: deque[HistoryEvent]
    overruns: int = 0
    ooms: int = 0
    over: bool = field(default=False, repr=False)  # whether the last point was an overrun


class History:
    """At most `max_points` points and `max_events` events per (application, device), for at most
    `max_series` pairs; the least recently updated pair goes first. One point a second keeps an
    hour with the defaults (225 KiB of points per pair, 56 MiB for all 256). An application the
    allocator forgets (it went silent, or was released as idle) keeps its series for a later
    `vgpu report`, but only the `max_departed` most recent such are kept, so churn does not pile up."""

    def __init__(self, *, max_points: int = 3600, max_events: int = 512, max_series: int = 256,
                 max_departed: int = 16) -> None:
        if min(max_points, max_events, max_series) < 1 or max_departed < 0:
            raise ValueError("max_points, max_events and max_series must be >= 1, max_departed >= 0")
        self.max_points = max_points
        self.max_events = max_events
        self.max_series = max_series
        self.max_departed = max_departed
        self._series: OrderedDict[tuple[str, str], _Series] = OrderedDict()
        self._departed: OrderedDict[str, None] = OrderedDict()  # oldest departure first

    def depart(self, app_id: str) -> None:
        """The application is gone: keep its series among the `max_departed` most recent departed
        ones, dropping the series of the application that departed longest ago beyond that."""
        self._departed.pop(app_id, None)
        self._departed[app_id] = None
        while len(self._departed) > self.max_departed:
            gone, _ = self._departed.popitem(last=False)
            for key in [k for k in self._series if k[0] == gone]:
                del self._series[key]

    def __len__(self) -> int:
        return len(self._series)

    def _get(self, app_id: str, device_id: str) -> _Series:
        key = (app_id, device_id)
        self._departed.pop(app_id, None)  # back again: live, not departed
        s = self._series.get(key)
        if s is None:
            while len(self._series) >= self.max_series:
                self._series.popitem(last=False)
            s = self._series[key] = _Series(_Ring(self.max_points), deque(maxlen=self.max_events))
        self._series.move_to_end(key)
        return s

    def record(self, app_id: str, device_id: str, point: HistoryPoint, *, granted_before_mib: float) -> bool:
        """Add a tick. `granted_before_mib`: the memory granted when the use was measured, to tell an
        overrun. Returns True when an OOM event starts here (the event is recorded too)."""
        s = self._get(app_id, device_id)
        s.ring.append(point)
        over = (granted_before_mib > 0 and math.isfinite(point.mem_used_mib)
                and point.mem_used_mib > granted_before_mib + OVERRUN_SLACK_MIB)
        started = over and not s.over
        s.over = over
        if over:
            s.overruns += 1
        if started:
            s.ooms += 1
            s.events.append(HistoryEvent(point.t_s, "oom",
                                         f"use {point.mem_used_mib:.0f} MiB > granted {granted_before_mib:.0f} MiB",
                                         point.mem_granted_mib))
        return started

    def event(self, app_id: str, device_id: str, event: HistoryEvent) -> None:
        self._get(app_id, device_id).events.append(event)

    def series(self, app_id: str | None = None, device_id: str | None = None,
               since_t_s: float = -math.inf) -> list[AppSeries]:
        """Copies of the matching series (by app, then device), trimmed to points and events at or
        after `since_t_s`."""
        out = []
        for (app, dev), s in sorted(self._series.items()):
            if (app_id and app != app_id) or (device_id and dev != device_id):
                continue
            cols = s.ring.ordered()
            cols = cols[:, cols[0] >= since_t_s]
            out.append(AppSeries(app, dev, cols, tuple(e for e in s.events if e.t_s >= since_t_s),
                                 s.overruns, s.ooms))
        return out

    def counts(self) -> Iterable[tuple[str, str, int, int]]:
        """(app, device, overruns, OOM events) of every series kept."""
        return [(a, d, s.overruns, s.ooms) for (a, d), s in sorted(self._series.items())]


__all__ = ["OVERRUN_SLACK_MIB", "AppSeries", "History", "HistoryEvent", "HistoryPoint"]
