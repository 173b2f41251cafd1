"""The manager: windows (bounds, out-of-order, eviction), signature validation, forecast ticks and
decisions, forecaster failure, and manager + allocator end to end over a Unix-socket gRPC server."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from allocator_fakes import FakeBackend, FakeClock, FakeDevice
from manager_fakes import EwmaMarginForecaster

from vgpu.allocator.core import Allocator, ApplyReport
from vgpu.allocator.policy.base import Recommendation
from vgpu.allocator.service import AllocatorServicer, build_server
from vgpu.manager.core import DutyBudget, Manager, StreamState
from vgpu.manager.forecast import HORIZONS_S, Forecast
from vgpu.manager.service import IngestServicer
from vgpu.manager.window import WindowStore, sample_from_signature
from vgpu.traces import AppTrace
from vgpu.v1 import allocator_pb2 as apb
from vgpu.v1 import allocator_pb2_grpc as apb_grpc
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import parse_signature

GPU = "GPU-fake-0"


def sig(app: str, seq: int, t: float, mem: float = 1000.0, sm: float = 30.0, device: str = GPU) -> spb.BehavioralSignature:
    return spb.BehavioralSignature(
        app_id=app,
        pid=1,
        device_id=device,
        timestamp_s=t,
        seq=seq,
        device=spb.DeviceCounters(mem_total_mib=81559.0, power_mw=300_000, power_limit_mw=700_000),
        process=spb.ProcessCounters(gpu_mem_used_mib=mem, sm_util_pct=sm),
    )


# --- window ----------------------------------------------------------------------------------------
def test_sample_maps_signature_fields_to_trace_columns() -> None:
    s = sample_from_signature(sig("a", 1, 10.0, mem=512, sm=40))
    assert (s.get("mem_used_mib"), s.get("sm_util_pct"), s.get("power_w"), s.get("power_limit_w")) == (512, 40, 300, 700)
    assert math.isnan(s.get("sm_clock_mhz"))
    inapp = spb.BehavioralSignature(app_id="a", device_id=GPU, seq=1, timestamp_s=1.0,
                                    in_app=spb.InAppCounters(torch_reserved_mib=77))
    assert sample_from_signature(inapp).get("mem_used_mib") == 77


def test_window_is_bounded_and_drops_out_of_order() -> None:
    ws = WindowStore(max_samples=5, max_apps=10)
    for i in range(1, 9):
        assert ws.add(sample_from_signature(sig("a", i, 100.0 + i, mem=i)), now_s=i)[0]
    win = ws.window("a")
    assert [s.seq for s in win.samples] == [4, 5, 6, 7, 8]
    assert not ws.add(sample_from_signature(sig("a", 8, 108.0)), 9)[0]  # duplicate
    assert not ws.add(sample_from_signature(sig("a", 3, 103.0)), 9)[0]  # late
    assert not ws.add(sample_from_signature(sig("a", 9, 107.5)), 9)[0]  # time goes back
    assert ws.out_of_order == 3
    # a restarted profiler numbers from 1 again at a newer time: kept
    assert ws.add(sample_from_signature(sig("a", 1, 200.0)), 10)[0] and ws.seq_restarts == 1
    trace = ws.trace("a")
    assert isinstance(trace, AppTrace) and len(trace) == 5
    np.testing.assert_array_equal(trace.column("mem_used_mib"), [5, 6, 7, 8, 1000])
    assert trace.gpu == GPU and not trace.has("sm_clock_mhz")


def test_window_evicts_the_longest_silent_app_when_full_and_idle_apps() -> None:
    ws = WindowStore(max_samples=5, max_apps=2, idle_evict_s=10)
    ws.add(sample_from_signature(sig("a", 1, 1.0)), 0)
    ws.add(sample_from_signature(sig("b", 1, 1.0)), 1)
    ws.add(sample_from_signature(sig("a", 2, 2.0)), 2)  # a is now the most recent
    kept, evicted = ws.add(sample_from_signature(sig("c", 1, 1.0)), 3)
    assert kept and evicted == ["b"] and ws.apps() == ["a", "c"]
    assert ws.evict_idle(12.5) == ["a"] and ws.apps() == ["c"] and ws.evicted_total == 2


# --- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda s: setattr(s, "app_id", ""), "app_id is empty"),
        (lambda s: setattr(s, "app_id", "x" * 300), "at most 256"),
        (lambda s: setattr(s, "device_id", ""), "device_id is empty"),
        (lambda s: setattr(s, "seq", 0), "seq is 0"),
        (lambda s: setattr(s, "timestamp_s", math.nan), "timestamp_s"),
        (lambda s: setattr(s.process, "gpu_mem_used_mib", math.inf), "process.gpu_mem_used_mib is not a finite"),
        (lambda s: setattr(s.process, "gpu_mem_used_mib", -5), "process.gpu_mem_used_mib is negative"),
        (lambda s: setattr(s.process, "sm_util_pct", 140), "process.sm_util_pct is outside 0-100"),
        (lambda s: setattr(s.device, "mem_bw_util_pct", math.nan), "device.mem_bw_util_pct"),
    ],
)
def test_malformed_signatures_are_rejected_with_a_reason(mutate: object, reason: str) -> None:
    s = sig("a", 1, 10.0)
    mutate(s)  # type: ignore[operator]
    got = parse_signature(s)[0]
    assert got is not None and reason in got
    assert parse_signature(sig("a", 1, 10.0))[0] is None


# --- the manager -----------------------------------------------------------------------------------
def batch(tick: int, sigs: Sequence[spb.BehavioralSignature]) -> ingest_pb2.SignatureBatch:
    return ingest_pb2.SignatureBatch(profiler_id="p", tick=tick, sent_at_s=1.0, signatures=list(sigs))


def make_manager(**kw: object) -> tuple[Manager, Allocator, FakeDevice, FakeClock]:
    dev = FakeDevice(GPU)
    clock = FakeClock()
    alloc = Allocator(FakeBackend([dev]), clock=clock)
    mgr = Manager(alloc, EwmaMarginForecaster(), clock=clock, **kw)  # type: ignore[arg-type]
    return mgr, alloc, dev, clock


def test_batches_become_decisions_and_grants_at_most_once_per_forecast_interval() -> None:
    mgr, alloc, dev, clock = make_manager(min_samples=3)
    replies = []
    for k in range(1, 31):
        t = 1000.0 + k * 0.1
        bad = spb.BehavioralSignature(app_id="", device_id=GPU, seq=k, timestamp_s=t)
        replies.append(mgr.ingest(batch(k, [sig("a", k, t, 4000, 20), sig("b", k, t, 8000, 50), bad])))
        clock.advance(0.1)
    assert all(r.accepted == 2 and len(r.rejected) == 1 for r in replies)
    assert replies[0].rejected[0].index == 2 and replies[0].rejected[0].reason == "app_id is empty"
    # each app is forecast as soon as it has 3 samples (batch 3, both in one forecast call), then
    # once per forecast interval on its own phase: the two were admitted together but are not
    # forecast together again, and no app's forecasts are under half an interval (5 batches) or
    # over an interval (10 batches, plus the batch a boundary falls just before) apart
    with_decisions = [r for r in replies if r.decisions]
    assert with_decisions[0].tick == 3 and {d.app_id for d in with_decisions[0].decisions} == {"a", "b"}
    assert all(d.for_seq == r.tick for r in with_decisions for d in r.decisions)
    ticks = {app: [r.tick for r in replies for d in r.decisions if d.app_id == app] for app in ("a", "b")}
    for app_ticks in ticks.values():
        assert len(app_ticks) >= 3 and all(5 <= b - a <= 11 for a, b in zip(app_ticks, app_ticks[1:], strict=False))
    assert not set(ticks["a"][1:]) & set(ticks["b"][1:])
    assert mgr.stats.decisions == len(ticks["a"]) + len(ticks["b"]) == sum(len(r.decisions) for r in replies)
    d = {x.app_id: x for r in replies for x in r.decisions}  # the latest of each
    assert d["a"].recommended_mem_mib == pytest.approx(4000 * 1.15 * 1.10)
    assert d["b"].recommended_sm_pct == pytest.approx(50 * 1.15)
    assert [h.horizon_s for h in d["a"].forecasts] == list(HORIZONS_S) and d["a"].source == "baseline"
    grants = {g.app_id: g for g in alloc.ledger.grants()}
    assert grants["a"].memory_mib == pytest.approx(4000 * 1.15 * 1.1) and grants["a"].source == "forecast"
    assert dev.writes  # the power limit followed the SM demand
    apps = {a.app_id: a for a in alloc.list_apps()}
    assert apps["b"].mem_used_mib == 8000


def test_silent_apps_are_evicted_and_their_forecast_grants_released() -> None:
    mgr, alloc, _, clock = make_manager(min_samples=1, windows=WindowStore(idle_evict_s=5))
    mgr.ingest(batch(1, [sig("a", 1, 10.0)]))
    assert [g.app_id for g in alloc.ledger.grants()] == ["a"]
    clock.advance(6)
    mgr.ingest(batch(2, [sig("b", 1, 16.0)]))
    assert [g.app_id for g in alloc.ledger.grants()] == ["b"] and mgr.stats.evicted == 1


def test_a_failing_forecaster_falls_back_to_the_baseline() -> None:
    class Broken:
        name = "model"

        def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
            raise RuntimeError("CUDA out of memory")

    clock = FakeClock()
    mgr = Manager(None, Broken(), fallback=EwmaMarginForecaster(), clock=clock, min_samples=1)
    assert mgr.source == "model"
    reply = mgr.ingest(batch(1, [sig("a", 1, 10.0, mem=100)]))
    assert mgr.stats.forecast_failures == 1
    assert reply.decisions[0].source == "baseline" and reply.decisions[0].recommended_mem_mib > 100


@pytest.mark.parametrize("n", [1, 63, 64, 65, 150, 300])
def test_the_ring_buffer_window_keeps_the_newest_in_order_across_growth_and_wrap(n: int) -> None:
    ws = WindowStore(max_samples=100)
    for i in range(1, n + 1):
        ws.add_row("a", GPU, i, 1000.0 + i, (float(i),) + (math.nan,) * 8, now_s=0.0)
    win, keep = ws.window("a"), min(n, 100)
    trace = win.trace()
    np.testing.assert_array_equal(trace.t_s, 1000.0 + np.arange(n - keep + 1, n + 1))
    np.testing.assert_array_equal(trace.column("mem_used_mib"), np.arange(n - keep + 1, n + 1))
    assert list(trace.columns) == ["mem_used_mib"] and len(win) == keep
    assert [s.seq for s in win.samples] == list(range(n - keep + 1, n + 1))
    assert win.latest() is not None and win.latest().seq == n and win.latest_value("mem_used_mib") == n  # type: ignore[union-attr]
    trace.column("mem_used_mib")[:] = -1  # a copy: the window is untouched
    assert win.latest_value("mem_used_mib") == n


async def test_signatures_arriving_together_are_forecast_in_one_batch_and_each_reply_has_its_own() -> None:
    mgr, _, _, _ = make_manager(min_samples=1, batch_window_s=0.02)
    streams = [StreamState(f"p{i}") for i in range(3)]
    replies = await asyncio.gather(*(mgr.ingest_async(batch(1, [sig(f"app{i}", 1, 10.0)]), streams[i])
                                     for i in range(3)))
    assert mgr.stats.forecast_batches == 1 and mgr.stats.decisions == 3
    assert [[d.app_id for d in r.decisions] for r in replies] == [["app0"], ["app1"], ["app2"]]
    again = await mgr.ingest_async(batch(2, [sig("app0", 2, 10.1)]), streams[0])  # under forecast_interval_s
    assert again.accepted == 1 and not again.decisions and mgr.stats.forecast_batches == 1


def test_each_stream_gets_decisions_for_its_own_apps_once() -> None:
    mgr, _, _, _ = make_manager(min_samples=1)
    s1, s2 = StreamState("p1"), StreamState("p2")
    r1 = mgr.ingest(batch(1, [sig("a", 1, 10.0)]), s1)
    r2 = mgr.ingest(batch(1, [sig("b", 1, 10.0)]), s2)
    assert [d.app_id for d in r1.decisions] == ["a"] and [d.app_id for d in r2.decisions] == ["b"]
    r1 = mgr.ingest(batch(2, [sig("a", 2, 10.1)]), s1)
    assert r1.decisions == []  # a was forecast under forecast_interval_s ago; b's decision is not for s1


# --- end to end over gRPC --------------------------------------------------------------------------
@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[str, Manager, Allocator]]:
    dev = FakeDevice(GPU)
    alloc = Allocator(FakeBackend([dev]))
    mgr = Manager(alloc, EwmaMarginForecaster(), forecast_interval_s=0.2, min_samples=2)
    address = f"unix:{tmp_path}/vgpu.sock"
    server = build_server(address, allocator_servicer=AllocatorServicer(alloc), ingest_servicer=IngestServicer(mgr))
    await server.start()
    try:
        yield address, mgr, alloc
    finally:
        alloc.stop()
        await server.stop(0)


async def test_stream_of_signatures_yields_decisions_and_grants_over_grpc(
    daemon: tuple[str, Manager, Allocator],
) -> None:
    address, mgr, _ = daemon
    import time

    async def batches() -> AsyncIterator[ingest_pb2.SignatureBatch]:
        for k in range(1, 16):
            t = time.time()
            sigs = [sig("a", k, t, 2000 + 10 * k, 25), sig("b", k, t, 6000, 40)]
            if k == 5:
                sigs.append(sig("c", 1, t, mem=math.nan))  # malformed: the stream must survive it
            yield batch(k, sigs)
            await asyncio.sleep(0.03)

    async with grpc.aio.insecure_channel(address) as channel:
        replies = [r async for r in ingest_pb2_grpc.IngestStub(channel).StreamSignatures(batches(), timeout=30)]
        assert [r.tick for r in replies] == list(range(1, 16))
        assert sum(r.accepted for r in replies) == 30
        (rej,) = [x for r in replies for x in r.rejected]
        assert rej.app_id == "c" and "not a finite number" in rej.reason
        decisions = [d for r in replies for d in r.decisions]
        assert {d.app_id for d in decisions} == {"a", "b"}
        apps = (await apb_grpc.AllocatorStub(channel).ListApplications(apb.ListApplicationsRequest(), timeout=10)).apps
        by_app = {a.app_id: a for a in apps}
        assert by_app["b"].grants[0].source == "forecast" and by_app["b"].grants[0].memory_mib >= 6000
        assert by_app["a"].forecast_mem_p90_mib > 2000
    assert mgr.stats.rejected == 1 and mgr.stats.forecast_batches >= 2


class _CpuHungryForecaster(EwmaMarginForecaster):
    """Burns `cpu_s` of this thread's CPU per call, like a model with a fixed cost per call."""

    def __init__(self, cpu_s: float) -> None:
        super().__init__()
        self.cpu_s = cpu_s
        self.calls: list[int] = []

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        import time

        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        self.calls.append(len(histories))
        return super().forecast_batch(histories)


