"""manager/features.py v5: the long-context summaries (120 s) beside an unchanged v4 encoding."""

from __future__ import annotations

import numpy as np
import pytest

from vgpu.manager import features as F
from vgpu.traces import AppTrace

CAP_MIB = 40000.0


def _phases() -> AppTrace:
    """10 Hz: memory flat at 1,000 MiB, a step to 9,000 MiB at 100 s, then flat; compute 0 % until
    130 s, then a linear rise of half a point per second."""
    t = np.arange(0.0, 300.0, 0.1)
    mem = np.where(t < 100, 1000.0, 9000.0)
    sm = np.where(t < 130, 0.0, 0.5 * (t - 130))
    return AppTrace("a", t, {"mem_used_mib": mem, "sm_util_pct": sm, "mem_total_mib": np.full(len(t), CAP_MIB)})


def _long(win: F.Windows, i: int) -> dict[str, float]:
    names = F.FEATURES_V5
    return {k: float(win.x[i, -1, names.index(k)]) for k in F.LONG_FEATURES}


def test_v4_channels_are_the_first_v5_channels() -> None:
    grid = F.build_grid([_phases()])
    origins = np.array([0, 5, 120, 299])
    v4 = F.encode(grid, 16, origins, version=4)
    v5 = F.encode(grid, 16, origins, version=5)
    assert F.FEATURES_V5[: len(F.FEATURES_V4)] == F.FEATURES_V4
    assert v5.x.shape[2] == len(F.FEATURES_V4) + len(F.LONG_FEATURES)
    np.testing.assert_array_equal(v5.x[..., : len(F.FEATURES_V4)], v4.x)
    assert F.history_needed_s(16, 5) == F.LONG_CONTEXT_S and F.history_needed_s(16, 4) == F.CONTEXT_S


def test_long_context_sees_a_step_two_minutes_back_and_a_slow_rise() -> None:
    grid = F.build_grid([_phases()])
    win = F.encode(grid, 16, np.array([50, 110, 219, 220, 299]), version=5)
    flat = _long(win, 0)  # flat since the start: nothing in the span moved
    assert flat["mem_since_step"] == 1.0 and flat["mem_long_max"] == flat["mem_long_min"] == 0.0
    after = _long(win, 1)  # 10 s after the step: the span still holds the old level
    assert after["mem_since_step"] == pytest.approx(10 / F.LONG_CONTEXT_S)
    assert after["mem_long_min"] == pytest.approx(-8000 / CAP_MIB) and after["mem_long_max"] == 0.0
    assert after["mem_long_slope"] > 0
    # 119 s after the step it is the span's first second; at 120 s it has left the span
    assert _long(win, 2)["mem_since_step"] == pytest.approx(119 / F.LONG_CONTEXT_S)
    assert _long(win, 3)["mem_since_step"] == 1.0 and _long(win, 3)["mem_long_min"] == 0.0
    rise = _long(win, 4)  # compute has risen half a point a second for the whole span: no step, a slope
    assert rise["sm_since_step"] == 1.0
    assert rise["sm_long_slope"] == pytest.approx(0.005 * F.SLOPE_PER_S, rel=1e-6)
    assert rise["sm_long_min"] == pytest.approx(-0.595, rel=1e-6) and rise["sm_long_max"] == 0.0


def test_long_context_stays_inside_the_application() -> None:
    """A neighbour on the flat grid never leaks into an application's span, and a young application's
    summaries cover only its own seconds."""
    young = AppTrace("b", np.arange(0.0, 20.0), {"mem_used_mib": np.full(20, 500.0), "sm_util_pct": np.full(20, 50.0)})
    grid = F.build_grid([_phases(), young])
    last_b = int(grid.offsets[2] - 1)
    win = F.encode(grid, 16, np.array([last_b]), version=5)
    got = _long(win, 0)
    assert got["mem_since_step"] == 1.0 and got["sm_since_step"] == 1.0
    assert got["mem_long_min"] == got["mem_long_max"] == got["mem_long_slope"] == 0.0


def test_long_context_in_chunks_equals_in_one_piece() -> None:
    traces = [_phases(), AppTrace("c", np.arange(0.0, 400.0, 0.5),
                                  {"mem_used_mib": np.repeat([100.0, 5000.0, 300.0, 7000.0], 200),
                                   "sm_util_pct": np.tile([0.0, 90.0], 400)})]
    grid = F.build_grid(traces)
    origins = np.arange(len(grid), dtype=np.int64)
    many = F.encode(grid, 16, np.tile(origins, 20), version=5)  # > one chunk of origins
    one = F.encode(grid, 16, origins, version=5)
    np.testing.assert_array_equal(many.x[: len(origins)], one.x)
    np.testing.assert_array_equal(many.x[-len(origins) :], one.x)
