"""manager/features.py: the 1 s grid matches the protocol, windows are causal, normalised, masked."""

from __future__ import annotations

import numpy as np
import pytest

from tests.model_synth import ramp_app
from vgpu.manager import features as F
from vgpu.traces import AppTrace, one_second_grid


def _irregular(app: str, seed: int, n: int = 300) -> AppTrace:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.3, n)) + rng.uniform(0, 50)
    mem = rng.uniform(0, 4000, n)
    mem[rng.random(n) < 0.2] = np.nan  # missing cells
    sm = rng.uniform(0, 100, n)
    return AppTrace(app=app, t_s=t, columns={"mem_used_mib": mem, "sm_util_pct": sm})


def test_grid_matches_protocol_for_many_apps_at_once() -> None:
    traces = [_irregular(f"a{i}", i) for i in range(5)]
    grid = F.build_grid(traces)
    assert grid.n_apps == 5
    for i, trace in enumerate(traces):
        for col in ("mem_used_mib", "sm_util_pct"):
            secs, ref = one_second_grid(trace, col)
            part = grid.values[col][grid.offsets[i] : grid.offsets[i + 1]]
            first = int(secs[0]) - int(grid.start_s[i])
            assert np.allclose(part[first:], ref)
            assert np.isnan(part[:first]).all()


def test_window_at_an_origin_equals_window_of_the_prefix() -> None:
    trace = _irregular("a", 3, n=400)
    grid = F.build_grid([trace])
    origins = np.array([2, 10, 40, len(grid) - 1])
    full = F.encode(grid, 16, origins)
    for k, o in enumerate(origins):
        cut = grid.start_s[0] + o + 1  # every sample of the origin's second, nothing later
        keep = trace.t_s < cut
        prefix = AppTrace(
            app="a", t_s=trace.t_s[keep], columns={c: v[keep] for c, v in trace.columns.items()}
        )
        win, present = F.encode_latest([prefix], 16)
        assert present.tolist() == [True]
        np.testing.assert_allclose(win.x[0], full.x[k], atol=1e-6)
        assert win.mem_scale_mib[0] == pytest.approx(full.mem_scale_mib[k])


def test_normalised_by_capacity_and_padded_on_the_left() -> None:
    trace = ramp_app("a", seconds=30, mem_total_mib=10240.0)
    grid = F.build_grid([trace])
    win = F.encode(grid, 16, np.array([4]))
    fi = F.FEATURES.index
    x = win.x[0]
    assert x[:11, fi("valid")].sum() == 0 and x[11:, fi("valid")].all()
    assert np.all(x[:11] == 0)  # before the application's first second: all zero
    mem = trace.columns["mem_used_mib"][:5]
    np.testing.assert_allclose(x[11:, fi("mem_frac")], mem / 10240.0, rtol=1e-5)
    assert x[-1, fi("mem_total_known")] == 1
    assert x[-1, fi("mem_frac_vs_last")] == 0
    assert win.mem_scale_mib[0] == 10240.0
    # signals the trace lacks: zero with the present flag off
    assert np.all(x[:, fi("power_present")] == 0) and np.all(x[:, fi("power_frac")] == 0)
    assert np.all(x[11:, fi("sm_present")] == 1)


def test_unknown_capacity_uses_a_causal_fallback_scale() -> None:
    trace = ramp_app("a", seconds=30, mem_total_mib=None)
    grid = F.build_grid([trace])
    win = F.encode(grid, 8, np.array([5, 29]))
    fi = F.FEATURES.index
    seen5 = np.max(trace.columns["mem_used_mib"][:6])
    assert win.mem_scale_mib[0] == pytest.approx(max(F.MEM_FALLBACK_MIN_MIB, 1.25 * seen5))
    assert np.all(win.x[:, -1, fi("mem_total_known")] == 0)


def test_targets_are_normalised_changes_masked_past_the_end() -> None:
    trace = ramp_app("a", seconds=20, mem_total_mib=8192.0)
    grid = F.build_grid([trace, ramp_app("b", seconds=20, seed=3)])
    origins = np.array([5, 17, 19])
    win = F.encode(grid, 8, origins)
    y, mask = F.targets(grid, win, (1, 2, 3, 4, 5))
    mem = trace.columns["mem_used_mib"]
    assert y[0, 0, 2] == pytest.approx(100 * (mem[8] - mem[5]) / 8192.0, rel=1e-5)
    assert mask[0].all()
    assert mask[1, :, :2].all() and not mask[1, :, 2:].any()  # origin 17: only 18 and 19 exist
    assert not mask[2].any()  # the last second has no future (never the next application's)


def test_empty_history_is_reported_absent() -> None:
    empty = AppTrace(app="e", t_s=np.zeros(0), columns={"sm_util_pct": np.zeros(0)})
    win, present = F.encode_latest([empty, ramp_app("a", seconds=5)], 8)
    assert present.tolist() == [False, True]
    assert win.x.shape == (1, 8, F.N_FEATURES)


