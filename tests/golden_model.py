"""The seeded model the golden-forecast tests pin (`tests/test_forecast_golden*.py`): a fresh
Transformer-BiGRU for one feature version with its P50 head given weights (it starts at zero), so
its forecasts move, and a fixed P90 shift and dead band."""

from __future__ import annotations

import torch

from vgpu.manager.checkpoint import Checkpoint, Metadata
from vgpu.manager.features import FeatureSpec
from vgpu.manager.model import ModelConfig, TransformerBiGRU


def golden_checkpoint(seed: int, features: tuple[str, ...], version: int, name: str) -> Checkpoint:
    """The same weights for the same arguments on every run: the records depend on it."""
    torch.manual_seed(seed)
    model = TransformerBiGRU(ModelConfig(n_features=len(features), order="gru_first"))
    with torch.no_grad():
        model.head_p50.weight.normal_(0, 0.3)
        model.head_p50.bias.normal_(0, 0.3)
    shift = ((0.1, 0.2, 0.3, 0.4, 0.5), (0.5, 0.4, 0.3, 0.2, 0.1))
    band = ((0.05,) * 5, (0.01,) * 5)
    spec = FeatureSpec(16, features=features, version=version)
    meta = Metadata(config=model.config, features=spec, p90_shift=shift, p50_deadband=band)
    return Checkpoint(model.eval(), meta, name)
