"""The served forecast is pinned: for a fixed model and fixed histories, the model's forecasts in
every mode and the expert mixture's over successive seconds equal those recorded in
`tests/fixtures/forecast_golden.npz` (1e-5), so a change made for speed cannot change what is
forecast. The file was written by `python tests/test_forecast_golden.py` before those changes; run it
again only for a change meant to alter the forecasts."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.golden_model import golden_checkpoint  # noqa: E402
from vgpu.manager.checkpoint import Checkpoint  # noqa: E402
from vgpu.manager.experts import make_served  # noqa: E402
from vgpu.manager.features import FEATURES_V3  # noqa: E402
from vgpu.manager.forecast import Forecast  # noqa: E402
from vgpu.manager.predictor import ModelForecaster, ReloadingForecaster  # noqa: E402
from vgpu.traces import AppTrace  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "forecast_golden.npz"
TOL = 1e-5
N_APPS = 24
HISTORY_S = 60.0
STEPS = 12
MODES = ("eager", "fused", "onnx")


def _checkpoint() -> Checkpoint:
    # feature version 3 named, not the build's default, so a later default leaves this record valid
    return golden_checkpoint(7, FEATURES_V3, 3, "golden")


def _histories() -> list[AppTrace]:
    """100 ms histories of HISTORY_S + STEPS seconds, with the cases the encoder treats apart: no
    capacity, a gap of seconds, a late start, a column missing, compute only, an empty history."""
    rng = np.random.default_rng(15)
    out = []
    span_s = HISTORY_S + STEPS + 2
    for i in range(N_APPS):
        start = 3.0 * (i == 5) * 20
        t = 1000.0 + start + np.arange(0, span_s - start, 0.1)
        n = len(t)
        ramp = np.clip((t - 1000.0 - 10 * (i % 4)) / 15.0, 0, 1)
        cols = {
            "mem_used_mib": 1000.0 + 300 * i * ramp + rng.normal(0, 8, n),
            "sm_util_pct": np.clip(rng.normal(20 + 50 * ramp, 8, n), 0, 100),
            "mem_total_mib": np.full(n, 40960.0),
            "power_w": rng.uniform(100, 300, n),
            "power_limit_w": np.full(n, 400.0),
        }
        if i == 1:
            del cols["mem_total_mib"]
        if i == 2:
            keep = (t < 1030.0) | (t > 1036.0)
            t = t[keep]
            cols = {k: v[keep] for k, v in cols.items()}
        if i == 3:
            del cols["power_w"]
        if i == 4:
            cols = {"sm_util_pct": cols["sm_util_pct"]}
        if i == 6:
            t, cols = t[:0], {k: v[:0] for k, v in cols.items()}
        out.append(AppTrace(app=f"golden/{i}", t_s=t, columns=cols, gpu="sim0"))
    return out


def _upto(hist: list[AppTrace], end_s: float) -> list[AppTrace]:
    out = []
    for h in hist:
        lo, n = int(np.searchsorted(h.t_s, end_s - HISTORY_S)), int(np.searchsorted(h.t_s, end_s))
        out.append(AppTrace(h.app, h.t_s[lo:n], {k: v[lo:n] for k, v in h.columns.items()}, gpu=h.gpu))
    return out


def _array(fcs: list[Forecast]) -> np.ndarray:
    return np.array([(f.mem_p50_mib, f.mem_p90_mib, f.sm_p50_pct, f.sm_p90_pct) for f in fcs], dtype=np.float64)


def compute(modes: tuple[str, ...] = MODES) -> dict[str, np.ndarray]:
    torch.set_num_threads(1)
    ck = _checkpoint()
    hist = _histories()
    origin = 1000.0 + HISTORY_S
    out: dict[str, np.ndarray] = {}
    for mode in modes:
        model = ModelForecaster(ck, "cpu", mode=mode, threads=1)
        out[f"model_{mode}"] = _array(model.forecast_batch(_upto(hist, origin + 0.55)))
        mixture = make_served(model)
        out[f"mixture_{mode}"] = np.stack(
            [_array(mixture.forecast_batch(_upto(hist, origin + k + 0.55))) for k in range(STEPS)]
        )
    return out


@pytest.mark.parametrize("mode", MODES)
def test_forecasts_equal_the_recorded_ones(mode: str) -> None:
    if mode == "onnx":
        pytest.importorskip("onnxruntime")
    want = np.load(GOLDEN)
    got = compute((mode,))
    for key in (f"model_{mode}", f"mixture_{mode}"):
        ref = want[key]
        assert np.isfinite(ref).sum() > 0.9 * ref.size  # forecasts with something to compare
        np.testing.assert_allclose(got[key], ref, rtol=TOL, atol=TOL, equal_nan=True, err_msg=key)


def test_the_mixture_reads_a_reloading_model_the_same(tmp_path: Path) -> None:
    """The daemon's model slot holds a `ReloadingForecaster`: its arrays are the model's."""
    model = ModelForecaster(_checkpoint(), "cpu", mode="fused", threads=1)
    slot = ReloadingForecaster(tmp_path / "model.pt", loader=lambda _path: model, background=False)
    mixture = make_served(slot)
    hist = _histories()
    got = np.stack([_array(mixture.forecast_batch(_upto(hist, 1000.0 + HISTORY_S + k + 0.55))) for k in range(STEPS)])
    np.testing.assert_allclose(got, np.load(GOLDEN)["mixture_fused"], rtol=TOL, atol=TOL, equal_nan=True)


class _BadArrays:
    """A model expert whose arrays have the wrong shape."""

    name = "model"
    horizons_s = (1, 2, 3, 4, 5)

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        raise AssertionError("not called: the arrays are")

    def forecast_arrays(self, histories: Sequence[AppTrace]) -> np.ndarray:
        return np.zeros((len(histories) + 1, 4, 5))


def test_an_expert_with_arrays_of_the_wrong_shape_abstains() -> None:
    mixture = make_served(_BadArrays())
    hist = _upto(_histories(), 1000.0 + HISTORY_S + 0.55)
    fcs = mixture.forecast_batch(hist)
    assert mixture.expert_failures == 1
    # the last value alone serves: P50 is each history's value in its last second
    last = float(np.mean(hist[0].columns["mem_used_mib"][hist[0].t_s >= np.floor(hist[0].t_s[-1])]))
    assert fcs[0].mem_p50_mib[0] == pytest.approx(last)


def test_the_daemon_serves_the_model_on_one_thread(tmp_path: Path) -> None:
    from vgpu.manager.checkpoint import save_checkpoint
    from vgpu.manager.modelpath import ModelChoice, open_forecaster
    from vgpu.manager.predictor import SERVING_THREADS

    ck = _checkpoint()
    path = tmp_path / "model.pt"
    save_checkpoint(path, ck.model, ck.metadata)
    served = open_forecaster(ModelChoice(path, True), _BadArrays(), device="cpu")
    assert served.serving_model and isinstance(served.current, ModelForecaster)
    assert served.current.threads == SERVING_THREADS == 1


def test_the_recorded_forecasts_move() -> None:
    """The model's forecasts differ from the last value, so the comparison above sees the network."""
    want = np.load(GOLDEN)
    mem50 = want["model_eager"][:, 0]
    finite = np.isfinite(mem50)
    assert np.ptp(mem50[finite]) > 100.0 and len(np.unique(np.round(mem50[finite], 3))) > 20


if __name__ == "__main__":
    np.savez_compressed(GOLDEN, **compute())  # type: ignore[arg-type]  # numpy's stub types **kwds too narrowly
    print(f"wrote {GOLDEN}")
