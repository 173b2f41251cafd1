"""Bad input on the manager's Ingest stream, over a real Unix-socket gRPC server: malformed signatures
(rejected one by one with a reason, the stream goes on), out-of-order ones, bytes that are no
SignatureBatch at all, and messages over the server's receive limit (a clean error, and the server
keeps serving). And input that is not bad: a profiler's resend of signatures the manager already
has (dropped quietly as duplicates, rows and columns, the rest of the batch answered as sent)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from manager_fakes import EwmaMarginForecaster
from structlog.testing import capture_logs

from vgpu import config as vconfig
from vgpu.allocator.service import build_server
from vgpu.manager.core import Manager
from vgpu.manager.service import IngestServicer
from vgpu.manager.window import WindowStore, sample_from_signature
from vgpu.profiler.stream import SignatureStreamer
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import columns_from_signatures

GPU = "GPU-ingest-0"
METHOD = "/vgpu.v1.Ingest/StreamSignatures"
GRPC_DEFAULT_MAX_RECEIVE = 4 * 1024 * 1024


def sig(app: str = "a", seq: int = 1, t: float = 1.7e9, **process: float) -> spb.BehavioralSignature:
    s = spb.BehavioralSignature(app_id=app, pid=7, device_id=GPU, timestamp_s=t + seq * 0.1, seq=seq)
    s.process.gpu_mem_used_mib = process.get("mem", 1000.0)
    s.process.sm_util_pct = process.get("sm", 20.0)
    return s


@pytest.fixture
async def ingest(tmp_path: Path) -> AsyncIterator[tuple[str, Manager]]:
    manager = Manager(None, EwmaMarginForecaster(), forecast_interval_s=0.05, min_samples=2)
    address = f"unix:{tmp_path}/m.sock"
    server = build_server(address, ingest_servicer=IngestServicer(manager))
    await server.start()
    try:
        yield address, manager
    finally:
        await server.stop(0)


async def _exchange(address: str, batches: list[ingest_pb2.SignatureBatch]) -> list[ingest_pb2.IngestReply]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        replies = []
        for b in batches:
            await call.write(b)
            replies.append(await call.read())
        await call.done_writing()
        return replies


async def _send_garbage(ch: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    """Write bytes that are no SignatureBatch on a raw stream; the error the stream ends with."""
    call = ch.stream_stream(METHOD, request_serializer=None, response_deserializer=ingest_pb2.IngestReply.FromString)()
    await call.write(b"\xff\xff\xff\xff garbage")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    return err.value


MALFORMED: list[tuple[Callable[[spb.BehavioralSignature], None], str]] = [
    (lambda s: setattr(s, "app_id", ""), "app_id is empty"),
    (lambda s: setattr(s, "app_id", "x" * 300), "at most 256"),
    (lambda s: setattr(s, "device_id", ""), "device_id is empty"),
    (lambda s: setattr(s, "seq", 0), "seq is 0"),
    (lambda s: setattr(s, "timestamp_s", math.inf), "timestamp_s"),
    (lambda s: setattr(s, "timestamp_s", -5.0), "timestamp_s"),
    (lambda s: setattr(s.process, "gpu_mem_used_mib", math.nan), "process.gpu_mem_used_mib is not a finite number"),
    (lambda s: setattr(s.process, "gpu_mem_used_mib", -1.0), "negative"),
    (lambda s: setattr(s.process, "sm_util_pct", 250.0), "outside 0-100"),
    (lambda s: setattr(s.device, "mem_bw_util_pct", 101.0), "outside 0-100"),
    (lambda s: setattr(s.host, "cpu_pct", -math.inf), "host.cpu_pct"),
]


@pytest.mark.parametrize(("mutate", "reason"), MALFORMED)
async def test_a_malformed_signature_is_rejected_with_its_reason_and_the_stream_goes_on(
    ingest: tuple[str, Manager], mutate: Callable[[spb.BehavioralSignature], None], reason: str
) -> None:
    address, manager = ingest
    bad = sig("bad", 1)
    mutate(bad)
    first = ingest_pb2.SignatureBatch(tick=1, signatures=[sig("a", 1), bad, sig("a", 2)])
    second = ingest_pb2.SignatureBatch(tick=2, signatures=[sig("a", 3)])
    r1, r2 = await _exchange(address, [first, second])
    assert r1.accepted == 2 and len(r1.rejected) == 1
    assert r1.rejected[0].index == 1 and reason in r1.rejected[0].reason
    assert len(r1.rejected[0].app_id) <= 256
    assert r2.accepted == 1 and not r2.rejected  # same stream, still serving
    assert [s.seq for s in manager.windows.window("a").samples] == [1, 2, 3]


async def test_a_bad_inapp_value_is_dropped_alone_and_counted_and_the_signature_kept(
        ingest: tuple[str, Manager]) -> None:
    """An in-app counter is the application's word about itself: a bad one (here NaN, which a
    profiler never sends as a value) costs only itself, not the sample's NVML counters."""
    address, manager = ingest
    bad = sig("bad", 1)
    bad.in_app.torch_reserved_mib = math.nan
    bad.in_app.requests_running = 4
    (reply,) = await _exchange(address, [ingest_pb2.SignatureBatch(tick=1, signatures=[sig("a", 1), bad])])
    assert reply.accepted == 2 and not reply.rejected
    assert manager.stats.inapp_dropped == {"in_app.torch_reserved_mib dropped: not finite": 1}
    (kept,) = manager.windows.window("bad").samples
    assert math.isnan(kept.get("inapp_torch_reserved_mib")) and kept.get("inapp_requests_running") == 4.0


