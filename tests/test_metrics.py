"""vgpu/daemon/metrics.py: the forecast summary counts forecaster calls (batches), not 1 s ticks."""

from __future__ import annotations

from collections.abc import Sequence

from allocator_fakes import FakeBackend, FakeClock, FakeDevice
from manager_fakes import EwmaMarginForecaster
from prometheus_client import CollectorRegistry

from vgpu.allocator.core import Allocator
from vgpu.daemon.metrics import DaemonMetrics
from vgpu.daemon.serve import StateSource
from vgpu.manager.core import Manager
from vgpu.manager.forecast import Forecast
from vgpu.traces import AppTrace
from vgpu.v1 import ingest_pb2
from vgpu.v1 import signature_pb2 as spb

GPU = "GPU-fake-0"


class CountingForecaster(EwmaMarginForecaster):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.histories = 0

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        self.calls += 1
        self.histories += len(histories)
        return super().forecast_batch(histories)


def _sig(app: str, seq: int, t: float) -> spb.BehavioralSignature:
    return spb.BehavioralSignature(app_id=app, pid=1, device_id=GPU, timestamp_s=t, seq=seq,
                                   device=spb.DeviceCounters(mem_total_mib=81559.0),
                                   process=spb.ProcessCounters(gpu_mem_used_mib=1000.0, sm_util_pct=30.0))


def test_forecast_batch_summary_counts_forecaster_calls_not_applications_or_ticks() -> None:
    clock = FakeClock()
    alloc = Allocator(FakeBackend([FakeDevice(GPU)]), clock=clock)
    fc = CountingForecaster()
    mgr = Manager(alloc, fc, clock=clock, min_samples=1)
    registry = CollectorRegistry()
    DaemonMetrics(registry, StateSource(alloc, mgr))
    for k in range(1, 26):  # 2.5 s of batches every 0.1 s, three apps each
        t = 1000.0 + k * 0.1
        mgr.ingest(ingest_pb2.SignatureBatch(profiler_id="p", tick=k, sent_at_s=t,
                                             signatures=[_sig(a, k, t) for a in ("a", "b", "c")]))
        clock.advance(0.1)
    # each app forecast once a second (its forecast times spread over the second, so some calls take
    # more than one app): the metric counts the calls, neither the apps nor the 25 batches
    assert 9 <= fc.histories <= 12 and fc.calls < fc.histories and fc.calls < 25
    assert registry.get_sample_value("vgpu_forecast_batch_seconds_count") == fc.calls
    total = registry.get_sample_value("vgpu_forecast_batch_seconds_sum")
    assert total is not None and total >= 0.0 and total == mgr.stats.forecast_s_total
    assert registry.get_sample_value("vgpu_forecast_tick_seconds_count") is None  # the old, misleading name is gone


def test_signature_results_are_counted_apart() -> None:
    """Accepted, malformed, out of order and a profiler's resend (held already): four results."""
    clock = FakeClock()
    alloc = Allocator(FakeBackend([FakeDevice(GPU)]), clock=clock)
    mgr = Manager(alloc, EwmaMarginForecaster(), clock=clock, min_samples=100)
    registry = CollectorRegistry()
    DaemonMetrics(registry, StateSource(alloc, mgr))
    first = [_sig("a", k, 1000.0 + k) for k in (1, 2, 3)]
    mgr.ingest(ingest_pb2.SignatureBatch(profiler_id="p", tick=1, signatures=first))
    late = _sig("a", 1, 1000.5)  # seq 1 again at a time the window does not hold: out of order
    bad = _sig("", 9, 1010.0)  # no application id: malformed
    mgr.ingest(ingest_pb2.SignatureBatch(profiler_id="p", tick=2, signatures=[*first[1:], late, bad]))

    def value(result: str) -> float | None:
        return registry.get_sample_value("vgpu_signatures_total", {"result": result})

    assert (value("accepted"), value("duplicate"), value("out_of_order"), value("rejected")) == (3, 2, 1, 1)
