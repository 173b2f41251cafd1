"""Profiler <-> manager over a real Unix-socket gRPC server when the connection fails: the manager goes
away and comes back (signatures are lost only beyond the profiler's bounded buffer, and every lost
one is counted), and the manager restarts with empty state while several profilers stream (they
reconnect on their own and the new manager decides again)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from fault_helpers import Link, until

from manager.core import EwmaMarginForecaster, Manager
from profiler.stream import Backoff, SignatureStreamer
from vgpu.v1 import signature_pb2

GPU = "GPU-stream-0"


class CountingSource:
    """`per_tick` signatures per tick for one application, seq from 1, wall time increasing."""

    def __init__(self, app: str, per_tick: int = 3) -> None:
        self.app = app
        self.per_tick = per_tick
        self.emitted = 0
        self.t = 1.7e9

    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        out = []
        for _ in range(self.per_tick):
            self.emitted += 1
            self.t += 0.01
            sig = signature_pb2.BehavioralSignature(app_id=self.app, pid=1, device_id=GPU, timestamp_s=self.t,
                                                    seq=self.emitted)
            sig.process.gpu_mem_used_mib = 1000.0 + self.emitted
            sig.process.sm_util_pct = 20.0
            out.append(sig)
        return out

    def close(self) -> None:
        pass


def _manager() -> Manager:
    return Manager(None, EwmaMarginForecaster(), forecast_interval_s=0.05, min_samples=2)


def _streamer(source: CountingSource, address: str, **kw: object) -> SignatureStreamer:
    return SignatureStreamer(source, address, period_s=0.02, backoff=Backoff(initial_s=0.02, max_s=0.1),
                             backoff_sleep=lambda dt: asyncio.sleep(dt), connect_timeout_s=0.3,
                             rng=random.Random(7), **kw)  # type: ignore[arg-type]


async def test_an_outage_loses_only_what_overflows_the_buffer_and_counts_it_exactly(tmp_path: Path) -> None:
    manager = _manager()
    source = CountingSource("app", per_tick=3)
    async with Link(tmp_path, manager, lambda a: [_streamer(source, a, buffer_max=15, profiler_id="p1")]) as link:
        (streamer,) = link.streamers
        await until(lambda: manager.stats.accepted >= 15)
        await link.stop_server(0.2)  # the manager goes away; what it had is answered first
        await until(lambda: not streamer.connected)
        await until(lambda: streamer.stats.dropped_total >= 30)  # 3 a tick into a buffer of 15
        assert len(streamer.buffer) == 15
        await link.start_server()  # back, with its state (a socket outage)
        await until(lambda: streamer.stats.connects == 2 and not streamer.buffer and streamer.stats.batches_sent > 0)
        await until(lambda: manager.stats.dropped_by_profilers == streamer.stats.dropped_total)
    got = [s.seq for s in manager.windows.window("app").samples]
    dropped = manager.stats.dropped_by_profilers
    # every signature made is either in the manager or counted as dropped, none twice, none made up
    assert got == sorted(set(got))
    assert len(got) + dropped == source.emitted, (len(got), dropped, source.emitted)
    # and what was lost is one run of the oldest signatures of the outage: a single gap
    gaps = [(a, b) for a, b in zip(got, got[1:], strict=False) if b != a + 1]
    assert len(gaps) == 1 and gaps[0][1] - gaps[0][0] - 1 == dropped
    assert manager.stats.out_of_order == 0 and manager.stats.rejected == 0


async def test_profilers_reconnect_to_a_restarted_manager_and_carry_on(tmp_path: Path) -> None:
    first = _manager()
    decisions: list[int] = [0, 0, 0]

    def streamers(address: str) -> list[SignatureStreamer]:
        return [
            _streamer(CountingSource(f"app{i}", per_tick=1), address, buffer_max=1000, profiler_id=f"p{i}",
                      on_reply=lambda r, i=i: decisions.__setitem__(i, decisions[i] + len(r.decisions)))
            for i in range(3)
        ]

    async with Link(tmp_path, first, streamers) as link:
        await until(lambda: all(d > 0 for d in decisions))
        await link.stop_server(0.1)  # the daemon restarts: a new manager with empty windows
        await asyncio.sleep(0.1)
        second = _manager()
        before = list(decisions)
        await link.start_server(second)
        await until(lambda: all(d > b for d, b in zip(decisions, before, strict=True)))
        assert sorted(second.windows.apps()) == ["app0", "app1", "app2"]
        for i, s in enumerate(link.streamers):
            assert s.stats.connects == 2 and s.connected
            last_first = first.windows.window(f"app{i}").latest()
            first_second = second.windows.window(f"app{i}").samples[0]
            assert last_first is not None and first_second.seq > last_first.seq  # numbering goes on
        assert second.stats.rejected == 0 and second.stats.out_of_order == 0


async def test_abrupt_manager_stops_lose_nothing_uncounted(tmp_path: Path) -> None:
    """Servers stopped with no grace while big batches are in flight: every signature is still
    either accepted or reported dropped (a batch is popped from the buffer only once written)."""
    manager = _manager()
    source = CountingSource("app", per_tick=200)
    async with Link(tmp_path, manager, lambda a: [_streamer(source, a, buffer_max=100_000, profiler_id="p1")]) as link:
        (streamer,) = link.streamers
        await until(lambda: manager.stats.accepted >= 200)
        for _ in range(5):
            await link.stop_server(None)  # no grace: in-flight batches are cut off
            await asyncio.sleep(0.05)
            await link.start_server()
            await until(lambda: streamer.connected and not streamer.buffer)
            await asyncio.sleep(0.03)
    assert manager.stats.out_of_order == 0
    assert manager.stats.accepted + manager.stats.dropped_by_profilers == source.emitted


class OneHugeSource(CountingSource):
    """Normal signatures, plus at the third tick one whose app id is over gRPC's 4 MiB receive limit
    (the sampler takes app ids from the in-app file an application writes, with no length bound)."""

    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        out = super().sample()
        if self.emitted == 3 * self.per_tick:
            self.emitted += 1
            out.append(signature_pb2.BehavioralSignature(app_id="h" * (4 * 1024 * 1024 + 10), pid=2, device_id=GPU,
                                                         timestamp_s=self.t, seq=1))
        return out


async def test_an_oversized_signature_costs_only_itself(tmp_path: Path) -> None:
    manager = _manager()
    source = OneHugeSource("app", per_tick=3)
    async with Link(tmp_path, manager, lambda a: [_streamer(source, a, buffer_max=1000, profiler_id="p1")]):
        await until(lambda: source.emitted >= 40)
        await asyncio.sleep(0.1)
    normal = source.emitted - 1
    assert manager.stats.accepted + manager.stats.dropped_by_profilers >= normal


def test_batches_are_split_to_stay_under_the_byte_budget() -> None:
    streamer = SignatureStreamer(CountingSource("app", per_tick=1), "unix:/nonexistent.sock", max_batch_bytes=4096)
    sigs = [signature_pb2.BehavioralSignature(app_id=f"a{i}" + "x" * 900, device_id=GPU, timestamp_s=1.0, seq=1)
            for i in range(10)]
    huge = signature_pb2.BehavioralSignature(app_id="h" * 5000, device_id=GPU, timestamp_s=1.0, seq=1)
    streamer.enqueue([*sigs[:2], huge, *sigs[2:]])
    n = streamer._batch_len()
    assert n == 4 and sum(s.ByteSize() for s in list(streamer.buffer)[:n]) <= 4096
    assert huge not in streamer.buffer and len(streamer.buffer) == 10  # dropped, counted, the rest kept
    assert (streamer.dropped_since_last, streamer.stats.dropped_total, streamer.stats.oversized) == (1, 1, 1)


class _CapturingCall:
    def __init__(self) -> None:
        self.written: list[object] = []

    async def write(self, batch: object) -> None:
        self.written.append(batch)


@pytest.mark.parametrize(("n", "columnar"), [(255, False), (256, True)])
async def test_a_big_batch_goes_as_columns_and_the_manager_keeps_all_of_it(n: int, columnar: bool) -> None:
    streamer = SignatureStreamer(CountingSource("app", per_tick=1), "unix:/nonexistent.sock", columns_from=256)
    sigs = [signature_pb2.BehavioralSignature(app_id=f"a{i % 7}", device_id=GPU, timestamp_s=1000.0 + i, seq=i + 1)
            for i in range(n)]
    for s in sigs:
        s.process.gpu_mem_used_mib = float(s.seq)
    streamer.enqueue(sigs)
    call = _CapturingCall()
    streamer._call = call  # type: ignore[assignment]
    await streamer._send(1)
    (batch,) = call.written
    assert batch.HasField("columns") == columnar and len(batch.signatures) == (0 if columnar else n)  # type: ignore[attr-defined]
    manager = _manager()
    assert manager.accept(batch).accepted == n and not streamer.buffer  # type: ignore[arg-type]
    assert sum(len(manager.windows.window(a)) for a in manager.windows.apps()) == n
    last_a0 = max(s.seq for s in sigs if s.app_id == "a0")
    assert manager.windows.window("a0").latest_value("mem_used_mib") == float(last_a0)