async def test_forecast_batches_are_spaced_to_keep_the_forecasting_duty_cycle() -> None:
    fc = _CpuHungryForecaster(0.03)
    mgr = Manager(None, fc, min_samples=1, forecast_duty_max=0.5, duty_window_s=0.0, batch_window_s=0.0)
    loop = asyncio.get_running_loop()
    await mgr.ingest_async(batch(1, [sig("a", 1, 10.0)]))
    started = loop.time()
    # due while the gap runs: b and c wait and share one call
    replies = await asyncio.gather(mgr.ingest_async(batch(2, [sig("b", 1, 10.0)]), StreamState("p2")),
                                   mgr.ingest_async(batch(3, [sig("c", 1, 10.0)]), StreamState("p3")))
    assert loop.time() - started >= 0.03 / 0.5 * 0.9  # no burst allowance: a's 30 ms earned back first
    assert fc.calls == [1, 2] and [[d.app_id for d in r.decisions] for r in replies] == [["b"], ["c"]]
    with pytest.raises(ValueError, match="forecast_duty_max"):
        Manager(None, fc, forecast_duty_max=0.0)


def test_applications_arriving_together_are_forecast_a_slice_per_batch_once_per_interval() -> None:
    mgr, alloc, _, clock = make_manager(min_samples=1)
    n, per_batch = 40, []
    for k in range(1, 51):  # 5 s of one profiler stream at 10 Hz with every application in every batch
        t = 1000.0 + k * 0.1
        reply = mgr.ingest(batch(k, [sig(f"app{i}", k, t) for i in range(n)]))
        per_batch.append([d.app_id for d in reply.decisions])
        clock.advance(0.1)
    assert sorted(per_batch[0]) == sorted(f"app{i}" for i in range(n))  # each app's first forecast: at once
    later = per_batch[20:]  # from the third second on, every app forecasts on its own phase
    assert max(len(x) for x in later) <= 8  # about n / 10 per batch, not all n in one batch a second
    counts = {f"app{i}": 0 for i in range(n)}
    for x in later:
        for app in x:
            counts[app] += 1
    assert set(counts.values()) == {3}  # 30 batches, 3 s: once per forecast interval each
    assert {g.app_id for g in alloc.ledger.grants()} == set(counts)


