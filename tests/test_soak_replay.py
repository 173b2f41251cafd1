"""An hour of trace through the manager's windows, forecast ticks and the allocator, at replay speed
(a manual clock: the hour takes seconds), with applications coming and going all along. After a
warm-up that fills every window, memory must stop growing: from a reference point (tracemalloc on,
everything alive then allocated since tracing began) to the end of the hour, traced memory grows by
less than a small bound, and every structure stays within its limit."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from manager_fakes import EwmaMarginForecaster

from vgpu.allocator.core import Allocator
from vgpu.allocator.history import History
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.manager.core import Manager, StreamState
from vgpu.manager.window import WindowStore
from vgpu.profiler.replay import ReplaySource
from vgpu.traces import AppTrace, Trace, read_trace
from vgpu.v1 import ingest_pb2

HOUR_S = 3600
WARMUP_S = 900  # every window full, a few cohorts come and gone
SETTLE_S = 300  # with tracing on, before the reference point: replaces everything alive at warm-up
MAX_SAMPLES = 120
MAX_APPS = 64
CHURN_EVERY_S = 300
STEP_S = 5  # trace seconds per ingested batch (a speed factor: the hour is 720 batches)
GROWTH_BOUND_BYTES = 256 * 1024


def _demo_apps() -> list[AppTrace]:
    from vgpu.data import demo_trace_path

    trace = read_trace(demo_trace_path())
    return [trace.apps[n] for n in sorted(trace.apps)]


def _renamed(apps: list[AppTrace], prefix: str) -> Trace:
    return Trace({f"{prefix}{a.app}": AppTrace(f"{prefix}{a.app}", a.t_s, a.columns) for a in apps})


class Soak:
    """Looping applications for the whole hour plus a new short-lived cohort every CHURN_EVERY_S."""

    def __init__(self) -> None:
        self.clock = ManualClock(1.7e9)
        self.apps = _demo_apps()
        sim = SimBackend(["h100-80gb", "h100-80gb"], clock=self.clock)
        self.device_ids = [d.uuid for d in sim.devices()]
        # the allocator's history, like the windows, with bounds an hour fills (the daemon keeps an hour)
        self.allocator = Allocator(sim, clock=self.clock, dry_run=False,
                                   history=History(max_points=MAX_SAMPLES, max_events=64, max_departed=8))
        self.windows = WindowStore(max_samples=MAX_SAMPLES, max_apps=MAX_APPS, idle_evict_s=30.0)
        self.manager = Manager(self.allocator, EwmaMarginForecaster(), clock=self.clock, windows=self.windows,
                               forecast_interval_s=10.0, min_samples=3)
        self.stream = StreamState(peer="soak")
        self.sources = [self._source(_renamed(self.apps, "steady-"), 0, loop=True)]
        self.t = 0
        self.cohort = 0

    def _source(self, trace: Trace, gpu: int, *, loop: bool) -> ReplaySource:
        return ReplaySource(trace, speed=1.0, loop=loop, align="per_app", device_id=self.device_ids[gpu],
                            clock=self.clock, wall_clock=self.clock, copies=1)

    def run(self, seconds: int) -> None:
        for _ in range(seconds // STEP_S):
            if self.t % CHURN_EVERY_S == 0:
                self.cohort += 1
                src = self._source(_renamed(self.apps, f"c{self.cohort}-"), 1, loop=False)
                self.sources = [s for s in self.sources if not s.done] + [src]
            self.clock.advance(STEP_S)
            self.t += STEP_S
            sigs = [sig for s in self.sources for sig in s.sample()]
            self.manager.ingest(ingest_pb2.SignatureBatch(tick=self.t, signatures=sigs), self.stream)


@pytest.mark.slow
def test_an_hour_of_replay_does_not_grow_memory() -> None:
    soak = Soak()
    soak.run(WARMUP_S)
    m = soak.manager
    assert m.stats.forecast_batches > 50 and m.stats.decisions > 0 and m.stats.evicted > 0
    tracemalloc.start(1)
    try:
        soak.run(SETTLE_S)
        start, _ = tracemalloc.get_traced_memory()
        soak.run(HOUR_S - WARMUP_S - SETTLE_S)
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    growth = end - start
    print(f"traced memory {start} -> {end} bytes ({growth:+d}) over {HOUR_S - WARMUP_S - SETTLE_S} s of replay")
    assert growth < GROWTH_BOUND_BYTES, f"{growth} bytes more alive after {HOUR_S - WARMUP_S - SETTLE_S} s of replay"
    # it really was an hour of work: every cohort came and went
    assert soak.t == HOUR_S and soak.cohort == HOUR_S // CHURN_EVERY_S
    assert m.stats.rejected == 0 and m.stats.out_of_order == 0 and m.stats.forecast_failures == 0
    assert m.stats.accepted > 5 * HOUR_S
    # structures within their limits
    assert len(soak.windows) <= MAX_APPS
    assert all(len(soak.windows.window(a).samples) <= MAX_SAMPLES for a in soak.windows.apps())
    live = set(soak.windows.apps())
    assert set(m.latest) <= live
    assert {g.app_id for g in soak.allocator.ledger.grants()} <= live
    assert {a.app_id for a in soak.allocator.list_apps()} <= live
    assert len({s.app_id for s in soak.allocator.history.series()} - live) <= 8  # departed ones kept
    used = np.array([soak.allocator.ledger.usage(d).mem_granted_mib for d in soak.device_ids])
    assert (used <= 81559.0 + 1e-6).all()
    soak.allocator.stop()


def test_a_long_lived_stream_forgets_evicted_apps() -> None:
    soak = Soak()
    soak.run(2 * CHURN_EVERY_S + 60)
    assert soak.manager.stats.evicted > 0
    assert soak.stream.apps <= set(soak.windows.apps())
