"""The allocator's per-application history: bounded by points, series and departed applications."""

from __future__ import annotations

import math

from vgpu.allocator.history import History, HistoryPoint


def _point(t: float, used: float = 100.0) -> HistoryPoint:
    return HistoryPoint(t, used, used, used, 200.0, 10.0, 10.0, 20.0)


def test_points_keep_their_order_while_the_storage_grows_and_wraps() -> None:
    h = History(max_points=150)
    for t in range(400):
        h.record("a", "gpu0", _point(float(t)), granted_before_mib=200.0)
    (s,) = h.series("a")
    assert [p.t_s for p in s.points] == [float(t) for t in range(250, 400)]


def test_only_the_most_recent_departed_applications_keep_their_series() -> None:
    h = History(max_departed=2)
    for app in ("a", "b", "c"):
        h.record(app, "gpu0", _point(1.0), granted_before_mib=200.0)
    h.record("live", "gpu0", _point(1.0), granted_before_mib=200.0)
    for app in ("a", "b", "c"):
        h.depart(app)
    assert {s.app_id for s in h.series()} == {"b", "c", "live"}
    h.record("b", "gpu0", _point(2.0), granted_before_mib=200.0)  # back: live again
    h.depart("c")
    h.record("d", "gpu0", _point(3.0), granted_before_mib=200.0)
    h.depart("d")
    assert {s.app_id for s in h.series()} == {"b", "c", "d", "live"}


def test_an_overrun_run_is_one_oom_event() -> None:
    h = History()
    started = [h.record("a", "g", _point(float(t), used), granted_before_mib=200.0)
               for t, used in enumerate([100.0, 900.0, 900.0, 100.0, 900.0])]
    assert started == [False, True, False, False, True]
    (s,) = h.series("a")
    assert (s.overruns, s.ooms) == (3, 2) and not math.isnan(s.points[0].t_s)