def test_an_application_on_a_stream_of_its_own_keeps_its_cadence_once_a_second() -> None:
    mgr, _, _, clock = make_manager(min_samples=1)
    ticks: dict[str, list[int]] = {"a": [], "b": []}
    for k in range(1, 46):  # each application in batches of its own, arriving together
        t = 1000.0 + k * 0.1
        for app in ticks:
            reply = mgr.ingest(batch(k, [sig(app, k, t)]))
            ticks[app] += [k for d in reply.decisions if d.app_id == app]
        clock.advance(0.1)
    # not spread (each was the only new application of its batch), no early second forecast
    assert ticks["a"] == ticks["b"] == [1, 11, 21, 31, 41]


class _SlowSink:
    """A recommendation sink whose every apply burns `cpu_s` of this thread's CPU, as the allocator
    re-planning a device with hundreds of applications does."""

    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s
        self.calls: list[list[str]] = []
        self.skipped: tuple[str, ...] = ()

    def apply_recommendations(self, recommendations: Sequence[object]) -> _SlowSink:
        import time

        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        self.calls.append([r.app_id for r in recommendations])  # type: ignore[attr-defined]
        return self

    def forget_app(self, app_id: str) -> list[object]:
        return []


async def test_decisions_go_out_at_once_and_to_the_allocator_within_the_acting_budget() -> None:
    sink = _SlowSink(0.03)
    mgr = Manager(sink, EwmaMarginForecaster(), min_samples=1, batch_window_s=0.0, act_duty_max=0.05,  # type: ignore[arg-type]
                  duty_window_s=0.0, forecast_interval_s=10.0)
    await mgr.ingest_async(batch(1, [sig("a", 1, 10.0)]), StreamState("p1"))
    assert sink.calls == []  # the round's reply is out first ...
    await asyncio.sleep(0)
    assert sink.calls == [["a"]]  # ... and the budget is in credit: applied right behind it
    reply = await mgr.ingest_async(batch(2, [sig("b", 1, 10.0)]), StreamState("p2"))
    # a's 30 ms are earned back at 0.05 s a second (0.6 s, room for a loaded machine between the two
    # rounds): b's decision is in its reply, not applied yet
    assert [d.app_id for d in reply.decisions] == ["b"] and mgr.latest["b"].app_id == "b"
    assert sink.calls == [["a"]] and mgr.stats.applies_deferred == 1
    await asyncio.sleep(0.7)
    await mgr.ingest_async(batch(3, [sig("c", 1, 10.0)]), StreamState("p3"))
    await asyncio.sleep(0)
    assert sink.calls == [["a"], ["b", "c"]]  # the first round after the budget is back applies both
    assert mgr.stats.applies == 2
    with pytest.raises(ValueError, match="act_duty_max"):
        Manager(sink, EwmaMarginForecaster(), act_duty_max=0.0)  # type: ignore[arg-type]


