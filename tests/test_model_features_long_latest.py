"""manager/features.py: v5's latest windows, from each history's last 120 s, equal those of the whole
histories (the way v5 was trained) on histories longer than the span, with the in-app columns present
or absent, gaps inside the span, late starts and missing columns."""

from __future__ import annotations

import numpy as np
import pytest

from vgpu.manager import features as F
from vgpu.traces import AppTrace


def _one_long_grid(histories: list[AppTrace], window_s: int) -> tuple[F.Windows, np.ndarray]:
    """The features from one grid of the whole histories."""
    grid = F.build_grid(histories)
    last = grid.last_bins()
    present = last >= 0
    return F.encode(grid, window_s, last[present], 5), present


def _app(seed: int, *, seconds: float = 200.0, start: float = 1000.0, inapp: bool = False) -> AppTrace:
    rng = np.random.default_rng(seed)
    t = start + np.arange(0.0, seconds, 0.1) + rng.uniform(0, 0.05)
    n = len(t)
    mem = np.cumsum(rng.normal(0, 30, n)) + 4000 + np.where(t > start + seconds / 2, 6000.0, 0.0)
    cols = {
        "mem_used_mib": mem,
        "sm_util_pct": np.clip(rng.normal(50, 20, n) + np.where(t > start + 60, 30, 0), 0, 100),
        "mem_total_mib": np.full(n, 40960.0),
        "power_w": rng.uniform(50, 300, n),
        "power_limit_w": np.full(n, 400.0),
        "sm_clock_mhz": rng.uniform(1000, 1800, n),
    }
    if inapp:
        cols |= {
            "inapp_torch_allocated_mib": mem * 0.8,
            "inapp_torch_reserved_mib": mem * 0.9,
            "inapp_alloc_retries": np.floor(np.arange(n) / 500.0),
            "inapp_requests_running": rng.integers(0, 20, n).astype(float),
            "inapp_kv_used_mib": rng.uniform(0, 2000, n),
            "inapp_kv_total_mib": np.full(n, 4000.0),
        }
    return AppTrace(app=f"a{seed}", t_s=t, columns=cols)


def _with(a: AppTrace, name: str, values: np.ndarray, suffix: str) -> AppTrace:
    return AppTrace(a.app + suffix, a.t_s, {**a.columns, name: values})


def _variants() -> list[AppTrace]:
    out = [_app(0), _app(1, inapp=True), _app(2, seconds=45.0), _app(3, start=5000.0, seconds=90.0, inapp=True)]
    # memory stops 100 s before the origin: carried over the whole long span, not over the short one
    a = _app(4)
    mem = a.columns["mem_used_mib"].copy()
    mem[-1000:] = np.nan
    out.append(_with(a, "mem_used_mib", mem, "memstops"))
    # compute missing in the long span's first kept second only; power missing in the short one's
    b = _app(5, inapp=True)
    sm = b.columns["sm_util_pct"].copy()
    sm[-1210:-1190] = np.nan
    power = b.columns["power_w"].copy()
    power[-310:-290] = np.nan
    out.append(_with(_with(b, "sm_util_pct", sm, ""), "power_w", power, "holes"))
    # a 70 s gap inside the long span, and one straddling the short span's start
    c = _app(6)
    keep = (c.t_s < c.t_s[0] + 100.0) | (c.t_s > c.t_s[0] + 170.0)
    out.append(AppTrace(c.app + "gap", c.t_s[keep], {k: v[keep] for k, v in c.columns.items()}))
    d = _app(7, inapp=True)
    keep = (d.t_s < d.t_s[-1] - 40.0) | (d.t_s > d.t_s[-1] - 20.0)
    out.append(AppTrace(d.app + "gap30", d.t_s[keep], {k: v[keep] for k, v in d.columns.items()}))
    # late start (a history younger than the long span but older than the short one), compute only,
    # memory only, no memory capacity (fallback scale from a peak long before), sparse samples
    out.append(_app(8, start=1150.0, seconds=50.0))
    e = _app(9)
    out.append(AppTrace("smonly", e.t_s, {"sm_util_pct": e.columns["sm_util_pct"]}))
    peak = e.columns["mem_used_mib"].copy()
    peak[10] = 60000.0
    out.append(AppTrace("memonly", e.t_s, {"mem_used_mib": peak}))
    rng = np.random.default_rng(10)
    t = 1000.0 + np.cumsum(rng.exponential(3.0, 80))
    out.append(AppTrace("sparse", t, {"mem_used_mib": rng.uniform(0, 100, 80), "sm_util_pct": rng.uniform(0, 9, 80)}))
    # empty and one sample
    out.append(AppTrace("empty", np.zeros(0), {"mem_used_mib": np.zeros(0)}))
    out.append(AppTrace("one", np.array([5.5]), {"sm_util_pct": np.array([40.0])}))
    return out


@pytest.mark.parametrize("window_s", [2, 16, 40])
@pytest.mark.parametrize("inapp", [True, False], ids=["inapp-present", "inapp-absent"])
def test_v5_latest_features_equal_those_of_the_whole_histories(window_s: int, inapp: bool) -> None:
    hist = _variants()
    if not inapp:
        hist = [AppTrace(h.app, h.t_s, {k: v for k, v in h.columns.items() if not k.startswith("inapp_")})
                for h in hist]
    got, present = F.encode_latest(hist, window_s, 5)
    ref, ref_present = _one_long_grid(hist, window_s)
    assert present.tolist() == ref_present.tolist()
    np.testing.assert_allclose(got.x, ref.x, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.mem_scale_mib, ref.mem_scale_mib, rtol=1e-12)
    np.testing.assert_allclose(got.last, ref.last, rtol=1e-12)
    # the long summaries really read further back than the short grid holds
    first = F.features_of(5).index(F.LONG_FEATURES[0])
    assert np.abs(got.x[..., first : first + len(F.LONG_FEATURES)]).max() > 0.05


@pytest.mark.parametrize("seed", range(6))
def test_random_mixtures_of_histories_agree(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    pool = _variants()
    hist = [pool[i] for i in rng.choice(len(pool), size=8, replace=True)]
    got, _ = F.encode_latest(hist, 16, 5)
    ref, _ = _one_long_grid(hist, 16)
    np.testing.assert_allclose(got.x, ref.x, rtol=0, atol=1e-6)
