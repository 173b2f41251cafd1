"""Which forecaster checkpoint the manager serves: one rule for `vgpu serve`, `vgpu demo` and `vgpu doctor`.

- A configured path (`manager.model`, `--model`) is the operator's choice: it must load, or the
  daemon refuses to start and doctor says FAIL.
- Otherwise the default is the shipped model, `vgpu.manager.predictor.DEFAULT_MODEL_PATH`
  (manager/models/default.pt): served when it is there and loads; when it is absent or does not
  load, the baseline forecaster serves (doctor says WARN, the daemon logs it once).

Both serve it the same way, through `open_forecaster`: a `vgpu.manager.predictor.ReloadingForecaster` on
the resolved path with the baseline forecaster as its fallback (the daemon checks the file for a new
checkpoint every `manager.model_check_interval_s`; the demo does not reload).

Resolving a choice imports nothing: the default is `FALLBACK_DEFAULT`, the same path as
`vgpu.manager.predictor.DEFAULT_MODEL_PATH` (a test keeps them equal), so `vgpu serve` resolves it on
its start-up path without importing torch (seconds): the model, and torch with it, load in a background
thread while the socket already serves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vgpu.manager.forecast import Forecaster
    from vgpu.manager.predictor import ReloadingForecaster

MODELS_DIR = Path(__file__).resolve().parent / "models"
FALLBACK_DEFAULT = MODELS_DIR / "default.pt"


@dataclass(frozen=True)
class ModelChoice:
    path: Path
    configured: bool  # the operator named it: it must load

    def describe(self) -> str:
        return f"{self.path} ({'configured' if self.configured else 'default'})"


def default_model_path() -> Path:
    """The shipped forecaster's path, without importing torch (see the module docstring)."""
    return FALLBACK_DEFAULT


def resolve_model(configured: str | Path | None) -> ModelChoice:
    """The checkpoint to serve: the configured one when given (non-empty), else the default."""
    if configured is not None and str(configured).strip():
        return ModelChoice(Path(configured), True)
    return ModelChoice(default_model_path(), False)


def open_forecaster(
    choice: ModelChoice,
    fallback: Forecaster,
    *,
    check_interval_s: float = math.inf,
    device: str | None = None,
) -> ReloadingForecaster:
    """The forecaster that serves `choice`: its checkpoint when it loads (loaded here, in the
    caller's thread), else `fallback`; a new file at the path is hot-loaded in the background at most
    every `check_interval_s` (inf: never). `serving_model` and `last_error` say how the load went;
    whether a failed load is fatal is the caller's rule (a configured model must load). The model runs
    on `predictor.SERVING_THREADS` intra-op threads. Imports torch."""
    from vgpu.manager.predictor import SERVING_THREADS, ReloadingForecaster, load_forecaster  # noqa: PLC0415 - torch

    return ReloadingForecaster(
        choice.path,
        fallback,
        check_interval_s=check_interval_s,
        loader=lambda path: load_forecaster(path, device, threads=SERVING_THREADS),
    )


def describe_serving(forecaster: ReloadingForecaster) -> str:
    """What serves, in words: "model (default.pt)" or "baseline (ewma): the model did not load (...)"."""
    if forecaster.serving_model:
        return f"model ({forecaster.path.name})"
    return f"baseline ({forecaster.name}): the model did not load ({forecaster.last_error})"


__all__ = [
    "FALLBACK_DEFAULT",
    "MODELS_DIR",
    "ModelChoice",
    "default_model_path",
    "describe_serving",
    "open_forecaster",
    "resolve_model",
]
