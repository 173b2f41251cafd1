"""vgpu/offline/train.py: `vgpu train` end to end on tiny synthetic traces, determinism, calibration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.daemon_fixtures import ROOT
from tests.model_synth import population
from vgpu.manager.checkpoint import load_checkpoint
from vgpu.manager.features import FEATURES_V2, N_FEATURES, FeatureSpec
from vgpu.manager.model import ModelConfig
from vgpu.manager.predictor import load_forecaster
from vgpu.offline import train as T
from vgpu.traces import write_trace

TINY = ModelConfig(n_features=N_FEATURES, attn_heads=2, key_channels=8)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "synth.csv.gz"
    write_trace(path, population(train=5, val=2, test=2, seconds=30))
    return path


def _datasets(window: int = 8) -> tuple[T.Dataset, T.Dataset]:
    apps = population(train=4, val=2, test=0, seconds=30)
    spec = FeatureSpec(window_s=window)
    return T.build_dataset(apps[:4], spec, stride=2), T.build_dataset(apps[4:], spec)


def test_cli_trains_and_writes_a_loadable_checkpoint(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.pt"
    rc = T.main(
        [
            "--trace",
            str(trace_file),
            "--out",
            str(out),
            "--epochs",
            "2",
            "--window",
            "8",
            "--quiet",
            "--licence",
            "test-only",
        ],
        "vgpu train",
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["epochs_run"] == 2
    ck = load_checkpoint(out)
    meta = ck.metadata
    assert meta.features.window_s == 8 and meta.config.order == "gru_first"
    # the default encoding is the shipped model's, so a retrained model encodes like the one served
    shipped = json.loads((ROOT / "manager" / "models" / "default.pt.json").read_text())["features"]["version"]
    assert meta.features.version == shipped == 5 and meta.config.n_features == len(meta.features.features) == 48
    assert meta.training["apps"] == {"train": 5, "val": 2, "test": 2}
    assert meta.training["licences"] == ["test-only"]
    assert meta.training["trace_files"][0]["path"] == str(trace_file)
    assert meta.training["recipe"]["lr"] == 0.001 and meta.training["recipe"]["batch"] == 256
    assert "mem_used_mib/h5" in meta.validation["metrics"]
    # the test split is never read: the windows come from the train split alone
    train_apps = population(train=5, val=2, test=2, seconds=30)[:5]
    assert meta.training["windows"]["train"] == len(T.build_dataset(train_apps, meta.features))
    fc = load_forecaster(out, device="cpu").forecast_batch(train_apps[:2])
    assert len(fc) == 2 and all(np.isfinite(fc[0].mem_p50_mib))


def test_cli_trains_the_previous_feature_encoding_on_request(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "v2.pt"
    args = ["--trace", str(trace_file), "--out", str(out), "--epochs", "1", "--window", "8", "--quiet"]
    assert T.main([*args, "--feature-version", "2"], "vgpu train") == 0
    ck = load_checkpoint(out)
    assert ck.metadata.features.version == 2 and ck.metadata.features.features == FEATURES_V2
    assert ck.model.config.n_features == len(FEATURES_V2)
    assert "--feature-version 2" in ck.metadata.training["command"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        T.main([*args, "--feature-version", "6"], "vgpu train")
    assert "invalid choice" in capsys.readouterr().err


def test_same_data_and_seed_give_the_same_weights() -> None:
    tr, va = _datasets()
    recipe = T.Recipe(epochs=2, batch=32, seed=7)
    a, _ = T.train_model(tr, va, TINY, recipe, progress=False)
    b, _ = T.train_model(tr, va, TINY, recipe, progress=False)
    c, _ = T.train_model(tr, va, TINY, T.Recipe(epochs=2, batch=32, seed=8), progress=False)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_training_lowers_the_validation_loss_and_early_stopping_keeps_the_best() -> None:
    tr, va = _datasets()
    recipe = T.Recipe(epochs=6, batch=32, lr=0.003, patience=2)
    model, hist = T.train_model(tr, va, TINY, recipe, progress=False)
    losses = [h["val_loss"] for h in hist["history"]]
    assert hist["best_val_loss"] == min(losses)
    assert hist["epochs_run"] <= 6
    assert T._masked_pinball(T._predict(model, va.x, torch.device("cpu")), va) == pytest.approx(
        min(losses), rel=1e-4
    )


def test_calibration_reaches_the_level_on_its_own_data() -> None:
    tr, va = _datasets()
    model, _ = T.train_model(tr, va, TINY, T.Recipe(epochs=1, batch=32), progress=False)
    pred = T._predict(model, va.x, torch.device("cpu"))
    shift = T.calibrate_p90(pred, va)
    m = T.metrics(pred, shift, va, (1, 2, 3, 4, 5))
    for key, row in m.items():
        assert row["coverage_p90"] >= 0.9 - 1e-9, key
    zero = T.metrics(pred, np.full_like(shift, -1e3), va, (1, 2, 3, 4, 5))
    assert all(row["coverage_p90"] < 0.9 for row in zero.values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--window", "1"], "window_s must be at least 2"),
    ],
)
def test_bad_options_fail_cleanly(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    rc = T.main(
        ["--trace", str(trace_file), "--out", str(tmp_path / "m.pt"), "--quiet", *extra], "vgpu train"
    )
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()


def test_missing_trace_and_duplicate_apps_fail_cleanly(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert T.main(["--trace", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "m.pt")], "vgpu train") == 2
    assert "no such file" in capsys.readouterr().err
    rc = T.main(
        ["--trace", str(trace_file), "--trace", str(trace_file), "--out", str(tmp_path / "m.pt")],
        "vgpu train",
    )
    assert rc == 2 and "also appears" in capsys.readouterr().err


def test_no_validation_apps_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "train_only.csv"
    write_trace(path, population(train=3, val=0, test=0, seconds=20))
    assert T.main(["--trace", str(path), "--out", str(tmp_path / "m.pt"), "--quiet"], "vgpu train") == 2
    assert "val splits" in capsys.readouterr().err


def test_deadband_zeroes_small_changes_and_never_worsens_validation_mae() -> None:
    rng = np.random.default_rng(0)
    n = 400
    y = np.zeros((n, 2, 5), np.float32)
    y[:20] = 5.0  # a few real jumps, the rest flat
    pred = np.zeros((n, 2, 5, 2), np.float32)
    pred[..., 0] = rng.normal(0, 0.05, (n, 2, 5))  # noise around no change
    pred[:20, ..., 0] = 4.0
    pred[..., 1] = pred[..., 0] + 1.0
    data = T.Dataset(
        x=np.zeros((n, 4, N_FEATURES), np.float32),
        y=y,
        mask=np.ones(y.shape, bool),
        scales=np.ones((n, 2)),
        last=np.zeros((n, 2)),
        caps=np.full((n, 2), np.inf),
        apps=1,
    )
    band = T.choose_deadband(pred, data)
    assert np.all(band > 0.05) and np.all(band <= 4.0)
    from vgpu.manager.predictor import apply_deadband

    out = apply_deadband(pred, band)
    assert np.all(out[20:, ..., 0] == 0) and np.all(out[:20, ..., 0] == 4.0)
    assert np.allclose(out[20:, ..., 1] - out[20:, ..., 0], 1.0)  # the P90 moves with the median
    before = np.abs(pred[..., 0] - y).mean()
    assert np.abs(out[..., 0] - y).mean() < before


def test_time_budget_stops_after_the_epoch_that_passes_it() -> None:
    tr, va = _datasets()
    ticks = iter(range(0, 10_000, 100))  # each clock read advances 100 s
    model, hist = T.train_model(
        tr,
        va,
        TINY,
        T.Recipe(epochs=50, batch=64),
        progress=False,
        max_seconds=150,
        clock=lambda: next(ticks),
    )
    assert hist["stopped"] == "time budget" and hist["epochs_run"] == 2
