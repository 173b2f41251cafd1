"""The `Manager`: signatures in, windows, one batched forecast per tick, decisions out.

Each ingested `SignatureBatch` is validated signature by signature (a malformed one is rejected
with a reason, the rest of the batch and the stream go on) and added to the per-application
windows (manager/window.py). At most once per `forecast_interval_s` a forecast tick runs: one
`forecast_batch` call for every application with enough samples, each forecast becomes a `Decision`
(recommended memory = the peak P90 over the horizons plus `mem_margin`, recommended SM = the peak
P90), and the decisions go to the allocator in-process (`Allocator.apply_recommendations`).
Applications silent for long are evicted and their forecast grants released.

A forecaster that raises is logged and the fallback (the plain baseline) serves that tick.

Concurrency: like the allocator, the manager lives on the daemon's one asyncio loop; `ingest` and
`ingest_async` are called there. `ingest_async` runs the forecast itself in a worker thread on an
immutable snapshot of the windows (at most one at a time), so a slow model never stalls other RPCs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from allocator.core import Allocator
from allocator.plan import Recommendation
from manager.forecast import HORIZONS_S, Forecast, Forecaster
from manager.window import WindowStore, sample_from_signature
from vgpu.log import get_logger
from vgpu.traces import AppTrace, one_second_grid
from vgpu.v1 import ingest_pb2, signature_pb2

_PCT_FIELDS = {"sm_util_pct", "mem_bw_util_pct"}
_MAX_APP_ID = 256


class EwmaMarginForecaster:
    """The manager's own last-resort forecaster (used only when manager/baselines.py is missing):
    the exponentially weighted mean of the 1 s grid as P50, plus `margin` of it as P90, flat over
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


def default_baseline() -> Forecaster:
    """B's baseline (manager/baselines.py) when present, else `EwmaMarginForecaster`."""
    try:
        from manager.baselines import BaselineForecaster  # noqa: PLC0415 - optional module
    except ImportError:
        return EwmaMarginForecaster()
    forecaster: Forecaster = BaselineForecaster()
    return forecaster


@dataclass(frozen=True)
class Decision:
    app_id: str
    device_id: str
    forecast: Forecast
    recommended_mem_mib: float
    recommended_sm_pct: float
    source: str  # "model" or "baseline"
    for_seq: int
    decided_at_s: float
    mem_used_mib: float = math.nan
    sm_util_pct: float = math.nan

    def to_pb(self) -> ingest_pb2.Decision:
        f = self.forecast
        return ingest_pb2.Decision(
            app_id=self.app_id,
            device_id=self.device_id,
            forecasts=[
                ingest_pb2.HorizonForecast(
                    horizon_s=h,
                    mem_p50_mib=_z(f.mem_p50_mib[i]),
                    mem_p90_mib=_z(f.mem_p90_mib[i]),
                    sm_p50_pct=_z(f.sm_p50_pct[i]),
                    sm_p90_pct=_z(f.sm_p90_pct[i]),
                )
                for i, h in enumerate(f.horizons_s)
            ],
            recommended_mem_mib=self.recommended_mem_mib,
            recommended_sm_pct=self.recommended_sm_pct,
            source=self.source,
            for_seq=self.for_seq,
            decided_at_s=self.decided_at_s,
        )

    def to_recommendation(self) -> Recommendation:
        return Recommendation(
            app_id=self.app_id,
            device_id=self.device_id,
            memory_mib=self.recommended_mem_mib,
            sm_pct=self.recommended_sm_pct,
            source=self.source,
            mem_p90_peak_mib=self.forecast.peak_mem_p90_mib(),
            sm_p90_peak_pct=self.forecast.peak_sm_p90_pct(),
            mem_used_mib=self.mem_used_mib,
            sm_util_pct=self.sm_util_pct,
            for_seq=self.for_seq,
            decided_at_s=self.decided_at_s,
        )


def _z(x: float) -> float:
    """NaN has no place in a proto double a person reads; unknown is sent as 0 (the field docs say so)."""
    return x if math.isfinite(x) else 0.0


def validate_signature(sig: signature_pb2.BehavioralSignature) -> str | None:
    """Why a signature is unusable, or None when it is fine."""
    if not sig.app_id.strip():
        return "app_id is empty"
    if len(sig.app_id) > _MAX_APP_ID:
        return f"app_id is {len(sig.app_id)} characters long; at most {_MAX_APP_ID} are allowed"
    if not sig.device_id:
        return "device_id is empty: give the GPU or MIG UUID the application runs on"
    if sig.seq == 0:
        return "seq is 0: sequence numbers start at 1"
    if not math.isfinite(sig.timestamp_s) or sig.timestamp_s <= 0:
        return f"timestamp_s must be Unix seconds > 0, got {sig.timestamp_s}"
    for part in ("device", "process", "host", "in_app"):
        if not sig.HasField(part):
            continue
        for fd, value in getattr(sig, part).ListFields():
            if not isinstance(value, float):
                continue
            where = f"{part}.{fd.name}"
            if not math.isfinite(value):
                return f"{where} is not a finite number ({value})"
            if value < 0:
                return f"{where} is negative ({value:g})"
            if fd.name in _PCT_FIELDS and value > 100.0:
                return f"{where} is outside 0-100 ({value:g})"
    return None


