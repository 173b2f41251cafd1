"""A forecast round that fails for some of its applications still decides for every one of them, on
the daemon's path (`ingest_async`: rounds batched on the loop, the forecast in a worker thread): an
application the model fails on gets the fallback's forecast, the others keep the model's; where no
forecaster can forecast, its last value decides; one whose window cannot be copied sits the round
out, the others are decided. Each kind of failure is logged at most once an hour, not at every round."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from allocator_fakes import FakeBackend, FakeClock, FakeDevice
from manager_fakes import EwmaMarginForecaster
from structlog.testing import capture_logs

from vgpu.allocator.core import Allocator
from vgpu.log import LogBudget
from vgpu.manager.core import FAILURE_LOG_INTERVAL_S, Manager, StreamState
from vgpu.manager.forecast import HORIZONS_S, Forecast
from vgpu.manager.window import AppWindow, WindowStore
from vgpu.traces import AppTrace
from vgpu.v1 import ingest_pb2
from vgpu.v1 import signature_pb2 as spb

GPU = "GPU-fake-0"
N = len(HORIZONS_S)


def _sig(app: str, seq: int, t: float, mem: float) -> spb.BehavioralSignature:
    return spb.BehavioralSignature(
        app_id=app, pid=100 + sum(map(ord, app)), device_id=GPU, timestamp_s=t, seq=seq,
        device=spb.DeviceCounters(mem_total_mib=81559.0, power_mw=300_000, power_limit_mw=700_000),
        process=spb.ProcessCounters(gpu_mem_used_mib=mem, sm_util_pct=30.0),
    )


class Model:
    """Forecasts 2x the last memory use as P90, or fails as `fail(history)` says, for the whole batch
    (a model whose features cannot be built for one application fails its batch)."""

    name = "model"

    def __init__(self, broken: Sequence[str] = (), bad_values: Sequence[str] = ()) -> None:
        self.broken, self.bad_values = set(broken), set(bad_values)
        self.calls = 0

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        self.calls += 1
        out = []
        for h in histories:
            if h.app in self.broken:
                raise ValueError(f"features of {h.app}: a NaN where the model needs a number")
            mem = 2 * float(h.columns["mem_used_mib"][-1])
            p90: tuple[float, ...] = ("bad",) * N if h.app in self.bad_values else (mem,) * N  # type: ignore[assignment]
            out.append(Forecast(HORIZONS_S, (mem,) * N, p90, (30.0,) * N, (30.0,) * N, "model"))
        return out


class Broken:
    name = "baseline"

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        raise RuntimeError("the forecaster is broken")


def _manager(forecaster: object, fallback: object) -> tuple[Manager, Allocator, FakeClock]:
    clock = FakeClock()
    alloc = Allocator(FakeBackend([FakeDevice(GPU)]), clock=clock)
    mgr = Manager(alloc, forecaster, fallback=fallback, clock=clock, min_samples=1,  # type: ignore[arg-type]
                  forecast_interval_s=1.0, batch_window_s=0.0)
    return mgr, alloc, clock


async def _rounds(mgr: Manager, clock: FakeClock, apps: Sequence[str], rounds: int,
                  ) -> list[dict[str, ingest_pb2.Decision]]:
    """`rounds` batches of one signature per app, a forecast interval apart; the decisions of each."""
    stream = StreamState()
    out = []
    for k in range(1, rounds + 1):
        clock.advance(1.0)
        reply = await mgr.ingest_async(ingest_pb2.SignatureBatch(
            profiler_id="p", tick=k, sent_at_s=clock(),
            signatures=[_sig(a, k, clock(), 1000.0 * (i + 1)) for i, a in enumerate(apps)]), stream)
        out.append({d.app_id: d for d in reply.decisions})
    return out


def _said(logs: list[dict[str, object]], event: str) -> int:
    return sum(1 for e in logs if e["event"] == event)


async def test_one_app_the_model_fails_on_gets_the_fallback_and_the_others_keep_the_model() -> None:
    model = Model(broken=["bad"])
    mgr, _, clock = _manager(model, EwmaMarginForecaster())
    with capture_logs() as logs:
        rounds = await _rounds(mgr, clock, ["good1", "bad", "good2"], rounds=3)
    for decided in rounds:
        assert set(decided) == {"good1", "bad", "good2"}
        assert decided["good1"].source == "model" and decided["good1"].recommended_mem_mib == pytest.approx(2000 * 1.1)
        assert decided["good2"].source == "model" and decided["good2"].recommended_mem_mib == pytest.approx(6000 * 1.1)
        assert decided["bad"].source == "baseline" and decided["bad"].recommended_mem_mib > 2000
    assert _said(logs, "forecaster_failed") == 1  # once, not at every round
    assert mgr.stats.forecast_failures >= 1
    # the application the model failed on alone is not tried again at once: no round retries it
    # one by one (a model call costs the same for one application as for many)
    assert model.calls <= 3 + 3 + 1


async def test_where_no_forecaster_can_forecast_the_last_value_decides() -> None:
    mgr, _, clock = _manager(Broken(), Broken())
    with capture_logs() as logs:
        rounds = await _rounds(mgr, clock, ["a", "b"], rounds=3)
    for decided in rounds:
        assert set(decided) == {"a", "b"}
        assert decided["a"].recommended_mem_mib == pytest.approx(1000 * 1.1)
        assert decided["b"].recommended_mem_mib == pytest.approx(2000 * 1.1)
    assert _said(logs, "forecaster_failed") == 1
    assert _said(logs, "forecast_batch_failed") == 0


async def test_a_forecast_one_app_cannot_be_decided_from_falls_back_for_that_app_only() -> None:
    mgr, alloc, clock = _manager(Model(bad_values=["odd"]), EwmaMarginForecaster())
    with capture_logs() as logs:
        rounds = await _rounds(mgr, clock, ["fine", "odd"], rounds=2)
    for decided in rounds:
        assert set(decided) == {"fine", "odd"}
        assert decided["fine"].source == "model"
        assert decided["odd"].source == "baseline" and math.isfinite(decided["odd"].recommended_mem_mib)
    assert _said(logs, "decision_failed") == 1
    assert _said(logs, "forecast_batch_failed") == 0
    assert {g.app_id for g in alloc.ledger.grants()} == {"fine", "odd"}


class OneBadWindow(WindowStore):
    """The windows, but the copy of one application's fails (a damaged window)."""

    def __init__(self, bad: str) -> None:
        super().__init__()
        self.bad = bad

    def window(self, app_id: str) -> AppWindow:
        win = super().window(app_id)
        if app_id != self.bad:
            return win

        class Damaged(AppWindow):
            def trace(self) -> AppTrace:
                raise IndexError("window damaged")

        win.__class__ = Damaged
        return win