class _ReplyWatchingSink(_SlowSink):
    """A slow sink that notes, at each apply, which of the watched ingest tasks had returned."""

    def __init__(self, cpu_s: float) -> None:
        super().__init__(cpu_s)
        self.watched: list[asyncio.Task[ingest_pb2.IngestReply]] = []
        self.done_at_apply: list[list[bool]] = []

    def apply_recommendations(self, recommendations: Sequence[object]) -> _SlowSink:
        self.done_at_apply.append([t.done() for t in self.watched])
        return super().apply_recommendations(recommendations)


async def test_a_rounds_replies_are_out_before_its_apply_runs() -> None:
    """Two streams' batches join one round; both replies, with their decisions, have been handed
    back before the allocator's apply of that round starts (which burns 50 ms of the loop)."""
    sink = _ReplyWatchingSink(0.05)
    mgr = Manager(sink, EwmaMarginForecaster(), min_samples=1, batch_window_s=0.01,  # type: ignore[arg-type]
                  forecast_interval_s=10.0)
    sink.watched = [asyncio.create_task(mgr.ingest_async(batch(1, [sig(app, 1, 10.0)]), StreamState(app)))
                    for app in ("a", "b")]
    replies = await asyncio.gather(*sink.watched)
    assert [[d.app_id for d in r.decisions] for r in replies] == [["a"], ["b"]]
    await asyncio.sleep(0)
    assert sink.calls == [["a", "b"]] and sink.done_at_apply == [[True, True]]
    assert mgr.stats.applies == 1