def test_feature_spec_round_trip_and_validation() -> None:
    spec = F.FeatureSpec(window_s=24)
    assert F.FeatureSpec.from_dict(spec.to_dict()) == spec and spec.version == F.FEATURE_VERSION == 3
    v2 = F.FeatureSpec.for_version(24, 2)
    assert F.FeatureSpec.from_dict(v2.to_dict()) == v2 and v2.version == 2
    with pytest.raises(ValueError, match="window_s"):
        F.FeatureSpec(window_s=1)


def test_samples_out_of_time_order_give_the_same_grid() -> None:
    trace = _irregular("a", 5)
    perm = np.random.default_rng(0).permutation(len(trace))
    shuffled = AppTrace(app="a", t_s=trace.t_s[perm], columns={c: v[perm] for c, v in trace.columns.items()})
    g1, g2 = (
        F.build_grid([ramp_app("b", seconds=9), trace]),
        F.build_grid([ramp_app("b", seconds=9), shuffled]),
    )
    for c in ("mem_used_mib", "sm_util_pct"):
        np.testing.assert_array_equal(g1.values[c], g2.values[c])
    np.testing.assert_array_equal(g1.mem_max_mib, g2.mem_max_mib)


def _phased(seconds: int = 200) -> AppTrace:
    """1 sample/s: compute 20 % for 100 s then 80 %; memory 1000 MiB then 3000 MiB of 10240."""
    t = 500.0 + np.arange(seconds, dtype=np.float64)
    k = np.arange(seconds)
    sm = np.where(k < 100, 20.0, 80.0)
    mem = np.where(k < 100, 1000.0, 3000.0)
    return AppTrace(app="p", t_s=t, columns={"mem_used_mib": mem, "sm_util_pct": sm, "mem_total_mib": np.full(seconds, 10240.0)})


def test_v3_age_and_context_summaries() -> None:
    grid = F.build_grid([_phased()])
    win = F.encode(grid, 8, np.array([2, 60, 110, 199]), version=3)
    fi = F.FEATURES_V3.index
    x = win.x[:, -1]
    # age: seconds since the first sample, capped at 120 s, scaled to [0, 1]
    np.testing.assert_allclose(x[:, fi("age_frac")], [2 / 120, 60 / 120, 110 / 120, 1.0], rtol=1e-6)
    # origin 110: the last 30 s hold 19 s at 20 % and 11 s at 80 %, relative to the origin's 80 %
    rel = np.r_[np.full(19, -0.6), np.zeros(11)]
    assert x[2, fi("sm_ctx_mean")] == pytest.approx(rel.mean(), rel=1e-5)
    assert x[2, fi("sm_ctx_min")] == pytest.approx(-0.6, rel=1e-6) and x[2, fi("sm_ctx_max")] == 0
    assert x[2, fi("sm_ctx_std")] == pytest.approx(rel.std(), rel=1e-5)
    assert x[2, fi("mem_ctx_min")] == pytest.approx(-2000.0 / 10240.0, rel=1e-6)
    # origin 2: only the 3 seconds of history count; origin 199: a flat stretch
    assert x[0, fi("sm_ctx_mean")] == 0 and x[0, fi("sm_ctx_std")] == 0
    assert np.all(x[3, [fi(f"{s}_ctx_{k}") for s in ("mem", "sm") for k in ("mean", "max", "min", "std")]] == 0)
    # the same on every valid step of the window, zero before the application's first second
    ctx = [fi(name) for name in F.CONTEXT_FEATURES]
    assert np.all(win.x[0, :5][:, ctx] == 0) and np.all(win.x[0, 5:][:, ctx] == win.x[0, -1, ctx])
    assert np.all(win.x[2][:, ctx] == win.x[2, -1, ctx])


def test_v2_channels_are_the_first_v3_channels_and_unknown_versions_fail() -> None:
    grid = F.build_grid([_phased(), ramp_app("a", seconds=40)])
    origins = np.array([3, 150, 205, 230])
    v2 = F.encode(grid, 16, origins, version=2)
    v3 = F.encode(grid, 16, origins, version=3)
    assert v2.x.shape[2] == len(F.FEATURES_V2) == 19 and v3.x.shape[2] == len(F.FEATURES_V3)
    assert F.FEATURES_V3[: len(F.FEATURES_V2)] == F.FEATURES_V2
    np.testing.assert_array_equal(v3.x[..., : len(F.FEATURES_V2)], v2.x)
    np.testing.assert_array_equal(v3.last, v2.last)
    for bad in (1, 6):
        with pytest.raises(ValueError, match=f"unknown feature encoding v{bad}"):
            F.encode(grid, 16, origins, version=bad)
        with pytest.raises(ValueError, match="unknown feature encoding"):
            F.encode_latest([_phased()], 16, bad)
    assert F.FeatureSpec.for_version(16, 2).features == F.FEATURES_V2
