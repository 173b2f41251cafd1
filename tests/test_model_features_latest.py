"""manager/features.py `encode_latest`: cutting each history to its recent seconds gives exactly the
windows of the whole histories, whatever the histories hold."""

from __future__ import annotations

import numpy as np
import pytest

from vgpu.manager import features as F
from vgpu.traces import AppTrace


def _reference(
    histories: list[AppTrace], window_s: int, version: int = F.FEATURE_VERSION
) -> tuple[F.Windows, np.ndarray]:
    grid = F.build_grid(histories)
    last = grid.last_bins()
    present = last >= 0
    return F.encode(grid, window_s, last[present], version), present


def _app(seed: int, *, seconds: float = 60.0, step_s: float = 0.1) -> AppTrace:
    rng = np.random.default_rng(seed)
    t = 1000.0 + np.arange(0.0, seconds, step_s) + rng.uniform(0, 0.05)
    n = len(t)
    return AppTrace(
        app=f"a{seed}",
        t_s=t,
        columns={
            "mem_used_mib": rng.uniform(100, 4000, n),
            "sm_util_pct": rng.uniform(0, 100, n),
            "mem_total_mib": np.full(n, 40960.0),
            "power_w": rng.uniform(50, 300, n),
            "power_limit_w": np.full(n, 400.0),
        },
    )


def _variants() -> list[AppTrace]:
    out = [_app(i) for i in range(4)]
    # memory capacity unknown, the largest memory long before the window (fallback scale)
    a = _app(10)
    mem = a.columns["mem_used_mib"].copy()
    mem[5] = 30000.0
    out.append(AppTrace(a.app + "peak", a.t_s, {"mem_used_mib": mem, "sm_util_pct": a.columns["sm_util_pct"]}))
    # a column that stops long before the window: its last value is carried into the window
    b = _app(11)
    power = b.columns["power_w"].copy()
    power[100:] = np.nan
    out.append(AppTrace(b.app + "stops", b.t_s, {**b.columns, "power_w": power}))
    # a column missing in the first kept second only
    c = _app(12)
    sm = c.columns["sm_util_pct"].copy()
    sm[-200:-150] = np.nan
    out.append(AppTrace(c.app + "hole", c.t_s, {**c.columns, "sm_util_pct": sm}))
    # a long gap before the window, and sparse irregular samples
    d = _app(13)
    keep = (d.t_s < 1010.0) | (d.t_s > 1045.0)
    out.append(AppTrace(d.app + "gap", d.t_s[keep], {k: v[keep] for k, v in d.columns.items()}))
    rng = np.random.default_rng(14)
    t = 1000.0 + np.cumsum(rng.exponential(1.5, 50))
    out.append(AppTrace("sparse", t, {"mem_used_mib": rng.uniform(0, 100, 50), "sm_util_pct": rng.uniform(0, 9, 50)}))
    # short (all inside the window), empty, one sample
    out.append(_app(15, seconds=5.0))
    out.append(AppTrace("empty", np.zeros(0), {"mem_used_mib": np.zeros(0)}))
    out.append(AppTrace("one", np.array([5.5]), {"sm_util_pct": np.array([40.0])}))
    # longer than the age cap (v3's age must come out capped from the cut history too)
    out.append(_app(16, seconds=200.0))
    return out


@pytest.mark.parametrize("version", sorted(F.FEATURES_BY_VERSION))
@pytest.mark.parametrize("window_s", [2, 16, 40])
def test_latest_windows_equal_those_of_the_whole_histories(window_s: int, version: int) -> None:
    hist = _variants()
    got, present = F.encode_latest(hist, window_s, version)
    ref, ref_present = _reference(hist, window_s, version)
    assert got.x.shape[2] == len(F.features_of(version))
    assert present.tolist() == ref_present.tolist()
    np.testing.assert_array_equal(got.x, ref.x)
    np.testing.assert_array_equal(got.mem_scale_mib, ref.mem_scale_mib)
    np.testing.assert_array_equal(got.last, ref.last)


def test_each_history_alone_equals_it_among_others() -> None:
    hist = _variants()
    together, present = F.encode_latest(hist, 16)
    row = 0
    for h, ok in zip(hist, present, strict=True):
        alone, p = F.encode_latest([h], 16)
        assert p.tolist() == [bool(ok)]
        if ok:
            np.testing.assert_array_equal(alone.x[0], together.x[row])
            row += 1