async def test_a_window_that_cannot_be_copied_leaves_its_app_out_and_the_others_in() -> None:
    clock = FakeClock()
    alloc = Allocator(FakeBackend([FakeDevice(GPU)]), clock=clock)
    mgr = Manager(alloc, Model(), fallback=EwmaMarginForecaster(), clock=clock, min_samples=1,
                  forecast_interval_s=1.0, batch_window_s=0.0, windows=OneBadWindow("bad"))
    with capture_logs() as logs:
        rounds = await _rounds(mgr, clock, ["ok", "bad"], rounds=3)
    for decided in rounds:
        assert set(decided) == {"ok"} and decided["ok"].source == "model"
    assert _said(logs, "window_failed") == 1 and _said(logs, "forecast_batch_failed") == 0
    assert [g.app_id for g in alloc.ledger.grants()] == ["ok"]


async def test_a_failure_that_persists_is_logged_again_an_hour_later_with_the_count_left_out() -> None:
    mgr, _, clock = _manager(Broken(), Broken())  # every round fails
    now = [0.0]
    mgr._failures_log = LogBudget(interval_s=FAILURE_LOG_INTERVAL_S, burst=1, clock=lambda: now[0])
    with capture_logs() as logs:
        await _rounds(mgr, clock, ["a"], rounds=3)
        now[0] = FAILURE_LOG_INTERVAL_S - 1.0
        await _rounds(mgr, clock, ["a"], rounds=2)
        assert _said(logs, "fallback_failed") == 1  # within the hour: counted, not logged
        now[0] = FAILURE_LOG_INTERVAL_S + 1.0
        await _rounds(mgr, clock, ["a"], rounds=2)
    records = [e for e in logs if e["event"] == "fallback_failed"]
    assert len(records) == 2
    assert records[0]["left_out"] == 0 and records[1]["left_out"] >= 1
    assert records[0]["count"] < records[1]["count"] <= mgr.stats.forecast_failures
