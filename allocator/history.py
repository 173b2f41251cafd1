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
from dataclasses import dataclass, field

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


@dataclass
class AppSeries:
    """One application's history on one device."""

    app_id: str
    device_id: str
    points: deque[HistoryPoint]
    events: deque[HistoryEvent]
    overruns: int = 0
    ooms: int = 0
    over: bool = field(default=False, repr=False)  # whether the last point was an overrun


class History:
    """At most `max_points` points and `max_events` events per (application, device), for at most
    `max_series` pairs; the least recently updated pair goes first. One point a second keeps an
    hour with the defaults (about 250 KiB per pair)."""

    def __init__(self, *, max_points: int = 3600, max_events: int = 512, max_series: int = 256) -> None:
        if min(max_points, max_events, max_series) < 1:
            raise ValueError("max_points, max_events and max_series must be >= 1")
        self.max_points = max_points
        self.max_events = max_events
        self.max_series = max_series
        self._series: OrderedDict[tuple[str, str], AppSeries] = OrderedDict()

    def __len__(self) -> int:
        return len(self._series)

    def _get(self, app_id: str, device_id: str) -> AppSeries:
        key = (app_id, device_id)
        s = self._series.get(key)
        if s is None:
            while len(self._series) >= self.max_series:
                self._series.popitem(last=False)
            s = self._series[key] = AppSeries(app_id, device_id, deque(maxlen=self.max_points),
                                              deque(maxlen=self.max_events))
        self._series.move_to_end(key)
        return s

    def record(self, app_id: str, device_id: str, point: HistoryPoint, *, granted_before_mib: float) -> bool:
        """Add a tick. `granted_before_mib`: the memory granted when the use was measured, to tell an
        overrun. Returns True when an OOM event starts here (the event is recorded too)."""
        s = self._get(app_id, device_id)
        s.points.append(point)
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
            out.append(AppSeries(app, dev, deque(p for p in s.points if p.t_s >= since_t_s),
                                 deque(e for e in s.events if e.t_s >= since_t_s), s.overruns, s.ooms, s.over))
        return out

    def counts(self) -> Iterable[tuple[str, str, int, int]]:
        """(app, device, overruns, OOM events) of every series kept."""
        return [(a, d, s.overruns, s.ooms) for (a, d), s in sorted(self._series.items())]


__all__ = ["OVERRUN_SLACK_MIB", "AppSeries", "History", "HistoryEvent", "HistoryPoint"]
