"""manager/predictor.py: batched forecasts in units, clamped; hot reload; fallback."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoint_synth import write_tiny_checkpoint as _write
from tests.model_synth import ramp_app
from vgpu.manager.checkpoint import CheckpointError
from vgpu.manager.features import encode_latest
from vgpu.manager.forecast import Forecast, Forecaster
from vgpu.manager.predictor import ModelForecaster, ReloadingForecaster, load_forecaster
from vgpu.traces import AppTrace


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


@pytest.mark.parametrize("version", [2, 3])
def test_v2_and_v3_checkpoints_are_each_served_with_their_own_encoding(tmp_path: Path, version: int) -> None:
    """A v2 checkpoint (trained before the v3 context channels) reads v2 windows: its forecasts are
    its network on `encode_latest(..., version=2)`, in every mode."""
    pytest.importorskip("onnxruntime")
    _write(tmp_path / "m.pt", seed=3, version=version)
    apps = [ramp_app(f"a{i}", seconds=20 + 9 * i, seed=i) for i in range(4)]
    win, _ = encode_latest(apps, 8, version)
    with torch.inference_mode():
        raw = load_forecaster(tmp_path / "m.pt", device="cpu", mode="eager").model(torch.from_numpy(win.x)).numpy()
    want = win.last[:, 1, None] + raw[:, 1, :, 0] * win.scales[:, 1, None]  # compute P50, % (no dead band)
    for mode in ("eager", "onnx"):
        f = load_forecaster(tmp_path / "m.pt", device="cpu", mode=mode)
        assert f.feature_version == version and f.n_features == win.x.shape[2] == (19 if version == 2 else 28)
        got = np.array([fc.sm_p50_pct for fc in f.forecast_batch(apps)])
        np.testing.assert_allclose(got, np.clip(want, 0, 100), rtol=1e-4, atol=1e-3)


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


# what a shipped model may be trained on (../shared/data/README.md): these licences, directly or as
# every input of a derived series; TITAN X ("none") and Lucid ("non-commercial") serve evaluation only
PERMITTED_LICENCES = ("MIT", "Apache-2.0", "CC-BY-4.0", "research/study use", "research use")
FORBIDDEN_SOURCES = ("titanx", "titan x", "lucid")


def permitted_data_problems(training: dict[str, object]) -> list[str]:
    """Why a checkpoint's training metadata does not show permitted data only (empty: it does)."""
    problems: list[str] = []
    files = training.get("trace_files")
    licences = training.get("licences")
    if not isinstance(files, list) or not files:
        return ["no trace_files"]
    if not isinstance(licences, list) or not licences:
        return ["no licences"]
    for lic in licences:
        kind = str(lic).split(":", 1)[0].strip()
        if kind != "derived" and kind not in PERMITTED_LICENCES:
            problems.append(f"licence {lic!r} is not permitted")
    real_licences = [str(lic).lower() for lic in licences if not str(lic).startswith("derived:")]
    texts = [str(lic).lower() for lic in licences]
    derived_files: list[str] = []
    for entry in files:
        path = str(entry["path"])
        texts.append(path.lower())
        if entry.get("derived"):
            derived_files.append(path)
            inputs = entry.get("inputs")
            if not entry.get("generator") or not isinstance(inputs, list) or not inputs:
                problems.append(f"derived {path} names no generator or inputs")
                continue
            for inp in inputs:
                texts.append(str(inp.get("path", "")).lower())
                if inp.get("license") not in PERMITTED_LICENCES:
                    problems.append(f"derived {path}: input {inp.get('path')} is {inp.get('license')!r}")
        else:
            # a real trace is named, by its source, in one of the real (non-derived) licence lines
            source = Path(path).name.split(".")[0].split("_")[0].lower()
            if not any(source in lic for lic in real_licences):
                problems.append(f"real {path}: no licence line names {source!r}")
    problems += [f"{word!r} in {text!r}" for text in texts for word in FORBIDDEN_SOURCES if word in text]
    share = training.get("derived_share")
    if derived_files:
        if not isinstance(share, dict):
            problems.append("derived files but no derived_share")
        else:
            by_file = share.get("train_origins_by_file", {})
            derived = sum(int(by_file.get(p, 0)) for p in derived_files)
            if derived != share.get("derived_origins") or not derived:
                problems.append(f"derived_origins {share.get('derived_origins')} is not the derived files' {derived}")
    return problems


def test_the_shipped_model_loads_and_names_only_permitted_data() -> None:
    from vgpu.manager.predictor import DEFAULT_MODEL_PATH

    f = load_forecaster(DEFAULT_MODEL_PATH, device="cpu")
    training = f.checkpoint.metadata.training
    assert permitted_data_problems(training) == []
    assert training["apps"]["test"] > 0  # the test split was left out, not absent
    assert "vgpu train" in training["command"]
    out = f.forecast_batch([ramp_app("a", seconds=30)])[0]
    assert 0 <= out.sm_p50_pct[4] <= out.sm_p90_pct[4] <= 100


def _metadata(**change: object) -> dict[str, object]:
    base: dict[str, object] = {
        "licences": ["MIT: MIGPerf (migperf-a100-mig), real", "derived: serving from Azure (CC-BY-4.0)"],
        "trace_files": [
            {"path": "runs/migperf.csv.gz", "derived": False},
            {"path": "runs/serving.csv.gz", "derived": True, "generator": "vgpu.offline.synth_serving v1",
             "inputs": [{"path": "llm-serving-requests/azure", "license": "CC-BY-4.0"}]},
        ],
        "derived_share": {"derived_origins": 5, "train_origins_by_file": {"runs/migperf.csv.gz": 9,
                                                                          "runs/serving.csv.gz": 5}},
    }
    return base | change


