"""The streamer: fixed-rate deadlines, backoff, the bounded buffer, reconnecting to a real grpc.aio server."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import pytest
import structlog

from profiler.main import main as profiler_main
from profiler.stream import Backoff, FixedRateLoop, FixedRateSchedule, SignatureStreamer
from tests.profiler_fakes import ManualClock
from vgpu.client import grpc_target
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


async def start_server(sock: Path, servicer: IngestRecorder) -> grpc.aio.Server:
    server = grpc.aio.server()
    ingest_pb2_grpc.add_IngestServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    await server.start()
    return server


async def wait_for(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
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
        await wait_for(lambda: streamer.stats.dropped_total >= 10)  # 2 per tick into a buffer of 12
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
    # nothing sent twice, nothing out of order
    all_seqs = first.seqs() + second.seqs()
    assert all_seqs == sorted(set(all_seqs))


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
    from profiler.main import build_parser
    from vgpu import config

    ns = build_parser("vgpu profiler").parse_args([])
    assert ns.token_file == Path(config.Config().server.state_dir) / "tokens" / "profiler.token"
    assert ns.manager == "unix://" + config.Config().server.socket


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