def test_samples_out_of_time_order_are_sorted_as_before() -> None:
    a = _app(20)
    order = np.random.default_rng(0).permutation(len(a))
    shuffled = AppTrace(a.app, a.t_s[order], {k: v[order] for k, v in a.columns.items()})
    got, _ = F.encode_latest([shuffled, _app(21)], 16)
    ref, _ = _reference([a, _app(21)], 16)
    np.testing.assert_allclose(got.x, ref.x, rtol=0, atol=1e-6)


def test_the_fallback_memory_scale_remembers_a_peak_before_the_window() -> None:
    a = _app(30)
    mem = np.full(len(a), 1000.0)
    mem[3] = 20000.0  # long before the last 16 s
    h = AppTrace("peak", a.t_s, {"mem_used_mib": mem})
    win, _ = F.encode_latest([h], 16)
    assert win.mem_scale_mib[0] == pytest.approx(F.MEM_FALLBACK_HEADROOM * 20000.0)


def test_only_the_recent_seconds_are_gridded() -> None:
    hist = [_app(40), _app(41)]
    lengths = np.array([len(h) for h in hist])
    t_all = np.concatenate([h.t_s for h in hist])
    cut = F._recent_cut(lengths, t_all, F._columns(hist, lengths), 16)
    assert cut is not None
    _, kept, _, first_s = cut
    assert (kept <= 18 * 10).all() and (kept >= 16 * 10).all()  # ~17 s of 100 ms samples, not 60 s
    assert first_s.tolist() == [int(np.floor(h.t_s[0])) for h in hist]  # for the age: the whole history's


def test_v3_grids_the_context_span_v2_only_the_window() -> None:
    hist = [_app(42, seconds=90.0)]
    lengths = np.array([len(hist[0])])
    t_all = hist[0].t_s
    cols = F._columns(hist, lengths)
    for version, seconds in ((2, 16), (3, F.CONTEXT_S)):
        cut = F._recent_cut(lengths, t_all, cols, F.history_needed_s(16, version))
        assert cut is not None
        assert seconds * 10 <= cut[1][0] <= (seconds + 2) * 10


@pytest.mark.parametrize("window_s", [2, 16, 30])
def test_the_recent_grid_holds_the_whole_grids_values_in_each_latest_window(window_s: int) -> None:
    """`build_recent_grid` (what the node-local trees forecast from): each column's values over each
    application's last `window_s` seconds, and each application's first second, as on the grid of the
    whole histories; a column missing in the first kept second keeps its history whole."""
    hist = _variants()
    columns = ("mem_used_mib", "sm_util_pct", "power_w")
    got, ref = F.build_recent_grid(hist, columns, window_s), F.build_grid(hist, columns)
    assert got.first_s.tolist() == ref.first_s.tolist()
    cut = got.start_s > got.first_s
    assert cut.any() and not cut.all()
    for i in np.flatnonzero(np.diff(ref.offsets) > 0):
        last_s = int(ref.start_s[i]) + int(ref.offsets[i + 1] - ref.offsets[i]) - 1
        seconds = np.arange(max(last_s - window_s + 1, int(ref.start_s[i])), last_s + 1)
        for name in columns:
            mine = got.values[name][got.offsets[i] + seconds - got.start_s[i]]
            whole = ref.values[name][ref.offsets[i] + seconds - ref.start_s[i]]
            np.testing.assert_array_equal(mine, whole, err_msg=f"{hist[i].app} {name}")


def test_a_recent_grid_of_histories_out_of_time_order_is_the_whole_grid() -> None:
    hist = _variants()
    a = hist[0]
    order = np.random.default_rng(0).permutation(len(a))
    hist[0] = AppTrace(a.app, a.t_s[order], {k: v[order] for k, v in a.columns.items()})
    got, ref = F.build_recent_grid(hist, ("mem_used_mib",), 16), F.build_grid(hist, ("mem_used_mib",))
    np.testing.assert_array_equal(got.offsets, ref.offsets)
    np.testing.assert_array_equal(got.values["mem_used_mib"], ref.values["mem_used_mib"])
