"""The v5 serving path is pinned like `tests/test_forecast_golden.py` pins v3: for a fixed v5 model
and fixed 100 ms histories of the manager's 120 s span (in-app counters, holes, a late start,
memory stopping, a missing capacity), the latest feature windows (1e-6), the model's forecasts in
every mode and the expert mixture's over successive seconds (1e-5) equal those recorded in
`tests/fixtures/forecast_golden_v5.npz`, and the shipped model's forecasts equal those recorded
while it is the same file. The record was written by `python tests/test_forecast_golden_v5.py`
before the v5 path was made faster; run it again only for a change meant to alter the forecasts."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.golden_model import golden_checkpoint  # noqa: E402
from vgpu.manager.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from vgpu.manager.experts import make_served  # noqa: E402
from vgpu.manager.features import FEATURES_V5, encode_latest  # noqa: E402
from vgpu.manager.forecast import Forecast  # noqa: E402
from vgpu.manager.predictor import DEFAULT_MODEL_PATH, ModelForecaster  # noqa: E402
from vgpu.traces import AppTrace  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "forecast_golden_v5.npz"
TOL = 1e-5
FEATURE_TOL = 1e-6
N_APPS = 20
HISTORY_S = 120.0
STEPS = 8
MODES = ("eager", "fused", "onnx")


def _checkpoint() -> Checkpoint:
    return golden_checkpoint(11, FEATURES_V5, 5, "golden-v5")


def _histories() -> list[AppTrace]:
    """100 ms histories of HISTORY_S + STEPS + 30 seconds with what v5 reads apart: in-app
    counters for some, no capacity, holes of seconds, a late start, memory stopping, a column
    missing, compute only, sparse samples, steps of memory, an empty history."""
    rng = np.random.default_rng(55)
    out = []
    span_s = HISTORY_S + STEPS + 30
    for i in range(N_APPS):
        start = 100.0 if i == 5 else 0.0
        t = 1000.0 + start + np.arange(0, span_s - start, 0.1)
        n = len(t)
        ramp = np.clip((t - 1000.0 - 25 * (i % 5)) / 20.0, 0, 1)
        steps = 500.0 * np.floor((t - 1000.0) / 37.0) * (i % 3 == 0)
        cols = {
            "mem_used_mib": 1000.0 + 300 * i * ramp + steps + rng.normal(0, 8, n),
            "sm_util_pct": np.clip(rng.normal(20 + 50 * ramp, 8, n), 0, 100),
            "mem_total_mib": np.full(n, 40960.0),
            "power_w": rng.uniform(100, 300, n),
            "power_limit_w": np.full(n, 400.0),
        }
        if i % 4 == 1:  # in-app counters: PyTorch allocator and a serving engine
            cols["inapp_torch_allocated_mib"] = cols["mem_used_mib"] * 0.8
            cols["inapp_torch_reserved_mib"] = cols["mem_used_mib"] * 0.9
            cols["inapp_alloc_retries"] = np.floor((t - 1000.0) / 13.0)
            cols["inapp_requests_running"] = rng.integers(0, 30, n).astype(np.float64)
            cols["inapp_requests_waiting"] = rng.integers(0, 5, n).astype(np.float64)
            cols["inapp_kv_used_mib"] = rng.uniform(0, 4000, n)
            cols["inapp_kv_total_mib"] = np.full(n, 8000.0)
        if i == 9:  # in-app memory only, with a hole
            alloc = cols["mem_used_mib"] * 0.7
            alloc[(t > 1060.0) & (t < 1075.0)] = np.nan
            cols["inapp_torch_allocated_mib"] = alloc
        if i == 2:
            del cols["mem_total_mib"]
        if i == 3:  # holes of seconds in every column
            keep = ((t < 1030.0) | (t > 1036.0)) & ((t < 1100.0) | (t > 1103.5))
            t = t[keep]
            cols = {k: v[keep] for k, v in cols.items()}
        if i == 4:
            cols = {"sm_util_pct": cols["sm_util_pct"]}
        if i == 6:
            t, cols = t[:0], {k: v[:0] for k, v in cols.items()}
        if i == 7:  # memory stops being reported 20 s before the first origin
            cols["mem_used_mib"][t > 1000.0 + HISTORY_S - 20] = np.nan
        if i == 8:  # sparse: one sample in three seconds
            keep = np.arange(n) % 30 == 0
            t = t[keep]
            cols = {k: v[keep] for k, v in cols.items()}
        if i == 10:
            del cols["power_w"]
        if i == 11:  # memory missing at the start of the span
            cols["mem_used_mib"][t < 1000.0 + 40] = np.nan
        out.append(AppTrace(app=f"golden5/{i}", t_s=t, columns=cols, gpu="sim0"))
    return out


def _upto(hist: list[AppTrace], end_s: float) -> list[AppTrace]:
    out = []
    for h in hist:
        lo, n = int(np.searchsorted(h.t_s, end_s - HISTORY_S)), int(np.searchsorted(h.t_s, end_s))
        out.append(AppTrace(h.app, h.t_s[lo:n], {k: v[lo:n] for k, v in h.columns.items()}, gpu=h.gpu))
    return out


def _origin(k: int) -> float:
    return 1000.0 + HISTORY_S + 25.0 + k + 0.55


def _array(fcs: list[Forecast]) -> np.ndarray:
    return np.array([(f.mem_p50_mib, f.mem_p90_mib, f.sm_p50_pct, f.sm_p90_pct) for f in fcs], dtype=np.float64)


def _shipped_digest() -> str:
    return hashlib.sha256(DEFAULT_MODEL_PATH.read_bytes()).hexdigest() if DEFAULT_MODEL_PATH.exists() else ""


def compute(modes: tuple[str, ...] = MODES, shipped: bool = True) -> dict[str, np.ndarray]:
    torch.set_num_threads(1)
    ck = _checkpoint()
    hist = _histories()
    out: dict[str, np.ndarray] = {}
    feats, lasts, scales, presents = [], [], [], []
    for k in range(STEPS):
        windows, present = encode_latest(_upto(hist, _origin(k)), 16, 5)
        feats.append(windows.x)
        lasts.append(windows.last)
        scales.append(windows.mem_scale_mib)
        presents.append(present)
    out["features"] = np.stack(feats)
    out["last"] = np.stack(lasts)
    out["mem_scale_mib"] = np.stack(scales)
    out["present"] = np.stack(presents)
    for mode in modes:
        model = ModelForecaster(ck, "cpu", mode=mode, threads=1)
        out[f"model_{mode}"] = np.stack([_array(model.forecast_batch(_upto(hist, _origin(k)))) for k in range(STEPS)])
        mixture = make_served(model)
        out[f"mixture_{mode}"] = np.stack([_array(mixture.forecast_batch(_upto(hist, _origin(k)))) for k in range(STEPS)])
    if shipped and _shipped_digest():
        served = ModelForecaster(load_checkpoint(DEFAULT_MODEL_PATH), "cpu", mode="onnx", threads=1)
        out["shipped"] = np.stack([_array(served.forecast_batch(_upto(hist, _origin(k)))) for k in range(STEPS)])
        out["shipped_sha256"] = np.array(_shipped_digest())
    return out


def test_the_latest_windows_equal_the_recorded_ones() -> None:
    want = np.load(GOLDEN)
    got = compute(modes=(), shipped=False)
    assert want["features"].shape[-1] == len(FEATURES_V5)
    np.testing.assert_array_equal(got["present"], want["present"])
    for key in ("features", "last", "mem_scale_mib"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=FEATURE_TOL, equal_nan=True, err_msg=key)


def test_a_batch_without_in_app_counters_gives_the_recorded_windows() -> None:
    """A batch in which no application reports an in-app counter skips that work: its windows are
    the recorded ones of the same applications (encoded among others that report them)."""
    want = np.load(GOLDEN)
    k = 3
    batch = _upto(_histories(), _origin(k))
    plain = [i for i, h in enumerate(batch) if len(h) and not any(c.startswith("inapp_") for c in h.columns)]
    assert len(plain) >= 10
    windows, present = encode_latest([batch[i] for i in plain], 16, 5)
    assert present.all()
    rows = np.cumsum(want["present"][k]) - 1  # each history's row among the present ones
    np.testing.assert_allclose(windows.x, want["features"][k][rows[plain]], rtol=0, atol=FEATURE_TOL)


@pytest.mark.parametrize("shuffled", [False, True])
def test_a_batch_with_every_second_sampled_gives_the_recorded_windows(shuffled: bool) -> None:
    """Without the histories that have empty seconds (a hole, sparse samples), every second of the
    batch has a sample, which the grid sums in one pass; samples handed over out of time order are
    put in order first. Either way the windows are the recorded ones of the same applications."""
    want = np.load(GOLDEN)
    rng = np.random.default_rng(3)
    k = 5
    batch = _upto(_histories(), _origin(k))
    keep = [i for i in range(N_APPS) if i not in (3, 8) and len(batch[i])]
    hist = []
    for i in keep:
        h = batch[i]
        perm = rng.permutation(len(h)) if shuffled else np.arange(len(h))
        hist.append(AppTrace(h.app, h.t_s[perm], {c: v[perm] for c, v in h.columns.items()}, gpu=h.gpu))
    windows, present = encode_latest(hist, 16, 5)
    assert present.all()
    rows = np.cumsum(want["present"][k]) - 1
    np.testing.assert_allclose(windows.x, want["features"][k][rows[keep]], rtol=0, atol=FEATURE_TOL)
    np.testing.assert_allclose(windows.last, want["last"][k][rows[keep]], rtol=0, atol=FEATURE_TOL)


@pytest.mark.parametrize("mode", MODES)
def test_forecasts_equal_the_recorded_ones(mode: str) -> None:
    if mode == "onnx":
        pytest.importorskip("onnxruntime")
    want = np.load(GOLDEN)
    got = compute((mode,), shipped=False)
    for key in (f"model_{mode}", f"mixture_{mode}"):
        ref = want[key]
        assert np.isfinite(ref).sum() > 0.9 * ref.size  # forecasts with something to compare
        np.testing.assert_allclose(got[key], ref, rtol=TOL, atol=TOL, equal_nan=True, err_msg=key)


def test_the_shipped_model_forecasts_as_recorded() -> None:
    pytest.importorskip("onnxruntime")
    want = np.load(GOLDEN)
    if "shipped" not in want or str(want["shipped_sha256"]) != _shipped_digest():
        pytest.skip("the shipped model is not the one recorded")
    served = ModelForecaster(load_checkpoint(DEFAULT_MODEL_PATH), "cpu", mode="onnx", threads=1)
    hist = _histories()
    got = np.stack([_array(served.forecast_batch(_upto(hist, _origin(k)))) for k in range(STEPS)])
    np.testing.assert_allclose(got, want["shipped"], rtol=TOL, atol=TOL, equal_nan=True)


def test_the_recorded_record_sees_every_case() -> None:
    """The record has what makes it worth comparing: forecasts that move away from the last value,
    in-app channels, v5's long channels away from zero, and the empty history."""
    want = np.load(GOLDEN)
    mem50 = want["model_eager"][..., 0, :]
    finite = np.isfinite(mem50)
    assert np.ptp(mem50[finite]) > 100.0 and len(np.unique(np.round(mem50[finite], 3))) > 50
    x = want["features"]
    names = list(FEATURES_V5)
    for name in ("torch_present", "kv_present", "requests_present", "mem_since_step", "mem_long_slope"):
        assert np.abs(x[..., names.index(name)]).max() > 0, name
    assert not want["present"][:, 6].any() and want["present"][:, 0].all()


if __name__ == "__main__":
    np.savez_compressed(GOLDEN, **compute())  # type: ignore[arg-type]  # numpy's stub types **kwds too narrowly
    print(f"wrote {GOLDEN}")
