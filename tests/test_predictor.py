"""manager/predictor.py: batched forecasts in units, clamped; hot reload; fallback."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from manager.checkpoint import CheckpointError, Metadata, save_checkpoint
from manager.features import N_FEATURES, FeatureSpec
from manager.forecast import Forecast, Forecaster
from manager.model import ModelConfig, TransformerBiGRU
from manager.predictor import ModelForecaster, ReloadingForecaster, load_forecaster
from tests.model_synth import ramp_app
from vgpu.traces import AppTrace


def _write(path: Path, seed: int = 0, shift: float = 0.0, bias: float | None = None) -> None:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_features=N_FEATURES, attn_heads=2, key_channels=8)
    model = TransformerBiGRU(cfg)
    if bias is not None:  # a model whose P50 change is `bias` (normalised) whatever the input
        with torch.no_grad():
            model.head_p50.weight.zero_()
            model.head_p50.bias.fill_(bias)
    meta = Metadata(config=cfg, features=FeatureSpec(window_s=8), p90_shift=((shift,) * 5, (shift,) * 5))
    save_checkpoint(path, model, meta)


class _Fallback:
    name = "last_value"

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        nan = (math.nan,) * 5
        return [Forecast((1, 2, 3, 4, 5), nan, nan, nan, nan, source=self.name) for _ in histories]


def test_forecasts_are_in_units_ordered_and_clamped(tmp_path: Path) -> None:
    _write(tmp_path / "m.pt")
    f = load_forecaster(tmp_path / "m.pt", device="cpu")
    assert isinstance(f, Forecaster) and f.name == "model"
    apps = [ramp_app(f"a{i}", seconds=20 + i, seed=i) for i in range(5)]
    out = f.forecast_batch(apps)
    assert len(out) == 5
    for fc in out:
        assert fc.horizons_s == (1, 2, 3, 4, 5) and fc.source == "model"
        for p50, p90 in ((fc.mem_p50_mib, fc.mem_p90_mib), (fc.sm_p50_pct, fc.sm_p90_pct)):
            assert all(a <= b for a, b in zip(p50, p90, strict=True))
        assert all(0 <= v <= 10240 for v in fc.mem_p90_mib + fc.mem_p50_mib)
        assert all(0 <= v <= 100 for v in fc.sm_p90_pct + fc.sm_p50_pct)
    # batched equals one by one
    single = f.forecast_batch([apps[3]])[0]
    np.testing.assert_allclose(single.mem_p50_mib, out[3].mem_p50_mib, rtol=1e-4)


def test_large_predicted_change_is_clamped_to_capacity(tmp_path: Path) -> None:
    _write(tmp_path / "up.pt", bias=500.0)
    _write(tmp_path / "down.pt", bias=-500.0)
    app = ramp_app("a", seconds=30)
    up = load_forecaster(tmp_path / "up.pt", device="cpu").forecast_batch([app])[0]
    down = load_forecaster(tmp_path / "down.pt", device="cpu").forecast_batch([app])[0]
    assert up.mem_p50_mib == (10240.0,) * 5 and up.sm_p90_pct == (100.0,) * 5
    assert down.mem_p50_mib == (0.0,) * 5 and down.sm_p50_pct == (0.0,) * 5


def test_calibration_shift_raises_p90(tmp_path: Path) -> None:
    _write(tmp_path / "a.pt", shift=0.0)
    _write(tmp_path / "b.pt", shift=5.0)
    app = ramp_app("a", seconds=30)
    a = load_forecaster(tmp_path / "a.pt", device="cpu").forecast_batch([app])[0]
    b = load_forecaster(tmp_path / "b.pt", device="cpu").forecast_batch([app])[0]
    assert a.mem_p50_mib == b.mem_p50_mib
    assert all(
        y >= x + 0.05 * 10240 - 1e-3 or y == 10240 for x, y in zip(a.mem_p90_mib, b.mem_p90_mib, strict=True)
    )


def test_unknown_targets_are_nan(tmp_path: Path) -> None:
    _write(tmp_path / "m.pt")
    f = load_forecaster(tmp_path / "m.pt", device="cpu")
    only_sm = AppTrace(app="s", t_s=np.arange(10.0), columns={"sm_util_pct": np.full(10, 50.0)})
    empty = AppTrace(app="e", t_s=np.zeros(0), columns={"sm_util_pct": np.zeros(0)})
    fs, fe = f.forecast_batch([only_sm, empty])
    assert all(math.isnan(v) for v in fs.mem_p50_mib) and not any(math.isnan(v) for v in fs.sm_p50_pct)
    assert all(math.isnan(v) for v in fe.sm_p90_pct + fe.mem_p90_mib)
    assert f.forecast_batch([]) == []


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _touch_new(path: Path, seed: int) -> None:
    before = os.stat(path).st_mtime_ns if path.exists() else 0
    _write(path, seed=seed)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # mtime moves even on a coarse clock


@pytest.mark.parametrize("background", [False, True])
def test_hot_reload_swaps_to_a_new_checkpoint(tmp_path: Path, background: bool) -> None:
    path = tmp_path / "m.pt"
    _write(path, seed=0)
    clock = _Clock()
    holder = ReloadingForecaster(path, _Fallback(), check_interval_s=5, clock=clock, background=background)
    app = [ramp_app("a", seconds=30)]
    first = holder.forecast_batch(app)[0]
    old = holder.current
    _touch_new(path, seed=1)
    clock.now = 4.0  # not yet time to look
    assert holder.forecast_batch(app)[0] == first and holder.current is old
    clock.now = 6.0
    holder.forecast_batch(app)  # starts (or does) the load; this call may still use the old model
    holder.wait_idle()
    assert holder.current is not old and holder.reloads == 1
    assert holder.forecast_batch(app)[0] != first


def test_corrupt_new_file_keeps_the_old_model(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    _write(path)
    clock = _Clock()
    holder = ReloadingForecaster(path, _Fallback(), check_interval_s=1, clock=clock, background=False)
    old = holder.current
    path.write_bytes(b"half a checkpoint")
    clock.now = 2.0
    out = holder.forecast_batch([ramp_app("a", seconds=20)])
    assert holder.current is old and out[0].source == "model"
    assert holder.last_error is not None and "cannot read" in holder.last_error
    # a good file afterwards is picked up
    _touch_new(path, seed=3)
    clock.now = 4.0
    holder.forecast_batch([])
    assert holder.current is not old and holder.last_error is None


def test_falls_back_when_nothing_loads_and_recovers(tmp_path: Path) -> None:
    path = tmp_path / "absent.pt"
    clock = _Clock()
    fallback = _Fallback()
    holder = ReloadingForecaster(path, fallback, check_interval_s=1, clock=clock, background=False)
    assert holder.current is fallback and not holder.serving_model and holder.name == "last_value"
    assert holder.forecast_batch([ramp_app("a", seconds=10)])[0].source == "last_value"
    _touch_new(path, seed=0)
    clock.now = 2.0
    holder.forecast_batch([])
    assert holder.serving_model and isinstance(holder.current, ModelForecaster) and holder.name == "model"


def test_no_fallback_means_the_start_error_is_raised(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"nope")
    with pytest.raises(CheckpointError, match="bad.pt"):
        ReloadingForecaster(bad, None)


def test_failed_file_is_not_retried_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    path.write_bytes(b"junk")
    calls: list[Path] = []

    def loader(p: Path) -> Forecaster:
        calls.append(p)
        raise CheckpointError(p, "junk")

    clock = _Clock()
    ReloadingForecaster(path, _Fallback(), check_interval_s=1, clock=clock, loader=loader, background=False)
    holder = ReloadingForecaster(
        path, _Fallback(), check_interval_s=1, clock=clock, loader=loader, background=False
    )
    for t in (2.0, 3.0, 4.0):
        clock.now = t
        holder.forecast_batch([])
    assert len(calls) == 2  # one per construction, none for the unchanged file


def test_the_shipped_model_loads_and_names_only_permitted_data() -> None:
    from manager.predictor import DEFAULT_MODEL_PATH

    f = load_forecaster(DEFAULT_MODEL_PATH, device="cpu")
    training = f.checkpoint.metadata.training
    paths = [e["path"] for e in training["trace_files"]]
    assert paths and all("migperf" in p for p in paths)
    assert not any(word in p.lower() for p in paths for word in ("titanx", "lucid", "alibaba"))
    assert any("MIT" in lic for lic in training["licences"])
    assert training["apps"]["test"] > 0  # the test split was left out, not absent
    out = f.forecast_batch([ramp_app("a", seconds=30)])[0]
    assert 0 <= out.sm_p50_pct[4] <= out.sm_p90_pct[4] <= 100