@dataclass
class ManagerStats:
    batches: int = 0
    signatures: int = 0
    accepted: int = 0
    rejected: int = 0
    out_of_order: int = 0
    forecast_ticks: int = 0
    forecast_failures: int = 0
    decisions: int = 0
    evicted: int = 0
    dropped_by_profilers: int = 0
    forecast_s_total: float = 0.0


@dataclass
class StreamState:
    """One profiler stream: which applications it sent, which decisions it has been given."""

    peer: str = ""
    apps: set[str] = field(default_factory=set)
    delivered: int = 0


class Manager:
    """See the module docstring. `allocator` None: decide only (tests, dry analysis)."""

    def __init__(
        self,
        allocator: Allocator | None,
        forecaster: Forecaster | None = None,
        *,
        fallback: Forecaster | None = None,
        clock: Callable[[], float] = time.time,
        windows: WindowStore | None = None,
        forecast_interval_s: float = 1.0,
        min_samples: int = 3,
        mem_margin: float = 0.10,
        logger: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.allocator = allocator
        self.fallback = fallback if fallback is not None else default_baseline()
        self.forecaster = forecaster if forecaster is not None else self.fallback
        self.clock = clock
        self.windows = windows if windows is not None else WindowStore()
        self.forecast_interval_s = forecast_interval_s
        self.min_samples = min_samples
        self.mem_margin = mem_margin
        self.stats = ManagerStats()
        self.latest: dict[str, Decision] = {}
        self._serial: dict[str, int] = {}  # app -> serial of its latest decision
        self._next_serial = 0
        self._last_tick_s = -math.inf
        self._forecasting = False
        self._delivered_plain = 0  # decisions handed out to callers without stream state
        self._log = logger or get_logger("vgpu.manager")

    @property
    def source(self) -> str:
        """"model" when the forecaster is the trained model, else "baseline"."""
        return "model" if getattr(self.forecaster, "name", "") == "model" else "baseline"

    # --- ingest ----------------------------------------------------------------------------------
    def accept(self, batch: ingest_pb2.SignatureBatch, stream: StreamState | None = None) -> ingest_pb2.IngestReply:
        """Validate and window a batch; the reply has the counts and rejections, no decisions yet."""
        now = self.clock()
        reply = ingest_pb2.IngestReply(tick=batch.tick)
        self.stats.batches += 1
        self.stats.dropped_by_profilers += batch.dropped_since_last
        for i, sig in enumerate(batch.signatures):
            self.stats.signatures += 1
            reason = validate_signature(sig)
            if reason is not None:
                self.stats.rejected += 1
                reply.rejected.add(index=i, app_id=sig.app_id[:_MAX_APP_ID], reason=reason)
                continue
            kept, evicted = self.windows.add(sample_from_signature(sig), now)
            self._forget(evicted)
            if kept:
                reply.accepted += 1
                self.stats.accepted += 1
                if stream is not None:
                    stream.apps.add(sig.app_id)
            else:
                self.stats.out_of_order += 1
        return reply

    def forecast_due(self) -> bool:
        return not self._forecasting and self.clock() - self._last_tick_s >= self.forecast_interval_s

    def ingest(self, batch: ingest_pb2.SignatureBatch, stream: StreamState | None = None) -> ingest_pb2.IngestReply:
        """Accept a batch and, when a forecast tick is due, forecast and act, all on this thread."""
        reply = self.accept(batch, stream)
        if self.forecast_due():
            histories = self._begin_tick()
            try:
                decisions = self._decide(histories)
            finally:
                self._forecasting = False
            self._act(decisions)
        self._attach(reply, stream)
        return reply

    async def ingest_async(
        self, batch: ingest_pb2.SignatureBatch, stream: StreamState | None = None
    ) -> ingest_pb2.IngestReply:
        """Like `ingest`, with the forecast in a worker thread."""
        reply = self.accept(batch, stream)
        if self.forecast_due():
            histories = self._begin_tick()
            try:
                decisions = await asyncio.to_thread(self._decide, histories)
            finally:
                self._forecasting = False
            self._act(decisions)
        self._attach(reply, stream)
        return reply

    def _attach(self, reply: ingest_pb2.IngestReply, stream: StreamState | None) -> None:
        """Add the decisions this stream has not seen yet for its own applications (all
        decisions of this call when there is no stream state)."""
        if stream is None:
            for app_id, serial in self._serial.items():
                if serial > self._delivered_plain:
                    reply.decisions.append(self.latest[app_id].to_pb())
            self._delivered_plain = self._next_serial
            return
        for app_id in stream.apps:
            if self._serial.get(app_id, 0) > stream.delivered:
                reply.decisions.append(self.latest[app_id].to_pb())
        stream.delivered = self._next_serial

    # --- forecast tick ---------------------------------------------------------------------------
    def _begin_tick(self) -> list[tuple[str, str, int, AppTrace, float, float]]:
        now = self.clock()
        self._forecasting = True
        self._last_tick_s = now
        self._forget(self.windows.evict_idle(now))
        out = []
        for app_id in self.windows.apps():
            win = self.windows.window(app_id)
            last = win.latest()
            if last is None or len(win.samples) < self.min_samples:
                continue
            out.append((app_id, last.device_id, last.seq, win.trace(), last.get("mem_used_mib"), last.get("sm_util_pct")))
        return out

    def _run_forecaster(self, traces: list[AppTrace]) -> list[Forecast]:
        try:
            result = self.forecaster.forecast_batch(traces)
            if len(result) != len(traces):
                raise ValueError(f"{len(result)} forecasts for {len(traces)} histories")
            return result
        except Exception as exc:  # noqa: BLE001 - the fallback serves this tick
            self.stats.forecast_failures += 1
            if self.stats.forecast_failures in (1, 10, 100) or self.stats.forecast_failures % 1000 == 0:
                self._log.error("forecaster_failed", forecaster=getattr(self.forecaster, "name", "?"), error=repr(exc),
                                count=self.stats.forecast_failures)
            if self.forecaster is self.fallback:
                return [_unknown() for _ in traces]
            return self.fallback.forecast_batch(traces)

    def _decide(self, items: list[tuple[str, str, int, AppTrace, float, float]]) -> list[Decision]:
        if not items:
            return []
        started = time.perf_counter()
        forecasts = self._run_forecaster([it[3] for it in items])
        self.stats.forecast_s_total += time.perf_counter() - started
        now = self.clock()
        decisions = []
        for (app_id, device_id, seq, _trace, mem_used, sm_used), fc in zip(items, forecasts, strict=True):
            mem, sm = self.recommend(fc, mem_used, sm_used)
            if math.isnan(mem) and math.isnan(sm):
                continue
            source = "model" if fc.source == "model" else "baseline"
            decisions.append(
                Decision(app_id, device_id, fc, 0.0 if math.isnan(mem) else mem, 0.0 if math.isnan(sm) else sm,
                         source, seq, now, mem_used, sm_used)
            )
        return decisions

    def recommend(self, fc: Forecast, mem_used_mib: float, sm_util_pct: float) -> tuple[float, float]:
        """(memory MiB, SM %) to recommend: the peak P90 over the horizons (P50 where no P90, the last
        observation where no forecast), memory with `mem_margin` on top; NaN where nothing is known."""
        mem = _first_finite(fc.peak_mem_p90_mib(), _peak(fc.mem_p50_mib), mem_used_mib)
        sm = _first_finite(fc.peak_sm_p90_pct(), _peak(fc.sm_p50_pct), sm_util_pct)
        if not math.isnan(mem):
            mem = max(0.0, mem) * (1 + self.mem_margin)
        if not math.isnan(sm):
            sm = min(100.0, max(0.0, sm))
        return mem, sm

    def _act(self, decisions: list[Decision]) -> None:
        self.stats.forecast_ticks += 1
        for d in decisions:
            self._next_serial += 1
            self._serial[d.app_id] = self._next_serial
            self.latest[d.app_id] = d
        self.stats.decisions += len(decisions)
        if self.allocator is not None and decisions:
            try:
                report = self.allocator.apply_recommendations([d.to_recommendation() for d in decisions])
            except Exception as exc:  # noqa: BLE001 - acting failed; the stream and the next tick go on
                self._log.error("apply_recommendations_failed", error=repr(exc))
                return
            if report.skipped:
                self._log.debug("recommendations_skipped", skipped=list(report.skipped))

    def _forget(self, app_ids: list[str]) -> None:
        for app_id in app_ids:
            self.stats.evicted += 1
            self.latest.pop(app_id, None)
            self._serial.pop(app_id, None)
            if self.allocator is not None:
                self.allocator.forget_app(app_id)
            self._log.info("app_evicted", app=app_id)


def _peak(values: Sequence[float]) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.nanmax(arr)) if np.isfinite(arr).any() else math.nan


def _first_finite(*values: float) -> float:
    for v in values:
        if math.isfinite(v):
            return v
    return math.nan


def _unknown() -> Forecast:
    nan = (math.nan,) * len(HORIZONS_S)
    return Forecast(HORIZONS_S, nan, nan, nan, nan, "none")
