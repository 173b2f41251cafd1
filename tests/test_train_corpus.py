"""`vgpu train` on a corpus of real and derived traces: the v5 encoding and the derived share in the
checkpoint's metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.model_synth import ids_in, population, ramp_app
from vgpu.manager.checkpoint import load_checkpoint
from vgpu.manager.features import FEATURES_V5
from vgpu.manager.predictor import load_forecaster
from vgpu.offline import train as T
from vgpu.traces import write_trace


def test_v5_on_real_and_derived_traces_records_the_derived_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = tmp_path / "real.csv.gz"
    derived = tmp_path / "derived.csv.gz"
    write_trace(real, population(train=4, val=2, test=1, seconds=30))
    names = ids_in("train", 3, prefix="derived/app")
    write_trace(
        derived,
        [ramp_app(n, seconds=50, seed=40 + i) for i, n in enumerate(names)],
        metadata={"generator": "test generator v1", "inputs": [{"path": "x", "license": "MIT"}]},
    )
    out = tmp_path / "m.pt"
    args = ["--trace", str(real), "--trace", str(derived), "--out", str(out), "--epochs", "1",
            "--window", "8", "--stride", "2", "--feature-version", "5", "--quiet"]
    assert T.main(args, "vgpu train") == 0
    capsys.readouterr()
    meta = load_checkpoint(out).metadata
    assert meta.features.version == 5 and meta.features.features == FEATURES_V5
    files = {f["path"]: f for f in meta.training["trace_files"]}
    assert files[str(real)]["derived"] is False and "generator" not in files[str(real)]
    assert files[str(derived)]["derived"] is True and files[str(derived)]["generator"] == "test generator v1"
    assert files[str(derived)]["inputs"] == [{"path": "x", "license": "MIT"}]
    assert "app_ids" not in files[str(real)]  # used for the count, not stored
    share = meta.training["derived_share"]
    by_file = share["train_origins_by_file"]
    assert by_file[str(derived)] == 3 * len(range(T.MIN_HISTORY_S, 50, 2))
    assert by_file[str(real)] == 4 * len(range(T.MIN_HISTORY_S, 30, 2))
    assert share["derived_fraction"] == pytest.approx(by_file[str(derived)] / sum(by_file.values()), abs=1e-4)
    json.dumps(meta.training)  # the metadata stays JSON
    fc = load_forecaster(out, device="cpu").forecast_batch([ramp_app("a", seconds=150)])
    assert len(fc) == 1 and np.isfinite(fc[0].mem_p90_mib).all()
