"""The streamer: fixed-rate deadlines, backoff, the bounded buffer, reconnecting to a real grpc.aio server."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np
import pytest
import structlog
from manager_fakes import EwmaMarginForecaster

from tests.profiler_fakes import ManualClock, RecordingLogger
from vgpu.allocator.service import build_server
from vgpu.client import grpc_target
from vgpu.manager.core import Manager
from vgpu.manager.service import IngestServicer
from vgpu.profiler.main import main as profiler_main
from vgpu.profiler.stream import Backoff, FixedRateLoop, FixedRateSchedule, SignatureStreamer
from vgpu.traces import AppTrace, write_trace
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc, signature_pb2

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """main() binds structlog to the stderr of the moment (pytest's capture, closed after the test)."""
    yield
    structlog.reset_defaults()


# --- deadlines -------------------------------------------------------------------------------------


def test_schedule_on_time_and_late() -> None:
    s = FixedRateSchedule(0.1, start_s=10.0)
    assert s.next(10.0) == (0, 10.0, 0)
    assert s.next(10.05) == (1, pytest.approx(10.1), 0)  # early: wait for 10.1
    k, deadline, skipped = s.next(10.13)  # 30 ms late: still tick 2, not skipped
    assert (k, skipped) == (2, 0) and deadline == pytest.approx(10.2)
    k, deadline, skipped = s.next(10.57)  # tick 3 was due at 10.3: 3, 4 missed, run 5 at once
    assert (k, skipped) == (5, 2) and deadline == pytest.approx(10.5)
    assert s.next(10.58)[0] == 6
    with pytest.raises(ValueError):
        FixedRateSchedule(0.0, 0.0)


async def test_loop_keeps_deadlines_and_counts_late_ticks_without_bunching() -> None:
    clock = ManualClock(1000.0)
    slept: list[float] = []

    async def sleep(dt: float) -> None:
        slept.append(dt)
        clock.advance(dt)

    ran: list[tuple[int, float]] = []

    async def tick(k: int) -> None:
        ran.append((k, clock()))
        clock.advance(0.02)  # work takes 20 ms
        if k == 3:
            clock.advance(0.33)  # one slow tick: 350 ms in all

    loop = FixedRateLoop(0.1, clock=clock, sleep=sleep)
    stats = await loop.run(tick, asyncio.Event(), max_ticks=8)
    ks = [k for k, _ in ran]
    assert ks == [0, 1, 2, 3, 6, 7, 8, 9]  # 4 and 5 skipped, not run back to back
    assert stats.late_ticks == 2 and stats.ticks == 8
    for k, t in ran:
        if k != 6:
            assert t == pytest.approx(1000.0 + 0.1 * k)  # on the grid, no drift from the 20 ms of work
    assert ran[4][1] == pytest.approx(1000.0 + 0.3 + 0.35)  # tick 6 (due 1000.6) ran at once when found late
    assert all(dt == pytest.approx(0.08) for dt in slept[:3])


async def test_loop_stops_on_event() -> None:
    clock = ManualClock()
    stop = asyncio.Event()

    async def sleep(dt: float) -> None:
        clock.advance(dt)

    async def tick(k: int) -> None:
        if k == 4:
            stop.set()

    stats = await FixedRateLoop(0.1, clock=clock, sleep=sleep).run(tick, stop)
    assert stats.ticks == 5


# --- backoff ---------------------------------------------------------------------------------------


def test_backoff_grows_is_capped_and_jittered() -> None:
    b = Backoff(initial_s=0.1, max_s=2.0, multiplier=2.0, jitter=0.2)
    rng = random.Random(7)
    delays = [b.delay_s(n, rng) for n in range(10)]
    for n, d in enumerate(delays[:4]):
        base = 0.1 * 2**n
        assert 0.8 * base <= d <= 1.2 * base
    assert all(1.6 <= d <= 2.0 for d in delays[5:])
    assert len(set(delays)) == len(delays)  # jitter: no two attempts in lockstep
    assert Backoff(jitter=0.0).delay_s(1000, rng) == 5.0
    with pytest.raises(ValueError):
        Backoff(initial_s=0.0)


# --- the bounded buffer ---------------------------------------------------------------------------


def _sig(app: str, seq: int) -> signature_pb2.BehavioralSignature:
    return signature_pb2.BehavioralSignature(app_id=app, seq=seq)


class ListSource:
    """Hands out `per_tick` new signatures each call; seq numbers count up."""

    def __init__(self, per_tick: int = 2) -> None:
        self.per_tick = per_tick
        self.n = 0
        self.closed = False

    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        out = []
        for _ in range(self.per_tick):
            self.n += 1
            out.append(_sig("a", self.n))
        return out

    def close(self) -> None:
        self.closed = True


def test_buffer_drops_oldest_and_counts() -> None:
    s = SignatureStreamer(ListSource(), "unix:///nowhere.sock", buffer_max=5)
    s.enqueue([_sig("a", i) for i in range(1, 4)])
    s.enqueue([_sig("a", i) for i in range(4, 9)])
    assert [x.seq for x in s.buffer] == [4, 5, 6, 7, 8]
    assert s.dropped_since_last == 3 and s.stats.dropped_total == 3


# --- at-least-once: the unacknowledged queue ---------------------------------------------------------


class _TakingCall:
    """A stream that takes every write (no server): the batches written, in order."""

    def __init__(self) -> None:
        self.written: list[ingest_pb2.SignatureBatch] = []

    async def write(self, batch: ingest_pb2.SignatureBatch) -> None:
        self.written.append(batch)


def _on(call: _TakingCall, **kw: Any) -> SignatureStreamer:
    s = SignatureStreamer(ListSource(), "unix:///nowhere.sock", logger=RecordingLogger(), **kw)  # type: ignore[arg-type]
    s._call = call  # type: ignore[assignment]
    return s


def _seqs(sigs: Iterable[signature_pb2.BehavioralSignature]) -> list[int]:
    return [x.seq for x in sigs]


def _range(first: int, last: int) -> list[signature_pb2.BehavioralSignature]:
    return [_sig("a", i) for i in range(first, last + 1)]


async def test_a_reply_acknowledges_every_batch_up_to_its_tick_and_frees_them() -> None:
    s = _on(_TakingCall())
    for k in (1, 2, 3):
        s.enqueue(_range(2 * k - 1, 2 * k))
        await s._send(k)
    assert s.unacked == 6 and not s.buffer and s.stats.acked == 0
    s._acknowledge(2)  # one reply covers every batch up to its tick
    assert s.unacked == 2 and s.stats.acked == 4
    s._acknowledge(2)
    assert s.unacked == 2 and s.stats.acked == 4
    s._acknowledge(9)
    assert s.unacked == 0 and s.stats.acked == 6
    assert s._put_back() == 0 and not s.buffer  # nothing acknowledged is ever sent again


async def test_a_broken_stream_puts_the_unacknowledged_back_in_front_in_order() -> None:
    s = _on(_TakingCall())
    s.enqueue(_range(1, 2))
    await s._send(1)
    s.enqueue(_range(3, 4))
    await s._send(2)
    s._acknowledge(1)
    s.enqueue(_range(5, 6))  # pending, never written
    assert s._put_back() == 2
    assert _seqs(s.buffer) == [3, 4, 5, 6] and s.unacked == 0
    again = _TakingCall()
    s._call = again  # type: ignore[assignment]
    await s._send(3)
    assert _seqs(again.written[0].signatures) == [3, 4, 5, 6]
    assert (s.stats.resent, s.stats.signatures_sent, s.unacked) == (2, 8, 4)


@pytest.mark.parametrize("fails", [False, True], ids=["write-returns", "write-raises"])
async def test_a_write_under_way_when_the_stream_breaks_is_held_and_sent_again(fails: bool) -> None:
    s = _on(_TakingCall())

    class Breaking(_TakingCall):
        async def write(self, batch: ingest_pb2.SignatureBatch) -> None:
            s._mark_lost()  # the stream breaks while this write is under way: it may or may not go out
            await asyncio.sleep(0)
            if fails:
                raise grpc.aio.UsageError("the call is done")
            await super().write(batch)

    s._call = Breaking()  # type: ignore[assignment]
    s.enqueue(_range(1, 3))
    send = asyncio.create_task(s._send(1))
    await asyncio.sleep(0)  # the write is under way: the connection task puts back only after it
    async with s._sending:
        assert send.done() and s.unacked == 3 and not s.buffer
        assert s._put_back() == 3
    assert _seqs(s.buffer) == [1, 2, 3] and s.stats.batches_sent == (0 if fails else 1)
    again = _TakingCall()
    s._call = again  # type: ignore[assignment]
    await s._send(2)
    assert _seqs(again.written[0].signatures) == [1, 2, 3] and s.stats.resent == 3


async def test_a_drop_report_goes_again_when_its_batch_was_not_acknowledged() -> None:
    call = _TakingCall()
    s = _on(call, buffer_max=3)
    s.enqueue(_range(1, 5))  # 2 dropped
    await s._send(1)
    assert call.written[-1].dropped_since_last == 2 and s.dropped_since_last == 0
    s._put_back()
    assert s.dropped_since_last == 2 and s.stats.dropped_total == 2  # reported again, not dropped again
    await s._send(2)
    assert call.written[-1].dropped_since_last == 2
    s._acknowledge(2)
    s._put_back()
    assert s.dropped_since_last == 0


async def test_a_batch_with_only_a_drop_report_is_held_until_acknowledged() -> None:
    call = _TakingCall()
    s = _on(call, max_batch_bytes=1024)
    s.enqueue([signature_pb2.BehavioralSignature(app_id="h" * 2000, seq=1)])  # too big to send: dropped
    await s._send(1)
    assert len(call.written[-1].signatures) == 0 and call.written[-1].dropped_since_last == 1
    s._put_back()
    assert s.dropped_since_last == 1
    await s._send(2)
    s._acknowledge(2)
    s._put_back()
    assert s.dropped_since_last == 0


@pytest.mark.parametrize("then", ["acknowledged", "broken"])
async def test_the_bound_holds_unacknowledged_and_pending_together(then: str) -> None:
    s = _on(_TakingCall(), buffer_max=5)
    s.enqueue(_range(1, 4))
    await s._send(1)
    s.enqueue(_range(5, 7))  # 7 held: the 2 oldest, written and unacknowledged, are let go
    assert s.unacked == 2 and _seqs(s.buffer) == [5, 6, 7]
    assert s.stats.unacked_dropped == 2 and s.stats.dropped_total == 0 and s.dropped_since_last == 0
    s.enqueue(_range(8, 10))  # 3 over: the last 2 unacknowledged, then the oldest pending
    assert s.unacked == 0 and _seqs(s.buffer) == [6, 7, 8, 9, 10]
    assert (s.stats.unacked_dropped, s.stats.dropped_total, s.dropped_since_last) == (4, 1, 1)
    if then == "acknowledged":  # they were delivered after all: not lost, not reported
        s._acknowledge(1)
        assert s._put_back() == 0 and s.stats.acked == 4
        assert (s.stats.dropped_total, s.dropped_since_last, s.stats.dropped_written) == (1, 1, 0)
    else:  # their stream broke first: they may be lost, and now count as dropped
        assert s._put_back() == 0
        assert (s.stats.dropped_total, s.dropped_since_last, s.stats.dropped_written) == (5, 5, 4)
    assert len(s.buffer) + s.unacked <= 5


async def test_signatures_put_back_and_then_dropped_count_as_written_before() -> None:
    s = _on(_TakingCall(), buffer_max=4)
    s.enqueue(_range(1, 3))
    await s._send(1)
    s._call = None
    s._put_back()  # 1, 2, 3 wait for the reconnect
    s.enqueue(_range(4, 6))  # the outage goes on: 1 and 2 go
    assert _seqs(s.buffer) == [3, 4, 5, 6]
    assert (s.stats.dropped_total, s.stats.dropped_written) == (2, 2)
    s.enqueue(_range(7, 8))  # then 3 (written before) and 4 (never written)
    assert (s.stats.dropped_total, s.stats.dropped_written) == (4, 3)
    again = _TakingCall()
    s._call = again  # type: ignore[assignment]
    await s._send(2)
    assert _seqs(again.written[0].signatures) == [5, 6, 7, 8] and s.stats.resent == 0


def test_bad_target_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="host:port"):
        SignatureStreamer(ListSource(), "no-port-here")
    assert grpc_target("/run/vgpu/manager.sock") == "unix:///run/vgpu/manager.sock"
    assert grpc_target("127.0.0.1:7070") == "127.0.0.1:7070"
    assert grpc_target("unix:///x.sock") == "unix:///x.sock"