async def test_out_of_order_signatures_are_not_windowed_and_the_stream_survives(ingest: tuple[str, Manager]) -> None:
    address, manager = ingest
    t = 1.7e9
    batches = [
        ingest_pb2.SignatureBatch(tick=1, signatures=[sig("a", 5, t), sig("a", 3, t), sig("a", 5, t), sig("a", 6, t)]),
        ingest_pb2.SignatureBatch(tick=2, signatures=[sig("a", 4, t), sig("a", 7, t)]),
    ]
    r1, r2 = await _exchange(address, batches)
    assert (r1.accepted, r2.accepted) == (2, 1)
    # seq 3 and 4 are late (out of order); seq 5 a second time, at the same time, is the same sample:
    # a duplicate, dropped quietly
    assert manager.stats.out_of_order == 2 and manager.stats.duplicates == 1
    assert [s.seq for s in manager.windows.window("a").samples] == [5, 6, 7]


async def test_an_out_of_order_signature_gets_a_rejection_that_says_so(ingest: tuple[str, Manager]) -> None:
    address, _ = ingest
    (reply,) = await _exchange(address, [ingest_pb2.SignatureBatch(tick=1, signatures=[sig("a", 5), sig("a", 3)])])
    assert [r.index for r in reply.rejected] == [1]
    assert "order" in reply.rejected[0].reason


async def test_a_resend_of_what_the_manager_has_is_dropped_quietly_and_counted(ingest: tuple[str, Manager]) -> None:
    address, manager = ingest
    (first,) = await _exchange(address, [ingest_pb2.SignatureBatch(tick=1, signatures=[sig("a", k) for k in (1, 2, 3)])])
    assert first.accepted == 3
    # the stream broke before that reply arrived: the profiler sends the three again, on a new stream
    bad = sig("b", 1)
    bad.device_id = ""
    resent = ingest_pb2.SignatureBatch(tick=1, signatures=[sig("a", 1), sig("a", 2), sig("a", 3), bad, sig("a", 4)])
    with capture_logs() as logs:
        (reply,) = await _exchange(address, [resent])
        for _ in range(500):  # the server logs the stream's end once its handler returns
            if any(e["event"] == "profiler_disconnected" and e["duplicates"] for e in logs):
                break
            await asyncio.sleep(0.01)
    assert reply.accepted == 1
    assert [(r.index, r.app_id) for r in reply.rejected] == [(3, "b")]  # indexes of the batch as sent
    assert manager.stats.duplicates == 3 and manager.stats.out_of_order == 0 and manager.stats.rejected == 1
    assert [s.seq for s in manager.windows.window("a").samples] == [1, 2, 3, 4]
    assert not [e for e in logs if e["log_level"] in ("warning", "error")]
    assert [e["duplicates"] for e in logs if e["event"] == "profiler_disconnected" and e["duplicates"]] == [3]


