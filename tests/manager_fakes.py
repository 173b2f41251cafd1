"""A cheap, deterministic forecaster for the manager's tests: fast enough for fuzzing and soak runs,
simple enough that a test can say what it will forecast."""

from __future__ import annotations

import math
from collections.abc import Sequence

from vgpu.manager.forecast import HORIZONS_S, Forecast
from vgpu.traces import AppTrace, one_second_grid


class EwmaMarginForecaster:
    """The exponentially weighted mean of the 1 s grid as P50, plus `margin` of it as P90, flat over
    the horizons."""

    name = "ewma_margin"

    def __init__(self, alpha: float = 0.3, margin: float = 0.15) -> None:
        self.alpha, self.margin = alpha, margin

    def _one(self, hist: AppTrace, target: str) -> tuple[float, float]:
        _, grid = one_second_grid(hist, target)
        if not len(grid):
            return math.nan, math.nan
        m = float(grid[0])
        for v in grid[1:]:
            m = self.alpha * float(v) + (1 - self.alpha) * m
        return m, m * (1 + self.margin)

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        out = []
        n = len(HORIZONS_S)
        for hist in histories:
            m50, m90 = self._one(hist, "mem_used_mib")
            s50, s90 = self._one(hist, "sm_util_pct")
            out.append(Forecast(HORIZONS_S, (m50,) * n, (m90,) * n, (s50,) * n, (min(100.0, s90),) * n, self.name))
        return out