# --- against a real grpc.aio server on a Unix socket ------------------------------------------------


class IngestRecorder(ingest_pb2_grpc.IngestServicer):
    def __init__(self) -> None:
        self.batches: list[ingest_pb2.SignatureBatch] = []
        self.metadata: list[dict[str, str]] = []  # each stream's call metadata
        self.got = asyncio.Event()

    async def StreamSignatures(self, request_iterator, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.metadata.append({k: v for k, v in context.invocation_metadata() or ()})
        async for batch in request_iterator:
            self.batches.append(batch)
            self.got.set()
            decision = ingest_pb2.Decision(app_id="a", recommended_mem_mib=1.0)
            yield ingest_pb2.IngestReply(tick=batch.tick, accepted=len(batch.signatures), decisions=[decision])

    def seqs(self) -> list[int]:
        return [s.seq for b in self.batches for s in b.signatures]


async def start_server(sock: Path, servicer: ingest_pb2_grpc.IngestServicer) -> grpc.aio.Server:
    server = grpc.aio.server()
    ingest_pb2_grpc.add_IngestServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    await server.start()
    return server


async def wait_for(pred, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    # generous: it ends as soon as `pred()` holds, and a loaded machine can take seconds for it
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_streams_reconnects_with_backoff_and_reports_drops(tmp_path: Path) -> None:
    sock = tmp_path / "manager.sock"
    first = IngestRecorder()
    server = await start_server(sock, first)
    backoff_delays: list[float] = []

    async def backoff_sleep(dt: float) -> None:
        backoff_delays.append(dt)
        await asyncio.sleep(0.01)  # real waits kept short; the requested delays are what is checked

    replies: list[ingest_pb2.IngestReply] = []
    source = ListSource(per_tick=2)
    streamer = SignatureStreamer(
        source,
        f"unix://{sock}",
        period_s=0.02,
        buffer_max=12,
        backoff=Backoff(initial_s=0.05, max_s=0.4, jitter=0.1),
        backoff_sleep=backoff_sleep,
        rng=random.Random(1),
        connect_timeout_s=0.2,
        on_reply=replies.append,
        profiler_id="test-profiler",
    )
    task = asyncio.create_task(streamer.run())
    try:
        await wait_for(lambda: len(first.batches) >= 3 and replies)
        assert first.batches[0].profiler_id == "test-profiler"
        assert streamer.stats.decisions >= 1

        await server.stop(grace=None)  # the manager goes away
        await wait_for(lambda: not streamer.connected)
        # 2 per tick into a buffer of 12; what the first manager had not acknowledged was put back in
        # front, so it is among the oldest and goes first: wait until it has all gone
        await wait_for(lambda: streamer.stats.dropped_total >= 10 and streamer._resend_left == 0)
        assert len(streamer.buffer) == 12
        await wait_for(lambda: len(backoff_delays) >= 4)
        # capped exponential: each attempt waits about twice the one before, up to max_s
        assert backoff_delays[1] > backoff_delays[0] * 1.5 and backoff_delays[2] > backoff_delays[1] * 1.5
        assert max(backoff_delays) <= 0.4

        second = IngestRecorder()
        server = await start_server(sock, second)
        await wait_for(lambda: len(second.batches) >= 2)
        reconnect_batch = second.batches[0]
        dropped_reported = reconnect_batch.dropped_since_last
        assert dropped_reported >= 10
        assert sum(b.dropped_since_last for b in second.batches) == streamer.stats.dropped_total
        # oldest dropped first: what was kept is the newest, in order, with no gap after the drops
        got = [s.seq for s in reconnect_batch.signatures]
        assert got == sorted(got) and got[-1] - got[0] == len(got) - 1
        assert got[0] > first.seqs()[-1] + 1
        assert streamer.stats.connects == 2
    finally:
        streamer.stop()
        await asyncio.wait_for(task, 5.0)
        await server.stop(grace=None)
    # nothing sent twice (what would have been resent was dropped in the outage), nothing out of order
    all_seqs = first.seqs() + second.seqs()
    assert all_seqs == sorted(set(all_seqs)) and streamer.stats.resent == 0


async def test_starts_while_manager_is_down_and_source_errors_do_not_stop_it(tmp_path: Path) -> None:
    sock = tmp_path / "m.sock"

    class Flaky(ListSource):
        def sample(self) -> list[signature_pb2.BehavioralSignature]:
            if self.n % 3 == 1:
                self.n += 1
                raise RuntimeError("bad tick")
            return super().sample()

    streamer = SignatureStreamer(
        Flaky(per_tick=1), f"unix://{sock}", period_s=0.02, backoff=Backoff(initial_s=0.02, max_s=0.05),
        connect_timeout_s=0.1,
    )
    task = asyncio.create_task(streamer.run())
    await asyncio.sleep(0.2)
    assert streamer.stats.connect_failures >= 1 and not streamer.connected
    rec = IngestRecorder()
    server = await start_server(sock, rec)
    try:
        await wait_for(lambda: len(rec.seqs()) >= 5)
        assert streamer.stats.source_errors >= 1
    finally:
        streamer.stop()
        await asyncio.wait_for(task, 5.0)
        await server.stop(grace=None)


class ValidSource(ListSource):
    """Signatures the manager accepts."""

    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        out = super().sample()
        for x in out:
            x.device_id, x.pid, x.timestamp_s = "GPU-0", 1, 1.7e9 + x.seq * 0.01
            x.process.gpu_mem_used_mib = 100.0
        return out


class SilentIngest(ingest_pb2_grpc.IngestServicer):
    """Reads every batch and never answers, not even when the profiler ends the stream."""

    def __init__(self) -> None:
        self.batches = 0

    async def StreamSignatures(self, request_iterator, context):  # type: ignore[no-untyped-def]  # noqa: N802
        async for _ in request_iterator:
            self.batches += 1
        await asyncio.Event().wait()
        yield ingest_pb2.IngestReply()  # pragma: no cover - never reached


async def test_a_clean_end_waits_for_the_last_reply_so_everything_is_acknowledged(tmp_path: Path) -> None:
    address = f"unix:{tmp_path}/m.sock"
    manager = Manager(None, EwmaMarginForecaster(), min_samples=10**9)  # no decisions: no early replies
    server = build_server(address, ingest_servicer=IngestServicer(manager, ack_interval_s=3600.0))
    await server.start()
    streamer = SignatureStreamer(ValidSource(per_tick=2), address, period_s=0.01, profiler_id="p")
    task = asyncio.create_task(streamer.run())
    try:
        # the streamer counts a batch as sent after its write returns, which may be after the
        # manager has taken it: wait for both sides
        await wait_for(lambda: manager.stats.accepted >= 10 and streamer.unacked >= 10)
        assert streamer.stats.acked == 0  # no reply yet: all held
        streamer.stop()
        stats = await asyncio.wait_for(task, 5.0)
    finally:
        await server.stop(0)
    assert streamer.unacked == 0 and stats.acked == stats.signatures_sent == manager.stats.accepted


async def test_a_clean_end_waits_a_bounded_time_for_a_reply_that_never_comes(tmp_path: Path) -> None:
    sock = tmp_path / "m.sock"
    silent = SilentIngest()
    server = await start_server(sock, silent)
    log = RecordingLogger()
    streamer = SignatureStreamer(ListSource(per_tick=2), f"unix://{sock}", period_s=0.01, final_ack_timeout_s=0.2,
                                 logger=log)  # type: ignore[arg-type]
    task = asyncio.create_task(streamer.run())
    try:
        await wait_for(lambda: silent.batches >= 3)
        streamer.stop()
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(task, 5.0)
        waited = asyncio.get_running_loop().time() - t0
    finally:
        await server.stop(None)
    assert waited < 1.0 and streamer.unacked > 0 and streamer.stats.acked == 0
    (stopped,) = log.matching("profiler stream stopped")
    assert stopped[2]["unacked"] == streamer.unacked


async def test_a_resend_is_logged_once_per_reconnect(tmp_path: Path) -> None:
    sock = tmp_path / "m.sock"
    silent = SilentIngest()
    server = await start_server(sock, silent)
    log = RecordingLogger()
    streamer = SignatureStreamer(ListSource(per_tick=3), f"unix://{sock}", period_s=0.01, logger=log,  # type: ignore[arg-type]
                                 backoff=Backoff(initial_s=0.01, max_s=0.02), connect_timeout_s=0.2,
                                 final_ack_timeout_s=0.05)
    task = asyncio.create_task(streamer.run())
    try:
        await wait_for(lambda: silent.batches >= 4)
        await server.stop(None)
        await wait_for(lambda: streamer.stats.disconnects == 1)
        server = await start_server(sock, silent)
        await wait_for(lambda: streamer.stats.resent > 0 and streamer.connected)
    finally:
        streamer.stop()
        await asyncio.wait_for(task, 5.0)
        await server.stop(None)
    (lost,) = log.matching("lost the manager stream")
    assert lost[2]["resending"] >= 12  # every signature of the 4 batches, in one line
    assert streamer.stats.resent == lost[2]["resending"]


# --- `vgpu profiler` ---------------------------------------------------------------------------------


def _small_trace(path: Path) -> Path:
    t = np.arange(0.0, 3.0, 0.1)
    write_trace(
        path,
        [
            AppTrace("a", t, {"mem_used_mib": 100 + t, "sm_util_pct": np.full(len(t), 50.0)}),
            AppTrace("b", t, {"mem_used_mib": 200 + t, "sm_util_pct": np.full(len(t), 20.0)}),
        ],
    )
    return path


async def test_main_replays_a_trace_to_the_manager(tmp_path: Path) -> None:
    sock = tmp_path / "m.sock"
    rec = IngestRecorder()
    server = await start_server(sock, rec)
    trace = _small_trace(tmp_path / "t.csv")
    token_file = tmp_path / "profiler.token"
    token_file.write_text("vgpu1.cHJvZmlsZXI.abc\n")
    try:
        argv = ["--manager", str(sock), "--replay", str(trace), "--speed", "10", "--seconds", "0.6",
                "--token-file", str(token_file), "--device-id", "GPU-x", "--log-format", "console",
                "--log-level", "warning"]
        rc = await asyncio.to_thread(profiler_main, argv, "vgpu profiler")
    finally:
        await server.stop(grace=None)
    assert rc == 0
    apps = {s.app_id for b in rec.batches for s in b.signatures}
    assert apps == {"a", "b"}
    assert {s.device_id for b in rec.batches for s in b.signatures} == {"GPU-x"}
    assert len(rec.seqs()) == 60  # the whole 3 s trace at 10x in 0.6 s
    # the token goes with the stream as call metadata
    assert rec.metadata and all(md.get("authorization") == "Bearer vgpu1.cHJvZmlsZXI.abc" for md in rec.metadata)


def test_main_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        profiler_main(["--manager", "nonsense"], "vgpu profiler")
    assert exc.value.code == 2
    assert "host:port" in capsys.readouterr().err
    rc = profiler_main(["--manager", "/x.sock", "--no-token", "--replay", str(tmp_path / "missing.csv")], "vgpu profiler")
    assert rc == 1 and "no such file" in capsys.readouterr().err
    rc = profiler_main(["--manager", "/x.sock", "--no-token", "--backend", "bogus"], "vgpu profiler")
    assert rc == 1 and "cannot open backend 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profiler_main(["--manager", "/x.sock", "--backend", "sim:h100-80gb", "--device-id", "GPU-x"], "vgpu profiler")
    assert "--device-id only applies to --replay" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "", "   \n"])
