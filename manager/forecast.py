"""What every forecaster gives the manager, the evaluator and the allocator.

A forecaster sees an application's raw samples up to now (an `AppTrace`: the manager's window, or
the evaluation protocol's prefix of a trace) and returns, per horizon of 1-5 s, a median and a P90
of memory and compute need. Recommending is separate from acting: nothing here touches a device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from vgpu.traces import AppTrace

HORIZONS_S: tuple[int, ...] = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Forecast:
    """One application's forecast. Each tuple is indexed like `horizons_s`; NaN where the target is
    unknown (the history has no value for it)."""

    horizons_s: tuple[int, ...]
    mem_p50_mib: tuple[float, ...]
    mem_p90_mib: tuple[float, ...]
    sm_p50_pct: tuple[float, ...]
    sm_p90_pct: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        n = len(self.horizons_s)
        for name in ("mem_p50_mib", "mem_p90_mib", "sm_p50_pct", "sm_p90_pct"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} values for {n} horizons")

    def peak_mem_p90_mib(self) -> float:
        """Largest P90 memory over the horizons (NaN if unknown)."""
        vals = [v for v in self.mem_p90_mib if not math.isnan(v)]
        return max(vals) if vals else math.nan

    def peak_sm_p90_pct(self) -> float:
        vals = [v for v in self.sm_p90_pct if not math.isnan(v)]
        return max(vals) if vals else math.nan


@runtime_checkable
class Forecaster(Protocol):
    """Forecasts for many applications at once (one batched call per forecast tick)."""

    @property
    def name(self) -> str:
        """The method, as forecasts' `source` and the reports name it (read only: a forecaster
        that serves another's forecasts, such as `ReloadingForecaster`, reports that one's)."""
        ...

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        """One Forecast per history, in order. A history may be short; a forecaster that cannot
        say anything for a target returns NaN for it rather than raising."""
        ...


@runtime_checkable
class ForgetsApps(Protocol):
    """A forecaster that keeps state per application (the served mixture's weights and P90 offsets,
    or a wrapper around such a forecaster). Optional: the manager calls `forget` when it forgets an
    application (silent past its window's idle time, or evicted to make room), so an id that comes
    back later starts afresh instead of inheriting a departed application's state. Forecasters
    without per-application state do not implement it and are left alone."""

    def forget(self, app: str) -> None:
        """Drop everything kept about `app` (a no-op for an unknown one). May be called from another
        thread than the one forecasting."""
        ...


def forget_app(forecaster: object, app: str) -> None:
    """Tell `forecaster` that `app` is gone, where it keeps state per application (`ForgetsApps`)."""
    if isinstance(forecaster, ForgetsApps):
        forecaster.forget(app)
