"""Feature encoding v4: the in-app leading signals with presence flags; v3 checkpoints unchanged; a tiny
v4 training run end to end, served with and without the signals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoint_synth import write_tiny_checkpoint
from vgpu.manager import features as F
from vgpu.manager.checkpoint import load_checkpoint
from vgpu.manager.predictor import load_forecaster
from vgpu.offline import train as T
from vgpu.traces import AppTrace, write_trace


def _serving_app(name: str, n_s: int = 60, seed: int = 0, inapp: bool = True) -> AppTrace:
    """A serving engine at 2 Hz: requests waiting lead the KV cache and memory by a few seconds."""
    rng = np.random.default_rng(seed)
    t = np.arange(0.0, n_s, 0.5)
    waiting = np.clip(np.round(8 * np.sin(t / 6 + seed)), 0, None)
    running = np.minimum(16.0, 4 + np.roll(waiting, 6))
    kv = 400.0 * running + rng.normal(0, 5, len(t))
    cols = {
        "mem_used_mib": 20_000.0 + kv,
        "sm_util_pct": np.clip(20 + 4 * running, 0, 100),
        "mem_total_mib": np.full(len(t), 81_920.0),
    }
    if inapp:
        cols |= {
            "inapp_requests_running": running,
            "inapp_requests_waiting": waiting,
            "inapp_kv_used_mib": kv,
            "inapp_kv_total_mib": np.full(len(t), 30_000.0),
            "inapp_torch_allocated_mib": 19_000.0 + kv,
            "inapp_torch_reserved_mib": 20_000.0 + kv,
            "inapp_alloc_retries": np.floor(t / 10),
        }
    return AppTrace(name, t, cols)


def test_v4_channels_and_presence_flags() -> None:
    with_sig, without = _serving_app("a"), _serving_app("b", inapp=False)
    grid = F.build_grid([with_sig, without])
    origins = np.array([40, int(grid.offsets[1]) + 40])
    v3 = F.encode(grid, 8, origins, version=3)
    v4 = F.encode(grid, 8, origins, version=4)
    assert v4.x.shape[2] == len(F.FEATURES_V4) == len(F.FEATURES_V3) + len(F.INAPP_FEATURES)
    np.testing.assert_array_equal(v4.x[..., : len(F.FEATURES_V3)], v3.x)  # v3 channels untouched
    fi = F.FEATURES_V4.index
    for flag in ("torch_present", "retries_present", "requests_present", "kv_present"):
        assert (v4.x[0, :, fi(flag)] == 1).all() and (v4.x[1, :, fi(flag)] == 0).all(), flag
    for name in F.INAPP_FEATURES:
        assert (v4.x[1, :, fi(name)] == 0).all(), name  # absent signals are zero, not NaN
    # the values: KV cache in use as a fraction of its pool, requests as log counts
    sec = 40
    kv_mean = float(np.mean(with_sig.columns["inapp_kv_used_mib"][2 * sec: 2 * sec + 2]))
    assert v4.x[0, -1, fi("kv_used_frac")] == pytest.approx(kv_mean / 30_000.0, rel=1e-5)
    waiting = float(np.mean(with_sig.columns["inapp_requests_waiting"][2 * sec: 2 * sec + 2]))
    assert v4.x[0, -1, fi("requests_waiting_log")] == pytest.approx(math.log1p(waiting) / F.COUNT_LOG_SCALE, rel=1e-5)
    assert np.isfinite(v4.x).all()


def test_a_retry_counter_reset_reads_as_no_retries() -> None:
    app = _serving_app("a")
    retries = np.array(app.columns["inapp_alloc_retries"])
    retries[60:] = 0.0  # the application restarted its counter at 30 s
    app = AppTrace("a", app.t_s, {**app.columns, "inapp_alloc_retries": retries})
    grid = F.build_grid([app])
    x = F.encode(grid, 40, np.array([45]), version=4).x
    assert (x[0, :, F.FEATURES_V4.index("torch_retries_log")] >= 0).all()


def test_v4_latest_windows_match_the_full_grid() -> None:
    apps = [_serving_app("a", n_s=90), _serving_app("b", n_s=90, inapp=False, seed=3)]
    got, present = F.encode_latest(apps, 16, version=4)
    grid = F.build_grid(apps)
    want = F.encode(grid, 16, grid.last_bins(), version=4)
    assert present.all()
    np.testing.assert_allclose(got.x, want.x, atol=1e-6)


def test_v3_checkpoints_still_serve_traces_with_inapp_columns(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "v3.pt", version=3)
    fc = load_forecaster(path, "cpu", mode="fused")
    assert fc.feature_version == 3
    out = fc.forecast_batch([_serving_app("a"), _serving_app("b", inapp=False)])
    assert all(math.isfinite(v) for f in out for v in f.mem_p50_mib)


def test_a_tiny_v4_training_run_serves_with_and_without_the_signals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "serving.csv.gz"
    # split by name (vgpu.offline.splits): enough applications that train and val are both non-empty
    write_trace(trace, [_serving_app(f"engine-{i}", seed=i, inapp=i % 3 != 0) for i in range(24)])
    out = tmp_path / "v4.pt"
    rc = T.main(["--trace", str(trace), "--out", str(out), "--epochs", "1", "--window", "8", "--quiet",
                 "--feature-version", "4", "--licence", "test-only"], "vgpu train")
    assert rc == 0
    json.loads(capsys.readouterr().out)
    meta = load_checkpoint(out).metadata
    assert meta.features.version == 4 and meta.config.n_features == len(F.FEATURES_V4)
    fc = load_forecaster(out, "cpu")
    forecasts = fc.forecast_batch([_serving_app("x", seed=50), _serving_app("y", seed=51, inapp=False)])
    assert all(math.isfinite(v) for f in forecasts for v in (*f.mem_p50_mib, *f.sm_p90_pct))