def _grants(alloc: Allocator) -> list[tuple[str, str, float, float, str]]:
    return sorted((g.app_id, g.device_id, g.memory_mib, g.sm_pct, g.source) for g in alloc.ledger.grants())


async def test_a_release_between_a_round_and_its_apply_is_honoured_as_if_it_came_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The apply a round queues runs after the round's replies, so an allocator call can come in
    between (here: `a` releases its grant). The apply then works on the ledger after that call:
    the grants are those of the same recommendations applied, in one piece, after the release."""
    mgr, alloc, dev, clock = make_manager(min_samples=1, batch_window_s=0.0, forecast_interval_s=1.0)
    handed: list[list[Recommendation]] = []
    apply = alloc.apply_recommendations

    def recording(recs: Sequence[Recommendation]) -> ApplyReport:
        handed.append(list(recs))
        return apply(recs)

    monkeypatch.setattr(alloc, "apply_recommendations", recording)
    await mgr.ingest_async(batch(1, [sig("a", 1, 10.0, 4000), sig("b", 1, 10.0, 8000)]), StreamState("p"))
    await asyncio.sleep(0)
    (first,) = [g for g in alloc.ledger.grants() if g.app_id == "a"]
    clock.advance(2.0)
    reply = await mgr.ingest_async(batch(2, [sig("a", 2, 12.0, 6000), sig("b", 2, 12.0, 9000)]), StreamState("p"))
    assert len(handed) == 1 and {d.app_id for d in reply.decisions} == {"a", "b"}  # the apply is still queued
    alloc.release(first.grant_id, reason="test")  # e.g. a Release call the loop ran before the apply
    await asyncio.sleep(0)
    assert len(handed) == 2
    got = _grants(alloc)
    assert [g for g in got if g[0] == "a"] and all(g.grant_id != first.grant_id for g in alloc.ledger.grants())

    # the same two applies on a fresh allocator, with the release strictly between them
    ref_clock = FakeClock()
    ref = Allocator(FakeBackend([FakeDevice(GPU)]), clock=ref_clock)
    ref.apply_recommendations(handed[0])
    ref_clock.advance(2.0)
    (ref_first,) = [g for g in ref.ledger.grants() if g.app_id == "a"]
    ref.release(ref_first.grant_id, reason="test")
    ref.apply_recommendations(handed[1])
    assert got == _grants(ref)


async def test_an_app_evicted_between_a_round_and_its_apply_is_not_applied() -> None:
    """Another stream's batch that the loop reads between a round's replies and its queued apply,
    and that evicts one of the round's applications: the apply leaves that application out, and
    it holds no grant afterwards (as when the eviction comes before the round)."""
    mgr, alloc, dev, clock = make_manager(min_samples=1, batch_window_s=0.0, forecast_interval_s=1.0,
                                          windows=WindowStore(idle_evict_s=5))
    await mgr.ingest_async(batch(1, [sig("a", 1, 10.0, 4000), sig("b", 1, 10.0, 8000)]), StreamState("p"))
    await asyncio.sleep(0)
    assert {g.app_id for g in alloc.ledger.grants()} == {"a", "b"}
    clock.advance(4.0)
    reply = await mgr.ingest_async(batch(2, [sig("b", 2, 14.0, 9000)]), StreamState("p"))
    assert [d.app_id for d in reply.decisions] == ["b"]  # b's round is done; its apply is queued
    clock.advance(2.0)  # a has been silent 6 s, b 2 s: the next batch read evicts a, not b
    mgr.accept(batch(3, [sig("c", 1, 16.0, 1000)]), StreamState("q"))
    assert "a" not in mgr.windows and "b" in mgr.windows
    await asyncio.sleep(0)  # the queued apply
    assert {g.app_id for g in alloc.ledger.grants()} == {"b"}
    assert mgr.stats.applies == 2


async def test_a_deferred_apply_happens_without_another_round_and_skips_evicted_apps() -> None:
    sink = _SlowSink(0.03)
    clock = FakeClock()
    # a's 30 ms of applying are earned back in 0.6 s: room for a loaded machine before the second round
    mgr = Manager(sink, EwmaMarginForecaster(), min_samples=1, batch_window_s=0.0, act_duty_max=0.05,  # type: ignore[arg-type]
                  duty_window_s=0.0, forecast_interval_s=0.5, clock=clock, windows=WindowStore(idle_evict_s=5))
    await mgr.ingest_async(batch(1, [sig("a", 1, 10.0)]), StreamState("p1"))
    await mgr.ingest_async(batch(2, [sig("b", 1, 10.0), sig("c", 1, 10.0)]), StreamState("p2"))
    assert sink.calls == [["a"]]
    clock.advance(6)  # b and c fall silent; "d" arrives and evicts them before the deferred apply
    await mgr.ingest_async(batch(3, [sig("d", 1, 20.0)]), StreamState("p3"))
    # no round after the budget is back: the timer applies what is still held (waited for, not a
    # fixed wait: the deferred apply burns its 30 ms of CPU, which a loaded machine spreads out)
    deadline = asyncio.get_running_loop().time() + 30
    while sink.calls[-1] != ["d"] and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert sink.calls[-1] == ["d"] and all("b" not in c and "c" not in c for c in sink.calls)


def test_the_duty_budget_lets_a_burst_through_and_then_spaces_batches() -> None:
    budget = DutyBudget(0.25, window_s=1.0)  # 0.25 s of CPU per second, at most 0.25 s kept
    assert budget.wait_s(100.0) == 0.0
    budget.spend(100.1, 0.1)
    budget.spend(100.2, 0.1)
    assert budget.wait_s(100.2) == 0.0  # 0.25 - 0.2 + 0.05 earned meanwhile: still in credit
    budget.spend(100.3, 0.2)  # 0.075 + 0.025 earned - 0.2: now 0.1 s in debt ...
    assert budget.wait_s(100.3) == pytest.approx(0.4)  # ... earned back at 0.25 s per second
    assert budget.wait_s(100.7) == pytest.approx(0.0)
    assert budget.wait_s(200.0) == 0.0
    budget.spend(200.0, 0.25 + 0.05)  # a long idle time earned only the cap
    assert budget.wait_s(200.0) == pytest.approx(0.2)


def test_the_duty_budget_bounds_the_busy_share_under_overload() -> None:
    budget, now, busy = DutyBudget(0.25, window_s=1.0), 0.0, 0.0
    while now < 60.0:  # always something due; every batch takes 40 ms
        now += budget.wait_s(now)
        now += 0.04
        busy += 0.04
        budget.spend(now, 0.04)
    assert busy <= 0.25 * (now + 1.0) + 0.04
    assert busy >= 0.25 * now * 0.95  # and it does not idle more than the budget asks


def test_the_duty_budget_without_a_window_waits_out_each_batch() -> None:
    budget = DutyBudget(0.5, window_s=0.0)
    assert budget.wait_s(0.0) == 0.0
    budget.spend(0.03, 0.03)
    assert budget.wait_s(0.03) == pytest.approx(0.06)
    with pytest.raises(ValueError, match="duty"):
        DutyBudget(0.0, 1.0)
    with pytest.raises(ValueError, match="window_s"):
        DutyBudget(0.5, -1.0)
