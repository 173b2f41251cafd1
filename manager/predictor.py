"""The Transformer-BiGRU as a `Forecaster`, and a holder that hot-reloads it.

`ModelForecaster` turns histories into windows (`vgpu.manager.features`), runs one batched forward for
all applications (CUDA when present, else CPU; the caller's `torch.set_num_threads` is respected),
and turns the normalised outputs back into MiB and %: P50 = last + change (zero where the change
is under the calibrated dead band), P90 = last + P90 change + the calibrated shift, then P90 >= P50 and both clamped to [0, capacity] (the slice's memory where
known, 100 % for compute).

`ReloadingForecaster` watches the checkpoint file (at most every `check_interval_s`), loads a new
one in the background and swaps it in atomically between calls; a corrupt new file is logged and
the old model keeps serving; when no model loads at start the given baseline serves instead.

Modes (`ModelForecaster(mode=...)`, the same function within float rounding, tested at 1e-4):
`eager` runs the trained module as it is; `fused` runs `vgpu.manager.model.FusedTransformerBiGRU` (affine
maps folded together, about half the multiply-adds); `onnx` (the default) runs the fused network in
ONNX Runtime on the CPU, whose own allocator and kernels are faster again at this size. Where ONNX
Runtime is not installed, cannot take the network, or the device is CUDA, `onnx` serves `fused` and
says so in one log line. See docs/forecasting.md for the figures.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import torch

from vgpu.log import get_logger
from vgpu.manager.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from vgpu.manager.features import encode_latest
from vgpu.manager.forecast import Forecast, Forecaster, forget_app
from vgpu.manager.heap import hold_heap
from vgpu.manager.model import FusedTransformerBiGRU
from vgpu.traces import AppTrace

_log = get_logger("vgpu.manager.predictor")
# The model shipped in the repository (see docs/forecasting.md for how it was trained).
DEFAULT_MODEL_PATH = Path(__file__).resolve().parent / "models" / "default.pt"
MODES = ("eager", "fused", "onnx")
DEFAULT_MODE = "onnx"
# Intra-op threads of a model the daemon serves: one forecast round for 64 applications is a few
# milliseconds of small matrix products, which a second thread does not shorten on a loaded node
# (measured on 2 busy cores: p50 wall 20.5-28.2 ms with one thread, 22.9-29.6 ms with two; see
# docs/performance.md), and the node's own jobs keep the other cores.
SERVING_THREADS = 1


class OnnxSession(Protocol):
    """What the forecaster uses of an `onnxruntime.InferenceSession` (onnxruntime has no types)."""

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, np.ndarray]) -> list[Any]: ...


def import_onnxruntime() -> ModuleType:
    """ONNX Runtime, an optional dependency (raises ImportError where it is not installed)."""
    return importlib.import_module("onnxruntime")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelForecaster:
    """Forecasts with a trained checkpoint; `name` is "model". `mode` picks how the network runs (see
    the module's docstring); `mode_serving` says which one does. `threads` (default: torch's
    current number) is what ONNX Runtime may use; `onnx_import` finds ONNX Runtime. `heap` is called once
    at construction: by default `vgpu.manager.heap.hold_heap`, which keeps the C heap's freed memory
    between rounds so that the feature encoding's temporaries do not page-fault afresh every round."""

    name = "model"

    def __init__(
        self,
        checkpoint: Checkpoint,
        device: torch.device | str | None = None,
        *,
        mode: str = DEFAULT_MODE,
        threads: int | None = None,
        onnx_import: Callable[[], ModuleType] = import_onnxruntime,
        heap: Callable[[], object] = hold_heap,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown forecaster mode {mode!r}; one of {', '.join(MODES)}")
        self.device = torch.device(device) if device is not None else default_device()
        self.checkpoint = checkpoint
        self.model = checkpoint.model.to(self.device).eval()
        meta = checkpoint.metadata
        self.window_s = meta.features.window_s
        self.horizons_s = tuple(meta.features.horizons_s)
        # the checkpoint's own feature encoding (v2 and v3 checkpoints are both served)
        self.feature_version = meta.features.version
        self.n_features = len(meta.features.features)
        self._mem_total_known = meta.features.features.index("mem_total_known")
        self._shift = np.asarray(meta.p90_shift, dtype=np.float64)  # (targets, horizons)
        self._deadband = np.asarray(meta.p50_deadband, dtype=np.float64)
        self.mode = mode
        self._net: torch.nn.Module = self.model
        self._session: OnnxSession | None = None
        if mode in ("fused", "onnx"):
            self._net = FusedTransformerBiGRU(self.model, self.window_s).to(self.device)
        self.mode_serving = "eager" if mode == "eager" else "fused"
        self.threads = threads or torch.get_num_threads()
        if mode == "onnx":
            self._session = self._onnx_session(onnx_import, self.threads)
            if self._session is not None:
                self.mode_serving = "onnx"
        heap()

    def _onnx_session(self, onnx_import: Callable[[], ModuleType], threads: int) -> OnnxSession | None:
        """An ONNX Runtime session of the fused network, or None (logged once) to run it in torch."""
        if self.device.type != "cpu":
            _log.info("forecaster_mode", requested="onnx", serving="fused", reason=f"device {self.device.type}")
            return None
        try:
            ort = onnx_import()
        except ImportError as exc:
            _log.warning("forecaster_mode", requested="onnx", serving="fused", reason=f"onnxruntime missing: {exc}")
            return None
        try:
            example = torch.zeros(2, self.window_s, self.n_features)
            buf = io.BytesIO()
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    # the TorchScript exporter (dynamo=False) writes to a file object too; torch
                    # annotates `f` as a path only
                    self._net, (example,), buf, input_names=["x"], output_names=["y"],  # type: ignore[arg-type]
                    dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False, opset_version=17,
                )
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            options.log_severity_level = 3
            # A daemon must not busy-wait between forecasts: ONNX Runtime's worker threads spin by default
            # (measured: the manager at 57 % of a core instead of under 30 % with 2 threads).
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session: OnnxSession = ort.InferenceSession(buf.getvalue(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - any exporter/runtime failure: serve the torch path instead
            _log.warning(
                "forecaster_mode", requested="onnx", serving="fused", reason=f"{type(exc).__name__}: {exc}"
            )
            return None
        return session

    @property
    def path(self) -> str:
        return self.checkpoint.path

    def predict_normalised(self, x: np.ndarray) -> np.ndarray:
        """Raw network outputs (N, targets, horizons, 2) for windows x (N, window, features)."""
        if len(x) == 0:
            return np.zeros((0, 2, len(self.horizons_s), 2))
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._session is not None and x.shape[1] == self.window_s:
            out_np = self._session.run(None, {"x": x})[0]
            return np.asarray(out_np, dtype=np.float64)
        with torch.inference_mode():
            out: torch.Tensor = self._net(torch.from_numpy(x).to(self.device))
        return out.float().cpu().numpy().astype(np.float64)

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        n_h = len(self.horizons_s)
        rows, present = self._forecast_rows(histories)
        nan = (math.nan,) * n_h
        result: list[Forecast] = []
        row = 0
        values = rows.tolist()  # Python floats in one call, not a numpy scalar per value
        for ok in present.tolist():
            if not ok:
                result.append(Forecast(self.horizons_s, nan, nan, nan, nan, source=self.name))
                continue
            mem50, sm50, mem90, sm90 = values[row]
            result.append(
                Forecast(
                    horizons_s=self.horizons_s,
                    mem_p50_mib=tuple(mem50),
                    mem_p90_mib=tuple(mem90),
                    sm_p50_pct=tuple(sm50),
                    sm_p90_pct=tuple(sm90),
                    source=self.name,
                )
            )
            row += 1
        return result

    def forecast_arrays(self, histories: Sequence[AppTrace]) -> np.ndarray:
        """`forecast_batch`'s numbers without building `Forecast`s (what the expert mixture reads):
        (N, [mem P50, compute P50, mem P90, compute P90], horizons), NaN for an empty history."""
        rows, present = self._forecast_rows(histories)
        out = np.full((len(histories), 4, len(self.horizons_s)), math.nan)
        out[present] = rows
        return out

    def _forecast_rows(self, histories: Sequence[AppTrace]) -> tuple[np.ndarray, np.ndarray]:
        """(forecasts (present histories, [mem P50, compute P50, mem P90, compute P90], horizons),
        which histories are present)."""
        windows, present = encode_latest(histories, self.window_s, self.feature_version)
        out = apply_deadband(self.predict_normalised(windows.x), self._deadband)
        scales = windows.scales[:, :, None]  # (N, 2, 1)
        last = windows.last[:, :, None]
        p50 = last + out[..., 0] * scales
        p90 = last + (out[..., 1] + self._shift[None]) * scales
        p90 = np.maximum(p90, p50)
        known_total = windows.x[:, -1, self._mem_total_known] > 0.5  # capacity known at the origin
        cap_mem = np.where(known_total, windows.mem_scale_mib, np.inf)
        caps = np.stack([cap_mem, np.full_like(cap_mem, 100.0)], axis=1)[:, :, None]
        p50 = np.clip(p50, 0.0, caps)
        p90 = np.clip(p90, 0.0, caps)
        return np.concatenate([p50, p90], axis=1), present


def apply_deadband(out: np.ndarray, deadband: np.ndarray) -> np.ndarray:
    """Zero the P50 changes (and move the P90 with them) whose size is under the dead band of
    their target and horizon: below it, the validation split said "no change" forecasts better."""
    small = np.abs(out[..., 0]) < deadband[None]
    adjusted = out.copy()
    adjusted[..., 1] = np.where(small, out[..., 1] - out[..., 0], out[..., 1])
    adjusted[..., 0] = np.where(small, 0.0, out[..., 0])
    return adjusted


def load_forecaster(
    path: str | Path, device: torch.device | str | None = None, *, mode: str = DEFAULT_MODE,
    threads: int | None = None,
) -> ModelForecaster:
    """A `ModelForecaster` from a checkpoint file (`threads` as `ModelForecaster`'s); raises
    `CheckpointError` when it cannot be used."""
    dev = torch.device(device) if device is not None else default_device()
    return ModelForecaster(load_checkpoint(path, map_location=dev), dev, mode=mode, threads=threads)


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

    def forget(self, app: str) -> None:
        """Pass the manager's `forget` on to the forecasters behind (`ForgetsApps`): the serving one
        and the fallback, where they keep state per application (a model does not)."""
        forget_app(self._current, app)
        if self._fallback is not None and self._fallback is not self._current:
            forget_app(self._fallback, app)

    @property
    def horizons_s(self) -> tuple[int, ...] | None:
        """The serving forecaster's horizons where it can give arrays (see `forecast_arrays`)."""
        current = self._current
        return current.horizons_s if isinstance(current, ModelForecaster) else None

    def forecast_arrays(self, histories: Sequence[AppTrace]) -> np.ndarray | None:
        """`ModelForecaster.forecast_arrays` of the serving forecaster, or None where it has no such
        method (the fallback serves): call `forecast_batch` then."""
        self.maybe_reload()
        current = self._current
        return current.forecast_arrays(histories) if isinstance(current, ModelForecaster) else None

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

    @property
    def loading_thread(self) -> threading.Thread | None:
        """The background load of a new file, when one was started (it may have finished)."""
        return self._thread

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
                # `model`, not `serving`: under the expert mixture this is one expert, and the record
                # must not contradict vgpu_forecaster_serving
                "forecaster_reload_failed", path=str(self.path), error=self.last_error, model=self._current.name,
                failures=self.reload_failures,
            )
            return
        self._current = new  # one reference assignment: callers see the old or the new, never half
        self._loaded_sig = sig
        self.reloads += 1
        self.last_error = None
        _log.info("forecaster_reloaded", path=str(self.path), model=new.name, reloads=self.reloads)


def _describe(exc: Exception) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