async def test_a_columnar_resend_is_dropped_row_by_row_and_the_rest_answered_as_sent(
    ingest: tuple[str, Manager],
) -> None:
    address, manager = ingest
    old = [sig(f"a{i % 3}", i // 3 + 1) for i in range(300)]  # a0, a1, a2: seq 1..100 each
    cols, rows = columns_from_signatures(old)
    assert not rows
    await _exchange(address, [ingest_pb2.SignatureBatch(tick=1, columns=cols)])
    assert manager.stats.accepted == 300
    late = sig("a0", 50)  # a seq the window has, at another time: late, not a resend
    late.timestamp_s -= 0.05
    new = [sig(f"a{i % 3}", 101 + i // 3) for i in range(30)]
    bad = sig("a1", 200)
    bad.process.sm_util_pct = 250.0
    again = [*old[:150], late, *old[150:], *new]
    cols, rows = columns_from_signatures(again)
    batch = ingest_pb2.SignatureBatch(tick=2, signatures=[bad], columns=cols)
    (reply,) = await _exchange(address, [batch])
    assert reply.accepted == 30 and manager.stats.duplicates == 300
    # index 0 is the row; columnar row j is 1 + j in the batch as sent
    assert sorted((r.index, r.app_id) for r in reply.rejected) == [(0, "a1"), (1 + 150, "a0")]
    assert "order" in next(r.reason for r in reply.rejected if r.index == 151)
    for a in ("a0", "a1", "a2"):
        assert [s.seq for s in manager.windows.window(a).samples] == list(range(1, 111))


async def test_a_restarted_manager_takes_a_resent_batch_whole(tmp_path: Path) -> None:
    address = f"unix:{tmp_path}/m.sock"
    manager = Manager(None, EwmaMarginForecaster(), forecast_interval_s=0.05, min_samples=2)
    server = build_server(address, ingest_servicer=IngestServicer(manager))
    await server.start()
    try:
        (reply,) = await _exchange(address, [ingest_pb2.SignatureBatch(tick=9, signatures=[sig("a", k) for k in (1, 2)])])
    finally:
        await server.stop(0)
    assert reply.accepted == 2 and manager.stats.duplicates == 0


def test_the_window_holds_only_samples_it_has() -> None:
    ws = WindowStore(max_samples=4)
    for k in range(1, 7):  # seq 1..6, the window keeps 3..6
        ws.add(sample_from_signature(sig("a", k)), 0.0)
    assert ws.holds("a", 5, sig("a", 5).timestamp_s) and ws.holds("a", 6, sig("a", 6).timestamp_s)
    assert not ws.holds("a", 5, sig("a", 5).timestamp_s - 0.01)  # same seq, another time
    assert not ws.holds("a", 2, sig("a", 2).timestamp_s)  # no longer in the window
    assert not ws.holds("a", 7, sig("a", 7).timestamp_s) and not ws.holds("b", 5, sig("a", 5).timestamp_s)
    win = ws.window("a")  # many at once, as the manager checks a columnar batch's rows
    held = win.has(np.array([6, 2, 4, 7], dtype=np.uint64),
                   np.array([sig("a", 6).timestamp_s, sig("a", 2).timestamp_s, sig("a", 4).timestamp_s + 1.0,
                             sig("a", 7).timestamp_s]))
    assert held.tolist() == [True, False, False, False]

    # a restarted profiler numbers from 1 again: seq 1..3 twice in the window, at two times each
    ws = WindowStore(max_samples=10)
    before, after = [sig("a", k) for k in range(1, 7)], [sig("a", k, t=1.7e9 + 100.0) for k in range(1, 4)]
    for s in before + after:
        ws.add(sample_from_signature(s), 0.0)
    assert ws.seq_restarts == 1
    assert all(ws.holds("a", s.seq, s.timestamp_s) for s in after + before[:3])
    assert not ws.holds("a", 2, after[1].timestamp_s + 0.01)
    assert not ws.holds("a", 5, before[4].timestamp_s)  # above the last seq now: not a resend of this run


async def test_an_overlong_device_id_is_rejected(ingest: tuple[str, Manager]) -> None:
    address, manager = ingest
    s = sig("a", 1)
    s.device_id = "GPU-" + "x" * 100_000
    (reply,) = await _exchange(address, [ingest_pb2.SignatureBatch(tick=1, signatures=[s])])
    assert reply.accepted == 0 and "device_id" in reply.rejected[0].reason


async def test_bytes_that_are_no_signature_batch_end_only_that_stream(ingest: tuple[str, Manager]) -> None:
    address, _ = ingest
    async with grpc.aio.insecure_channel(address) as ch:
        err = await _send_garbage(ch)
        assert err.code() != grpc.StatusCode.OK
        assert "SignatureBatch" in (err.details() or "")
        # the server serves the next stream
        ok = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        await ok.write(ingest_pb2.SignatureBatch(tick=1, signatures=[sig("a", 1)]))
        assert (await ok.read()).accepted == 1
        await ok.done_writing()


async def test_bytes_that_are_no_signature_batch_are_invalid_argument(ingest: tuple[str, Manager]) -> None:
    address, _ = ingest
    async with grpc.aio.insecure_channel(address) as ch:
        assert (await _send_garbage(ch)).code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_oversized_batch_gets_a_clean_error_and_the_server_keeps_serving(ingest: tuple[str, Manager]) -> None:
    address, manager = ingest
    big = ingest_pb2.SignatureBatch(tick=1, profiler_id="p" * (GRPC_DEFAULT_MAX_RECEIVE + 1024))
    async with grpc.aio.insecure_channel(address) as ch:
        call = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        await call.write(big)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (err.value.details() or "")
        assert manager.stats.batches == 0  # refused before the manager saw it
        ok = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        await ok.write(ingest_pb2.SignatureBatch(tick=2, signatures=[sig("a", 1)]))
        assert (await ok.read()).accepted == 1
        await ok.done_writing()


async def test_a_batch_just_under_the_limit_is_accepted(ingest: tuple[str, Manager]) -> None:
    address, manager = ingest
    near = ingest_pb2.SignatureBatch(tick=1, profiler_id="p" * (GRPC_DEFAULT_MAX_RECEIVE - 4096),
                                     signatures=[sig("a", 1)])
    (reply,) = await _exchange(address, [near])
    assert reply.accepted == 1 and manager.stats.batches == 1


def _largest_signature(app_id: str) -> spb.BehavioralSignature:
    """Every field set, ids at their longest accepted length."""
    s = spb.BehavioralSignature(app_id=app_id, pid=2**31, device_id="MIG-" + "f" * 36, timestamp_s=1.7e9, seq=2**62)
    for part, message in (("device", spb.DeviceCounters), ("process", spb.ProcessCounters),
                          ("host", spb.HostCounters), ("in_app", spb.InAppCounters)):
        for fd in message.DESCRIPTOR.fields:
            value = 2**40 if fd.type in (fd.TYPE_UINT64, fd.TYPE_UINT32) else 1e3
            if fd.type == fd.TYPE_UINT32:
                value = 2**31
            setattr(getattr(s, part), fd.name, value)
    return s


@pytest.mark.parametrize("shape", ["largest", "smallest_rows_widest_columns"])
def test_the_largest_batch_a_profiler_builds_fits_the_servers_smallest_limit(shape: str) -> None:
    """max_batch signatures from the buffer's front, as the streamer batches them (columns from 256):
    within its byte budget, half the smallest receive limit the daemon may be configured with. Small
    rows (one counter each) with one row that knows every column are the widest as columns: within the
    budget as rows, three times over it as columns, so the streamer halves the batch."""
    streamer = SignatureStreamer(_NoSource(), "unix:///nonexistent.sock", profiler_id="host" * 64)
    assert streamer.max_batch_bytes * 2 <= vconfig.MIN_REQUEST_BYTES <= vconfig.ServerConfig().max_request_bytes
    if shape == "largest":
        sigs = [_largest_signature(f"{i:04d}" + "a" * 252) for i in range(streamer.max_batch)]
    else:
        sigs = [spb.BehavioralSignature(app_id=f"a{i}", pid=2, device_id=GPU, timestamp_s=1.7e9 + i, seq=i + 1)
                for i in range(streamer.max_batch)]
        for s in sigs:
            s.process.gpu_mem_used_mib = 10.0
        wide = sigs[0]  # valid, every window column known: each column then has a value for every row
        for part, message in (("device", spb.DeviceCounters), ("process", spb.ProcessCounters),
                              ("in_app", spb.InAppCounters)):
            for fd in message.DESCRIPTOR.fields:
                setattr(getattr(wide, part), fd.name, 50 if fd.type in (fd.TYPE_UINT64, fd.TYPE_UINT32) else 50.0)
        wide.device.mem_total_mib = 81559.0
    streamer.enqueue(sigs)
    if shape != "largest":
        n_rows = streamer._batch_len()
        assert n_rows == streamer.max_batch and streamer._batch(1, n_rows).ByteSize() > streamer.max_batch_bytes
    sent = 0
    while streamer.buffer:
        n, batch = streamer._next_batch(1)
        assert 0 < n and batch.ByteSize() <= streamer.max_batch_bytes
        for _ in range(n):
            streamer.buffer.popleft()
        sent += n
    assert sent == streamer.max_batch  # nothing dropped


class _NoSource:
    def sample(self) -> list[spb.BehavioralSignature]:
        return []

    def close(self) -> None:
        pass
