"""Tiny valid forecaster checkpoints for tests: written in milliseconds, no training."""

from __future__ import annotations

from pathlib import Path

import torch

from vgpu.manager.checkpoint import Metadata, save_checkpoint
from vgpu.manager.features import FEATURE_VERSION, FeatureSpec
from vgpu.manager.model import ModelConfig, TransformerBiGRU


def write_tiny_checkpoint(
    path: Path, seed: int = 0, shift: float = 0.0, bias: float | None = None, version: int = FEATURE_VERSION
) -> Path:
    """A small Transformer-BiGRU with random weights (by `seed`) and an 8 s window over the feature
    encoding `version`; with `bias`, its P50 change is `bias` (normalised) whatever the input.
    `shift` is the calibrated P90 shift."""
    torch.manual_seed(seed)
    spec = FeatureSpec.for_version(8, version)
    cfg = ModelConfig(n_features=len(spec.features), attn_heads=2, key_channels=8)
    model = TransformerBiGRU(cfg)
    if bias is not None:
        with torch.no_grad():
            model.head_p50.weight.zero_()
            model.head_p50.bias.fill_(bias)
    meta = Metadata(config=cfg, features=spec, p90_shift=((shift,) * 5, (shift,) * 5))
    save_checkpoint(path, model, meta)
    return path
