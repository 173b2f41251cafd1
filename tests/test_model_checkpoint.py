"""manager/checkpoint.py: round trip, and every way a file is refused (CheckpointError naming it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from vgpu.manager.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    Metadata,
    load_checkpoint,
    save_checkpoint,
)
from vgpu.manager.features import FEATURES_V2, FEATURES_V3, N_FEATURES, FeatureSpec
from vgpu.manager.model import ModelConfig, TransformerBiGRU


def _small(order: str = "attn_first") -> tuple[TransformerBiGRU, Metadata]:
    torch.manual_seed(0)
    cfg = ModelConfig(n_features=N_FEATURES, attn_heads=2, key_channels=8, order=order)  # type: ignore[arg-type]
    meta = Metadata(
        config=cfg,
        features=FeatureSpec(window_s=8),
        p90_shift=((0.1,) * 5, (0.2,) * 5),
        training={"trace_files": [{"path": "x.csv"}], "licences": ["MIT"]},
        validation={"loss": 0.5},
        git_commit=None,
    )
    return TransformerBiGRU(cfg), meta


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, meta = _small()
    path = tmp_path / "m.pt"
    save_checkpoint(path, model, meta)
    return path


def test_round_trip_keeps_weights_and_metadata(saved: Path) -> None:
    model, meta = _small()
    ck = load_checkpoint(saved)
    assert ck.metadata == meta
    for k, v in model.state_dict().items():
        assert torch.equal(ck.model.state_dict()[k], v)
    assert not ck.model.training
    side = json.loads(saved.with_name("m.pt.json").read_text())
    assert side["training"]["licences"] == ["MIT"] and side["format_version"] == FORMAT_VERSION


def _raw(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _rewrite(path: Path, **changes: object) -> None:
    payload = _raw(path)
    payload.update(changes)
    torch.save(payload, path)


def _meta_edit(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    payload = _raw(path)
    data = json.loads(payload["metadata"])
    edit(data)
    payload["metadata"] = json.dumps(data)
    torch.save(payload, path)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.unlink(), "no such file"),
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "cannot read"),
        (lambda p: p.write_bytes(b"\x00garbage" * 100), "cannot read"),
        (lambda p: p.write_bytes(b""), "cannot read"),
        (lambda p: torch.save({"hello": 1}, p), "not a vgpu-forecaster"),
        (lambda p: torch.save([1, 2, 3], p), "not a vgpu-forecaster"),
        (lambda p: _rewrite(p, format_version=99), "format version 99"),
        (lambda p: _rewrite(p, metadata="{not json"), "bad metadata"),
        (lambda p: _rewrite(p, state_dict=None), "weights missing"),
        (
            lambda p: _meta_edit(p, lambda d: d["config"].update(gru_backward_units=12)),
            "weights do not match",
        ),
        (lambda p: _meta_edit(p, lambda d: d["config"].update(order="sideways")), "bad config"),
        (lambda p: _meta_edit(p, lambda d: d["features"].update(version=0)), "feature encoding v0"),
        (lambda p: _meta_edit(p, lambda d: d["features"].update(version=4)), "cannot produce"),
        (  # v3 by its version, v2's feature list: neither encoding
            lambda p: _meta_edit(p, lambda d: d["features"].update(features=list(FEATURES_V2))),
            "feature encoding v3",
        ),
        (  # a feature renamed
            lambda p: _meta_edit(p, lambda d: d["features"]["features"].__setitem__(-1, "sm_ctx_median")),
            "it encodes v2 (19 features), v3 (28 features)",
        ),
        (lambda p: _meta_edit(p, lambda d: d.update(p90_shift=[[0.0]])), "p90_shift"),
        (lambda p: _meta_edit(p, lambda d: d["features"].update(window_s=1000)), "exceeds max_len"),
    ],
    ids=[
        "missing",
        "truncated",
        "garbage",
        "empty",
        "other-dict",
        "not-a-dict",
        "wrong-version",
        "bad-json",
        "no-weights",
        "config-mismatch",
        "bad-order",
        "feature-version",
        "feature-version-4",
        "v3-with-v2-features",
        "feature-renamed",
        "shift-shape",
        "window-too-long",
    ],
)
def test_refused_with_a_clear_error(saved: Path, damage: Callable[[Path], object], message: str) -> None:
    damage(saved)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(saved)
    assert message in str(info.value)
    assert info.value.path == str(saved) and str(saved) in str(info.value)


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("code ran",))


def test_pickled_code_is_not_executed(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, "x": _Evil()}, saved)
    with pytest.raises(CheckpointError, match="cannot read") as refused:
        load_checkpoint(saved)
    assert "code ran" not in capsys.readouterr().out
    # said as what it is: torch's own text goes on to suggest weights_only=False, never to be followed here
    assert "torch's safe loader refused it" in str(refused.value) and "weights_only" not in str(refused.value)


def test_save_refuses_metadata_of_another_model(tmp_path: Path) -> None:
    model, meta = _small()
    other = replace(meta, config=replace(meta.config, order="gru_first"))
    with pytest.raises(ValueError, match="config"):
        save_checkpoint(tmp_path / "m.pt", model, other)
    assert not (tmp_path / "m.pt").exists()


def test_save_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    model, meta = _small()
    save_checkpoint(tmp_path / "m.pt", model, meta)
    save_checkpoint(tmp_path / "m.pt", model, meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "m.pt.json"]


@pytest.mark.parametrize("version", [2, 3])
def test_each_feature_encoding_loads_with_its_own_spec(tmp_path: Path, version: int) -> None:
    """v2 checkpoints (the encoding before the context channels) still load beside v3 ones."""
    spec = FeatureSpec.for_version(8, version)
    torch.manual_seed(0)
    cfg = ModelConfig(n_features=len(spec.features), attn_heads=2, key_channels=8)
    save_checkpoint(tmp_path / "m.pt", TransformerBiGRU(cfg), Metadata(config=cfg, features=spec))
    ck = load_checkpoint(tmp_path / "m.pt")
    assert ck.metadata.features == spec
    assert ck.metadata.features.features == (FEATURES_V2 if version == 2 else FEATURES_V3)
    assert ck.model.config.n_features == (19 if version == 2 else 28)