def _titanx_real() -> dict[str, object]:
    m = _metadata()
    m["licences"] = [*m["licences"], "none: TITAN X traces"]  # type: ignore[misc]
    m["trace_files"] = [*m["trace_files"], {"path": "runs/titanx.csv.gz", "derived": False}]  # type: ignore[misc]
    return m


def _derived_input(path: str, licence: str) -> dict[str, object]:
    m = _metadata()
    entry = dict(m["trace_files"][1])  # type: ignore[index]
    entry["inputs"] = [*entry["inputs"], {"path": path, "license": licence}]
    m["trace_files"] = [m["trace_files"][0], entry]  # type: ignore[index]
    return m


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        (_titanx_real(), "none: TITAN X"),
        (_derived_input("titanx-100ms-training-traces", "MIT"), "titanx"),
        (_derived_input("lucid-dl-job-profiles", "non-commercial"), "lucid"),
        (_derived_input("somewhere/else", "GPL-3.0"), "GPL-3.0"),
        (_derived_input("somewhere/else", ""), "somewhere/else"),
        (_metadata(licences=["MIT: MIGPerf", "derived: x", "proprietary: y"]), "proprietary"),
        (_metadata(trace_files=[{"path": "runs/other.csv.gz", "derived": False}]), "other"),
        (_metadata(trace_files=[{"path": "runs/s.csv.gz", "derived": True, "inputs": []}]), "generator"),
        (_metadata(derived_share=None), "derived_share"),
        (_metadata(derived_share={"derived_origins": 0, "train_origins_by_file": {}}), "derived_origins"),
        (_metadata(trace_files=[]), "trace_files"),
    ],
    ids=["titanx-real", "titanx-input", "lucid-input", "gpl-input", "no-licence-input", "unknown-licence",
         "unlicensed-real", "no-generator", "no-share", "share-wrong", "no-files"],
)
def test_the_permitted_data_check_fails_for_anything_else(metadata: dict[str, object], problem: str) -> None:
    assert permitted_data_problems(_metadata()) == []  # the base is fine
    problems = permitted_data_problems(metadata)
    assert problems and any(problem in p for p in problems), problems


def test_a_loader_that_raises_anything_is_logged_counted_and_the_old_model_serves(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    path = tmp_path / "m.pt"
    _write(path)
    def broken(p: Path) -> Forecaster:
        raise RuntimeError("CUDA out of memory")

    loaders: list[Callable[[Path], Forecaster]] = [lambda p: load_forecaster(p, device="cpu")]
    clock = _Clock()
    holder = ReloadingForecaster(path, _Fallback(), check_interval_s=1, clock=clock, background=True,
                                 loader=lambda p: loaders[-1](p))
    old = holder.current
    loaders.append(broken)  # the next file fails with something other than CheckpointError
    _touch_new(path, seed=5)
    clock.now = 2.0
    with capture_logs() as logs:
        holder.forecast_batch([])
        holder.wait_idle()
    assert holder.current is old and holder.reload_failures == 1 and holder.reloads == 0
    assert holder.last_error == "RuntimeError: CUDA out of memory"
    (event,) = [e for e in logs if e["event"] == "forecaster_reload_failed"]
    assert event["model"] == "model" and event["path"] == str(path)
    loaders.pop()
    _touch_new(path, seed=6)
    clock.now = 4.0
    with capture_logs() as logs:
        holder.forecast_batch([])
        holder.wait_idle()
    assert holder.current is not old and holder.reloads == 1
    (event,) = [e for e in logs if e["event"] == "forecaster_reloaded"]
    assert event["model"] == "model" and event["reloads"] == 1


def test_the_daemons_start_up_resolves_the_default_model_without_importing_torch() -> None:
    """`vgpu serve` resolves the forecaster on its start-up path and loads the shipped one in a
    background thread: resolving it must not import torch (seconds), or the socket waits for it. The
    path it resolves is the one the predictor names."""
    from vgpu.manager.predictor import DEFAULT_MODEL_PATH

    code = ("import sys\n"
            "from vgpu.daemon.serve import load_model\n"
            "from vgpu.manager.modelpath import resolve_model\n"
            "assert load_model('') is None\n"
            "choice = resolve_model('')\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print(choice.configured, choice.path)\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(DEFAULT_MODEL_PATH)]


def test_daemon_and_demo_serve_through_the_same_construction(tmp_path: Path) -> None:
    """vgpu.manager.modelpath.open_forecaster: the configured/default rule with the baseline fallback."""
    from vgpu.daemon.serve import StartupError, load_model
    from vgpu.manager.modelpath import ModelChoice, describe_serving, open_forecaster

    good = tmp_path / "good.pt"
    _write(good)
    served = open_forecaster(ModelChoice(good, False), _Fallback(), device="cpu")
    assert isinstance(served, ReloadingForecaster) and served.serving_model
    assert describe_serving(served) == "model (good.pt)"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    degraded = open_forecaster(ModelChoice(bad, False), _Fallback())
    assert not degraded.serving_model and degraded.name == "last_value"
    assert describe_serving(degraded).startswith("baseline (last_value): the model did not load") and "bad.pt" in describe_serving(degraded)
    # the daemon's configured model is the same object kind, and refuses to start on a bad file
    daemon_model = load_model(str(good), fallback=_Fallback(), check_interval_s=0.5)
    assert isinstance(daemon_model, ReloadingForecaster) and daemon_model.serving_model
    with pytest.raises(StartupError, match=r"manager.model .*bad.pt"):
        load_model(str(bad), fallback=_Fallback())