def test_main_without_a_readable_token_stops_with_a_clear_error(
    content: str | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token_file = tmp_path / "profiler.token"
    if content is not None:
        token_file.write_text(content)
    trace = _small_trace(tmp_path / "t.csv")
    rc = profiler_main(["--manager", "/x.sock", "--replay", str(trace), "--token-file", str(token_file)], "vgpu profiler")
    err = capsys.readouterr().err
    assert rc == 2
    assert str(token_file) in err and ("cannot read" if content is None else "is empty") in err
    assert "--no-token" in err


def test_the_default_token_file_is_the_daemons_profiler_token() -> None:
    from vgpu import config
    from vgpu.client import default_socket
    from vgpu.profiler.main import build_parser

    ns = build_parser("vgpu profiler").parse_args([])
    assert ns.token_file == Path(config.Config().server.state_dir) / "tokens" / "profiler.token"
    # no --manager: the node's socket, found at start as the stub finds it (the built-in one on a bare node)
    assert ns.manager is None
    assert default_socket({}, Path("/nonexistent/vgpu.toml")) == "unix://" + config.Config().server.socket


async def test_sigterm_stops_the_profiler_gracefully(tmp_path: Path) -> None:
    sock = tmp_path / "m.sock"
    rec = IngestRecorder()
    server = await start_server(sock, rec)
    trace = _small_trace(tmp_path / "t.csv")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{sock}", "--replay", str(trace), "--loop",
         "--no-token"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        await asyncio.wait_for(rec.got.wait(), 20.0)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 10)
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
        await server.stop(grace=None)
    assert rc == 0, err.decode()
    assert b"profiler stream stopped" in err
