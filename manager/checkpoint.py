"""The forecaster's checkpoint: weights plus JSON metadata in one file.

Layout (a `torch.save` of a plain dict, so `torch.load(weights_only=True)` reads it without
unpickling code):

    {"format": "vgpu-forecaster", "format_version": 1,
     "metadata": "<JSON text>",            # see `Metadata`
     "state_dict": {name: tensor, ...}}

The metadata holds the `ModelConfig`, the `FeatureSpec` (window, feature names, horizons), the
calibration (a P90 shift and a P50 dead band per target and horizon, in normalised units), the training data
(trace files, application counts per split, licences), validation metrics and the git commit.
A file that is missing, truncated, corrupt, of another format or version, or whose weights do not
fit its configuration is refused with a `CheckpointError` naming the file and the problem. Any
feature encoding this build can produce (`vgpu.manager.features.FEATURES_BY_VERSION`: v2 and v3) loads,
and is served with that encoding; one whose version or feature list it cannot produce is refused.

Files are written atomically (a temporary file in the same folder, then `os.replace`), so a
watcher never sees half a checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vgpu.manager.features import FEATURES_BY_VERSION, FeatureSpec
from vgpu.manager.model import ModelConfig, TransformerBiGRU

FORMAT = "vgpu-forecaster"
FORMAT_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint cannot be used. `path` names the file, `problem` says why."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True)
class Metadata:
    config: ModelConfig
    features: FeatureSpec
    # P90 shift per target and horizon (normalised units), added to the network's P90
    p90_shift: tuple[tuple[float, ...], ...] = ((0.0,) * 5, (0.0,) * 5)
    # P50 changes smaller than this (normalised units) are read as "no change", per target and
    # horizon; chosen on the validation split (see vgpu.offline.train.choose_deadband)
    p50_deadband: tuple[tuple[float, ...], ...] = ((0.0,) * 5, (0.0,) * 5)
    training: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)
    git_commit: str | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": self.format_version,
                "config": self.config.to_dict(),
                "features": self.features.to_dict(),
                "p90_shift": [list(row) for row in self.p90_shift],
                "p50_deadband": [list(row) for row in self.p50_deadband],
                "training": self.training,
                "validation": self.validation,
                "git_commit": self.git_commit,
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Metadata:
        data = json.loads(text)
        return cls(
            config=ModelConfig.from_dict(data["config"]),
            features=FeatureSpec.from_dict(data["features"]),
            p90_shift=tuple(tuple(float(v) for v in row) for row in data["p90_shift"]),
            p50_deadband=tuple(
                tuple(float(v) for v in row)
                for row in data.get("p50_deadband") or [[0.0] * len(r) for r in data["p90_shift"]]
            ),
            training=dict(data.get("training") or {}),
            validation=dict(data.get("validation") or {}),
            git_commit=data.get("git_commit"),
            format_version=int(data["format_version"]),
        )


@dataclass(frozen=True)
class Checkpoint:
    model: TransformerBiGRU
    metadata: Metadata
    path: str


def git_commit(cwd: str | Path | None = None) -> str | None:
    """The current commit of the repository around `cwd`, or None where git or a repository is absent."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def save_checkpoint(path: str | Path, model: TransformerBiGRU, metadata: Metadata) -> None:
    """Write the checkpoint atomically; also writes `<path>.json` with the metadata for people to
    read (the loader uses the copy inside the checkpoint)."""
    path = Path(path)
    if model.config != metadata.config:
        raise ValueError("the metadata's config is not the model's")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "format_version": metadata.format_version,
        "metadata": metadata.to_json(),
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(payload, tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a checkpoint is not a secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    side = path.with_name(path.name + ".json")
    side.write_text(metadata.to_json() + "\n", encoding="utf-8")


def _first_line(exc: Exception) -> str:
    """What torch said, in a line an operator can act on. torch's refusal of what its safe loader will
    not unpickle goes on to suggest loading with weights_only=False, which must never be done with a
    file of unknown origin: it is said as what it is instead."""
    text = str(exc).strip()
    if text.startswith("Weights only load failed"):
        return "not a checkpoint of tensors and plain data (torch's safe loader refused it)"
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read and check a checkpoint; the model comes back in eval mode on `map_location`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "no such file")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file; all mean "unusable"
        raise CheckpointError(path, f"cannot read (truncated or corrupt?): {_first_line(exc)}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(path, f"not a {FORMAT} checkpoint")
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(path, f"format version {version!r}, this build reads {FORMAT_VERSION}")
    text = payload.get("metadata")
    state = payload.get("state_dict")
    if not isinstance(text, str) or not isinstance(state, dict):
        raise CheckpointError(path, "metadata or weights missing")
    try:
        metadata = Metadata.from_json(text)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise CheckpointError(path, f"bad metadata: {exc!r}") from exc
    if metadata.format_version != FORMAT_VERSION:
        raise CheckpointError(path, f"metadata format version {metadata.format_version}")
    spec = metadata.features
    cfg = metadata.config
    if FEATURES_BY_VERSION.get(spec.version) != spec.features:
        readable = ", ".join(f"v{v} ({len(f)} features)" for v, f in sorted(FEATURES_BY_VERSION.items()))
        raise CheckpointError(
            path,
            f"trained on feature encoding v{spec.version} {list(spec.features)}, which this build cannot "
            f"produce (it encodes {readable})",
        )
    if cfg.n_features != len(spec.features):
        raise CheckpointError(path, f"config has {cfg.n_features} inputs, features list {len(spec.features)}")
    if cfg.n_horizons != len(spec.horizons_s) or cfg.n_targets != len(spec.targets):
        raise CheckpointError(path, "config's targets/horizons do not match the feature spec")
    if spec.window_s > cfg.max_len:
        raise CheckpointError(path, f"window {spec.window_s} s exceeds max_len {cfg.max_len}")
    for name in ("p90_shift", "p50_deadband"):
        table = getattr(metadata, name)
        if len(table) != cfg.n_targets or any(len(row) != cfg.n_horizons for row in table):
            raise CheckpointError(path, f"{name} does not have one value per target and horizon")
    try:
        model = TransformerBiGRU(cfg)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(path, f"bad config: {exc}") from exc
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(path, f"weights do not match the config: {exc}") from exc
    model.to(map_location).eval()
    return Checkpoint(model=model, metadata=metadata, path=str(path))
