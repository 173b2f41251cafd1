"""Profiler <-> manager over a real Unix-socket gRPC server when the connection fails: the manager goes
away and comes back (signatures are lost only beyond the profiler's bounded buffer, and every lost
one is counted), the manager restarts with empty state while several profilers stream (they
reconnect on their own and the new manager decides again), and a manager dies having read only some
of what was written (what it never acknowledged is sent again: each signature lands in a window once,
the ones it already had are dropped as duplicates, not rejected)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from fault_helpers import Link, until
from manager_fakes import EwmaMarginForecaster

from vgpu.manager.core import Manager, StreamState
from vgpu.manager.window import WindowStore
from vgpu.profiler.stream import Backoff, SignatureStreamer
from vgpu.v1 import ingest_pb2, signature_pb2

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


def _manager(**kw: object) -> Manager:
    return Manager(None, EwmaMarginForecaster(), forecast_interval_s=0.05, min_samples=2, **kw)  # type: ignore[arg-type]


def _seqs(manager: Manager, app: str = "app") -> list[int]:
    return [s.seq for s in manager.windows.window(app).samples] if app in manager.windows else []


class StallingManager(Manager):
    """A quiet manager (no decisions) that windows the first `read_batches` batches, then takes the next
    one off the stream and hangs on it until `release` is set: a manager that has read some of what
    was written and dies there."""

    def __init__(self, read_batches: int) -> None:
        super().__init__(None, EwmaMarginForecaster(), forecast_interval_s=0.05, min_samples=10**9,
                         windows=WindowStore(max_samples=100_000))
        self.read_batches = read_batches
        self.release = asyncio.Event()
        self.stalled = asyncio.Event()

    async def ingest_async(self, batch: ingest_pb2.SignatureBatch,
                           stream: StreamState | None = None) -> ingest_pb2.IngestReply:
        if self.stats.batches >= self.read_batches and not self.release.is_set():
            self.stalled.set()
            await self.release.wait()
        return await super().ingest_async(batch, stream)


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
    got = _seqs(manager)
    dropped = manager.stats.dropped_by_profilers
    # every signature made is in the manager or counted as dropped, none windowed twice, none made up;
    # a dropped one may be in the manager too when it had been written before the outage and read
    # without its reply getting through (at most `dropped_written` of them)
    assert got == sorted(set(got)) and set(got) <= set(range(1, source.emitted + 1))
    in_both = len(got) + dropped - source.emitted
    assert 0 <= in_both <= streamer.stats.dropped_written, (len(got), dropped, source.emitted)
    # and what was lost is one run of the oldest signatures of the outage: a single gap
    gaps = [(a, b) for a, b in zip(got, got[1:], strict=False) if b != a + 1]
    assert len(gaps) == 1 and gaps[0][1] - gaps[0][0] - 1 == dropped - in_both
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
            before, after = _seqs(first, f"app{i}"), _seqs(second, f"app{i}")
            assert after[-1] > before[-1]  # numbering goes on
            # what the first had not acknowledged went to the second: nothing lost in between
            assert after[0] <= before[-1] + 1 and set(before) | set(after) == set(range(1, after[-1] + 1))
        assert second.stats.rejected == 0 and second.stats.out_of_order == 0


async def test_abrupt_manager_stops_lose_nothing_uncounted(tmp_path: Path) -> None:
    """Servers stopped with no grace while big batches are in flight, five times: every signature made
    still lands in the manager's window exactly once (what was cut off unread is sent again, what the
    manager had read is dropped as a duplicate) and none is rejected. Robust by construction: each
    step waits for a state, not for time; the source stops producing before the end, and the end is
    reached once every signature is acknowledged."""
    manager = _manager(windows=WindowStore(max_samples=1_000_000))
    source = CountingSource("app", per_tick=200)
    async with Link(tmp_path, manager, lambda a: [_streamer(source, a, buffer_max=100_000, profiler_id="p1")]) as link:
        (streamer,) = link.streamers
        await until(lambda: manager.stats.accepted >= 200, 30.0)
        for _ in range(5):
            sent = streamer.stats.batches_sent
            await until(lambda s=sent: streamer.stats.batches_sent >= s + 2, 30.0)  # batches in flight
            await link.stop_server(None)  # no grace: in-flight batches are cut off
            await until(lambda: not streamer.connected, 30.0)
            read = manager.stats.batches
            await link.start_server()  # the same manager: a socket outage
            await until(lambda r=read: streamer.connected and manager.stats.batches > r, 30.0)
        source.per_tick = 0  # no more signatures; everything made must now get through
        await until(lambda: not streamer.buffer and streamer.unacked == 0, 30.0)
    assert streamer.stats.disconnects == 5 and streamer.stats.dropped_total == 0
    assert _seqs(manager) == list(range(1, source.emitted + 1))
    assert manager.stats.accepted == source.emitted
    assert manager.stats.out_of_order == manager.stats.rejected == streamer.stats.rejected == 0
    # a duplicate needs a resend; `resent` also counts rewrites of writes that failed (and may have gone out)
    assert manager.stats.duplicates <= streamer.stats.resent
    assert source.emitted <= streamer.stats.signatures_sent <= source.emitted + streamer.stats.resent


@pytest.mark.parametrize("restarted", [False, True], ids=["same-manager", "restarted-manager"])
async def test_a_manager_that_read_only_some_batches_loses_none(tmp_path: Path, restarted: bool) -> None:
    """The manager windows 3 batches, takes a 4th off the stream and hangs; the profiler has written
    more. No reply went out (quiet batches are answered once an hour here), so when the server dies
    everything written is unacknowledged and is sent again: the same manager drops exactly what the 3
    batches it had brought as duplicates, quietly; a restarted one takes everything."""
    first = StallingManager(read_batches=3)
    source = CountingSource("app", per_tick=5)
    async with Link(tmp_path, first, lambda a: [_streamer(source, a, buffer_max=1000, profiler_id="p1")],
                    ack_interval_s=3600.0) as link:
        (streamer,) = link.streamers
        await until(lambda: first.stalled.is_set() and streamer.stats.batches_sent >= 6)
        had = len(_seqs(first))
        assert first.stats.batches == 3 and _seqs(first) == list(range(1, had + 1)) and streamer.stats.acked == 0
        await link.stop_server(None)  # the manager dies
        await until(lambda: not streamer.connected)
        assert streamer.unacked == 0 and streamer.stats.disconnects == 1  # all put back for a resend
        first.release.set()
        second = StallingManager(read_batches=10**9) if restarted else first
        second.windows = WindowStore(max_samples=100_000) if restarted else first.windows
        await link.start_server(second)
        await until(lambda: streamer.stats.resent > 0 and len(_seqs(second)) >= 40)
        source.per_tick = 0
        await until(lambda: not streamer.buffer and _seqs(second)[-1:] == [source.emitted])
    assert streamer.unacked == 0 and streamer.stats.acked == source.emitted  # the last reply, at the end
    assert _seqs(second) == list(range(1, source.emitted + 1))  # each exactly once
    assert second.stats.duplicates == (0 if restarted else had)
    assert second.stats.accepted == source.emitted  # the same manager: `had` before, the rest after
    assert second.stats.rejected == second.stats.out_of_order == streamer.stats.rejected == 0
    assert streamer.stats.dropped_total == 0 and streamer.stats.resent > had


async def test_resends_stay_within_the_bound_and_what_it_drops_is_counted(tmp_path: Path) -> None:
    """No reply comes (quiet batches answered once an hour), so the unacknowledged queue fills the
    buffer of 40 and the oldest written signatures are let go: counted as dropped only when the
    manager then dies without acknowledging them. The restarted manager gets the rest, and the count."""
    first = StallingManager(read_batches=10**9)
    source = CountingSource("app", per_tick=5)
    async with Link(tmp_path, first, lambda a: [_streamer(source, a, buffer_max=40, profiler_id="p1")],
                    ack_interval_s=3600.0) as link:
        (streamer,) = link.streamers
        await until(lambda: streamer.stats.unacked_dropped >= 20)
        assert streamer.unacked + len(streamer.buffer) <= 40 and streamer.stats.dropped_total == 0
        await link.stop_server(None)
        await until(lambda: not streamer.connected)
        assert len(streamer.buffer) <= 40 and streamer.stats.dropped_total == streamer.stats.unacked_dropped
        second = StallingManager(read_batches=10**9)
        await link.start_server(second)
        await until(lambda: streamer.stats.resent > 0)
        source.per_tick = 0
        await until(lambda: not streamer.buffer and _seqs(second)[-1:] == [source.emitted])
    got = _seqs(second)
    dropped = streamer.stats.dropped_total
    assert dropped >= 20 and second.stats.dropped_by_profilers == dropped
    assert streamer.stats.dropped_written == dropped  # every one of them had been written once
    assert got == list(range(dropped + 1, source.emitted + 1))  # the oldest went, the rest arrived once
    assert second.stats.rejected == second.stats.out_of_order == 0


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
