"""When the manager answers a profiler stream (manager/service.py): at once when a reply has
decisions or rejections, otherwise at most `ack_interval_s` later, and always when the stream ends;
accepted counts are never lost on the way. Over a real Unix-socket gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from manager_fakes import EwmaMarginForecaster

from vgpu.allocator.service import build_server
from vgpu.config import ConfigError, ManagerConfig, load
from vgpu.manager.core import Manager
from vgpu.manager.service import IngestServicer
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.v1 import signature_pb2 as spb

GPU = "GPU-acks-0"
T0 = 1.7e9


def sig(app: str, seq: int) -> spb.BehavioralSignature:
    s = spb.BehavioralSignature(app_id=app, pid=7, device_id=GPU, timestamp_s=T0 + seq * 0.1, seq=seq)
    s.process.gpu_mem_used_mib = 1000.0 + seq
    s.process.sm_util_pct = 20.0
    return s


def batch(tick: int, *sigs: spb.BehavioralSignature) -> ingest_pb2.SignatureBatch:
    return ingest_pb2.SignatureBatch(tick=tick, signatures=list(sigs))


Start = Callable[[IngestServicer], Awaitable[str]]


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Start]:
    servers: list[grpc.aio.Server] = []

    async def start(servicer: IngestServicer) -> str:
        address = f"unix:{tmp_path}/m{len(servers)}.sock"
        server = build_server(address, ingest_servicer=servicer)
        await server.start()
        servers.append(server)
        return address

    yield start
    for s in servers:
        await s.stop(0)


def quiet_manager() -> Manager:
    # min_samples out of reach: no decision is ever made, so only the ack rule decides replies
    return Manager(None, EwmaMarginForecaster(), forecast_interval_s=0.05, min_samples=10_000)


async def _until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `cond()` holds: generous, since it ends as soon as it does and a loaded machine can
    take seconds for what takes milliseconds alone."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not reached in {timeout_s} s")
        await asyncio.sleep(0.01)


async def _drain(call: grpc.aio.StreamStreamCall, into: list[ingest_pb2.IngestReply]) -> None:  # type: ignore[type-arg]
    async for reply in call:
        into.append(reply)


async def test_batches_with_nothing_to_say_are_acknowledged_together_when_the_stream_ends(serve: Start) -> None:
    manager = quiet_manager()
    address = await serve(IngestServicer(manager, ack_interval_s=3600.0))
    replies: list[ingest_pb2.IngestReply] = []
    async with grpc.aio.insecure_channel(address) as ch:
        call = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        reader = asyncio.create_task(_drain(call, replies))
        for k in range(1, 6):
            await call.write(batch(k, sig("a", 2 * k - 1), sig("a", 2 * k)))
        await _until(lambda: manager.stats.accepted == 10)  # all five batches taken ...
        assert replies == []  # ... and none answered yet
        await call.done_writing()
        await asyncio.wait_for(reader, 5)
    assert [(r.tick, r.accepted) for r in replies] == [(5, 10)]


async def test_a_rejection_is_answered_at_once_and_carries_the_earlier_accepted_counts(serve: Start) -> None:
    address = await serve(IngestServicer(quiet_manager(), ack_interval_s=3600.0))
    async with grpc.aio.insecure_channel(address) as ch:
        call = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        await call.write(batch(1, sig("a", 1), sig("a", 2)))
        await call.write(batch(2, sig("a", 3)))
        bad = sig("b", 1)
        bad.device_id = ""
        await call.write(batch(3, sig("a", 4), bad))
        reply = await asyncio.wait_for(call.read(), 5)
        assert reply.tick == 3
        assert reply.accepted == 4  # two + one unanswered before, one in this batch
        assert [(r.index, r.app_id) for r in reply.rejected] == [(1, "b")]
        await call.write(batch(4, sig("a", 5)))
        await call.done_writing()
        last = await asyncio.wait_for(call.read(), 5)
        assert (last.tick, last.accepted, len(last.rejected)) == (4, 1, 0)
        assert await call.read() is grpc.aio.EOF


async def test_a_decision_is_answered_at_once(serve: Start) -> None:
    manager = Manager(None, EwmaMarginForecaster(), forecast_interval_s=0.05, min_samples=2)
    address = await serve(IngestServicer(manager, ack_interval_s=3600.0))
    async with grpc.aio.insecure_channel(address) as ch:
        call = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        await call.write(batch(1, sig("a", 1)))  # one sample: not enough for a forecast, no reply
        await call.write(batch(2, sig("a", 2)))  # two: the app is due, the reply brings its decision
        reply = await asyncio.wait_for(call.read(), 5)
        assert reply.tick == 2 and reply.accepted == 2
        assert [(d.app_id, d.for_seq) for d in reply.decisions] == [("a", 2)]
        await call.done_writing()


async def test_a_quiet_stream_is_acknowledged_once_the_interval_has_passed(serve: Start) -> None:
    clock = StepClock()
    manager = quiet_manager()
    address = await serve(IngestServicer(manager, ack_interval_s=1.0, clock=clock))
    async with grpc.aio.insecure_channel(address) as ch:
        call = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        replies: list[ingest_pb2.IngestReply] = []
        reader = asyncio.create_task(_drain(call, replies))
        # each batch handled by the manager at the clock's time: 0.0 (stream opened), 0.5, 1.0, 1.2
        for k, now in enumerate([0.5, 1.0, 1.2, 1.3], start=1):
            await call.write(batch(k, sig("a", k)))
            await _until(lambda k=k: manager.stats.batches == k)
            clock.now = now
        await _until(lambda: bool(replies))
        assert [(r.tick, r.accepted) for r in replies] == [(3, 3)]
        await call.done_writing()
        await asyncio.wait_for(reader, 5)
    assert [(r.tick, r.accepted) for r in replies] == [(3, 3), (4, 1)]


async def test_ack_interval_zero_answers_every_batch(serve: Start) -> None:
    address = await serve(IngestServicer(quiet_manager(), ack_interval_s=0.0))
    async with grpc.aio.insecure_channel(address) as ch:
        call = ingest_pb2_grpc.IngestStub(ch).StreamSignatures()
        got = []
        for k in range(1, 4):
            await call.write(batch(k, sig("a", k)))
            r = await asyncio.wait_for(call.read(), 5)
            got.append((r.tick, r.accepted))
        await call.done_writing()
    assert got == [(1, 1), (2, 1), (3, 1)]


def test_a_negative_ack_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="ack_interval_s"):
        IngestServicer(quiet_manager(), ack_interval_s=-1.0)


def test_the_config_bounds_the_ack_interval(tmp_path: Path) -> None:
    assert ManagerConfig().ack_interval_ms == 1000.0
    path = tmp_path / "vgpu.toml"
    path.write_text("[manager]\nack_interval_ms = -5\n")
    with pytest.raises(ConfigError, match="ack_interval_ms"):
        load(path, env={})
