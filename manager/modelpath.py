"""Which forecaster checkpoint the manager serves: one rule for `vgpu serve`, `vgpu demo` and `vgpu doctor`.

- A configured path (`manager.model`, `--model`) is the operator's choice: it must load, or the
  daemon refuses to start and doctor says FAIL.
- Otherwise the default is the shipped model, `manager.predictor.DEFAULT_MODEL_PATH`
  (manager/models/default.pt): served when it is there and loads; when it is absent or does not
  load, the baseline forecaster serves (doctor says WARN, the daemon logs it once).

Reading `DEFAULT_MODEL_PATH` imports manager.predictor and with it torch, which costs seconds; this
module does so only when a forecaster checkpoint is present in manager/models/ (loading it needs torch
anyway) and otherwise answers with `FALLBACK_DEFAULT`, the same path, without importing anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
FALLBACK_DEFAULT = MODELS_DIR / "default.pt"


@dataclass(frozen=True)
class ModelChoice:
    path: Path
    configured: bool  # the operator named it: it must load

    def describe(self) -> str:
        return f"{self.path} ({'configured' if self.configured else 'default'})"


def _checkpoints(models_dir: Path) -> list[Path]:
    return sorted(p for p in models_dir.glob("*.pt") if not p.name.startswith("coldstart"))


def default_model_path(models_dir: Path = MODELS_DIR) -> Path:
    """The shipped forecaster's path (see the module docstring for when this imports torch)."""
    if not _checkpoints(models_dir):
        return FALLBACK_DEFAULT
    from manager import predictor  # noqa: PLC0415 - torch; only when there is a checkpoint to load

    named = getattr(predictor, "DEFAULT_MODEL_PATH", None)
    return Path(named) if named else FALLBACK_DEFAULT


def resolve_model(configured: str | Path | None, *, models_dir: Path = MODELS_DIR) -> ModelChoice:
    """The checkpoint to serve: the configured one when given (non-empty), else the default."""
    if configured is not None and str(configured).strip():
        return ModelChoice(Path(configured), True)
    return ModelChoice(default_model_path(models_dir), False)


__all__ = ["FALLBACK_DEFAULT", "MODELS_DIR", "ModelChoice", "default_model_path", "resolve_model"]
