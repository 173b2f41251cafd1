"""The Transformer-BiGRU as a `Forecaster`, and a holder that hot-reloads it.

`ModelForecaster` turns histories into windows (`manager.features`), runs one batched forward for
all applications (CUDA when present, else CPU; the caller's `torch.set_num_threads` is respected),
and turns the normalised outputs back into MiB and %: P50 = last + change (zero where the change
is under the calibrated dead band), P90 = last + P90 change + the calibrated shift, then P90 >= P50 and both clamped to [0, capacity] (the slice's memory where
known, 100 % for compute).

`ReloadingForecaster` watches the checkpoint file (at most every `check_interval_s`), loads a new
one in the background and swaps it in atomically between calls; a corrupt new file is logged and
the old model keeps serving; when no model loads at start the given baseline serves instead.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from manager.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from manager.features import FEATURES, encode_latest
from manager.forecast import Forecast, Forecaster
from vgpu.log import get_logger
from vgpu.traces import AppTrace

_log = get_logger("vgpu.manager.predictor")
_MEM_TOTAL_KNOWN = FEATURES.index("mem_total_known")
# The model shipped in the repository (see docs/forecasting.md for how it was trained).
DEFAULT_MODEL_PATH = Path(__file__).resolve().parent / "models" / "default.pt"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelForecaster:
    """Forecasts with a trained checkpoint; `name` is "model"."""

    name = "model"

    def __init__(self, checkpoint: Checkpoint, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self.checkpoint = checkpoint
        self.model = checkpoint.model.to(self.device).eval()
        meta = checkpoint.metadata
        self.window_s = meta.features.window_s
        self.horizons_s = tuple(meta.features.horizons_s)
        self._shift = np.asarray(meta.p90_shift, dtype=np.float64)  # (targets, horizons)
        self._deadband = np.asarray(meta.p50_deadband, dtype=np.float64)

    @property
    def path(self) -> str:
        return self.checkpoint.path

    def predict_normalised(self, x: np.ndarray) -> np.ndarray:
        """Raw network outputs (N, targets, horizons, 2) for windows x (N, window, features)."""
        if len(x) == 0:
            return np.zeros((0, 2, len(self.horizons_s), 2))
        with torch.inference_mode():
            out = self.model(torch.from_numpy(np.ascontiguousarray(x)).to(self.device))
        return out.float().cpu().numpy().astype(np.float64)

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        n_h = len(self.horizons_s)
        windows, present = encode_latest(histories, self.window_s)
        out = apply_deadband(self.predict_normalised(windows.x), self._deadband)
        scales = windows.scales[:, :, None]  # (N, 2, 1)
        last = windows.last[:, :, None]
        p50 = last + out[..., 0] * scales
        p90 = last + (out[..., 1] + self._shift[None]) * scales
        p90 = np.maximum(p90, p50)
        known_total = windows.x[:, -1, _MEM_TOTAL_KNOWN] > 0.5  # capacity known at the origin
        cap_mem = np.where(known_total, windows.mem_scale_mib, np.inf)
        caps = np.stack([cap_mem, np.full_like(cap_mem, 100.0)], axis=1)[:, :, None]
        p50 = np.clip(p50, 0.0, caps)
        p90 = np.clip(p90, 0.0, caps)
        nan = (math.nan,) * n_h
        result: list[Forecast] = []
        row = 0
        for ok in present:
            if not ok:
                result.append(Forecast(self.horizons_s, nan, nan, nan, nan, source=self.name))
                continue
            result.append(
                Forecast(
                    horizons_s=self.horizons_s,
                    mem_p50_mib=tuple(float(v) for v in p50[row, 0]),
                    mem_p90_mib=tuple(float(v) for v in p90[row, 0]),
                    sm_p50_pct=tuple(float(v) for v in p50[row, 1]),
                    sm_p90_pct=tuple(float(v) for v in p90[row, 1]),
                    source=self.name,
                )
            )
            row += 1
        return result


def apply_deadband(out: np.ndarray, deadband: np.ndarray) -> np.ndarray:
    """Zero the P50 changes (and move the P90 with them) whose size is under the dead band of
    their target and horizon: below it, the validation split said "no change" forecasts better."""
    small = np.abs(out[..., 0]) < deadband[None]
    adjusted = out.copy()
    adjusted[..., 1] = np.where(small, out[..., 1] - out[..., 0], out[..., 1])
    adjusted[..., 0] = np.where(small, 0.0, out[..., 0])
    return adjusted


def load_forecaster(path: str | Path, device: torch.device | str | None = None) -> ModelForecaster:
    """A `ModelForecaster` from a checkpoint file; raises `CheckpointError` when it cannot be used."""
    dev = torch.device(device) if device is not None else default_device()
    return ModelForecaster(load_checkpoint(path, map_location=dev), dev)


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


class ReloadingForecaster:
    """Serves the checkpoint at `path`, picking up a new file without interrupting callers.

    Every `forecast_batch` call looks at the file's mtime and size at most every
    `check_interval_s` (by `clock`); a changed file is loaded (in a background thread when
    `background`, else right there) and swapped in by one reference assignment. A file that fails
    to load is logged, remembered (not retried until it changes again) and the current forecaster
    keeps serving. If nothing loads at start, `fallback` serves until a good file appears; without a
    fallback the start-up error is raised.
    """

    def __init__(
        self,
        path: str | Path,
        fallback: Forecaster | None = None,
        *,
        check_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        loader: Callable[[Path], Forecaster] = load_forecaster,
        background: bool = True,
    ) -> None:
        self.path = Path(path)
        self._fallback = fallback
        self._interval_s = check_interval_s
        self._clock = clock
        self._loader = loader
        self._background = background
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failed_sig: tuple[int, int] | None = None
        self.reloads = 0
        self.reload_failures = 0
        self.last_error: str | None = None
        sig = _signature(self.path)
        try:
            self._current: Forecaster = loader(self.path)
            self._loaded_sig = sig
            _log.info("forecaster_loaded", path=str(self.path))
        except Exception as exc:  # noqa: BLE001 - whatever the loader raises, the file cannot be served
            if fallback is None:
                raise
            self.last_error = _describe(exc)
            self._current = fallback
            self._loaded_sig = None
            self._failed_sig = sig
            _log.warning("forecaster_fallback", path=str(self.path), error=self.last_error, fallback=fallback.name)
        self._last_check = clock()

    @property
    def name(self) -> str:
        return self._current.name

    @property
    def current(self) -> Forecaster:
        return self._current

    @property
    def serving_model(self) -> bool:
        return self._current is not self._fallback

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        self.maybe_reload()
        return self._current.forecast_batch(histories)

    def maybe_reload(self) -> None:
        """Check the file if the interval has passed; start a load if it changed."""
        now = self._clock()
        if now - self._last_check < self._interval_s:
            return
        self._last_check = now
        sig = _signature(self.path)
        if sig is None or sig == self._loaded_sig or sig == self._failed_sig:
            return
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if self._background:
                self._thread = threading.Thread(
                    target=self._load, args=(sig,), name="vgpu-model-reload", daemon=True
                )
                self._thread.start()
                return
        self._load(sig)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait for a background load to finish (for tests and orderly shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _load(self, sig: tuple[int, int]) -> None:
        try:
            new = self._loader(self.path)
        except Exception as exc:  # noqa: BLE001 - a background load must not die silently: log, keep serving
            self._failed_sig = sig
            self.reload_failures += 1
            self.last_error = _describe(exc)
            _log.error(
                "forecaster_reload_failed", path=str(self.path), error=self.last_error, serving=self._current.name,
                failures=self.reload_failures,
            )
            return
        self._current = new  # one reference assignment: callers see the old or the new, never half
        self._loaded_sig = sig
        self.reloads += 1
        self.last_error = None
        _log.info("forecaster_reloaded", path=str(self.path), serving=new.name, reloads=self.reloads)


def _describe(exc: Exception) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
