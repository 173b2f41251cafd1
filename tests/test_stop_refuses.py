"""A daemon that has decided to stop changes nothing more: a request that reaches it while it stops is
refused (UNAVAILABLE, "the daemon is stopping", marked as having changed nothing) and nothing of it
is stored, through the daemon's own socket; the allocator refuses every change once stopping."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from pathlib import Path

import grpc
import pytest
from allocator_fakes import FakeBackend, FakeClock, FakeDevice
from daemon_fixtures import sim_daemon

from vgpu.allocator.core import AllocationRequest, Allocator
from vgpu.allocator.errors import Unavailable
from vgpu.allocator.ledger import AppLimits, Ledger
from vgpu.allocator.policy.base import Recommendation
from vgpu.allocator.store import Store
from vgpu.client import NOTHING_CHANGED_KEY
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


def _request(app_id: str, memory_mib: float) -> pb.RequestResourceAllocationRequest:
    return pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app_id, memory_mib=memory_mib))


async def test_a_request_that_reaches_a_stopping_daemon_is_refused_and_not_stored(tmp_path: Path) -> None:
    d = sim_daemon(tmp_path, **{"server.grace_s": 5.0})
    await d.start()
    assert d.front is not None
    # The stop's first step off the loop (the front stops accepting) is held until the call below
    # has had its answer: a call on a connection already open reaches the daemon after it decided to stop.
    answered = threading.Event()
    stop_accepting = d.front.stop_accepting

    def held(timeout_s: float = 5.0) -> None:
        answered.wait(10)
        stop_accepting(timeout_s)

    d.front.stop_accepting = held  # type: ignore[method-assign]
    stopping: asyncio.Task[object] | None = None
    try:
        async with grpc.aio.insecure_channel(f"unix://{d.socket_path}") as channel:
            stub = pb_grpc.AllocatorStub(channel)
            await stub.RequestResourceAllocation(_request("before", 100))
            stopping = asyncio.create_task(d.stop("test"))
            await asyncio.sleep(0)  # the stop has begun
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.RequestResourceAllocation(_request("during", 100))
            finally:
                answered.set()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the daemon is stopping" in (refused.value.details() or "")
            assert dict(refused.value.trailing_metadata() or ()).get(NOTHING_CHANGED_KEY) == "1"
    finally:
        await (stopping if stopping is not None else d.stop("test"))
    assert [g.app_id for g in d.allocator.ledger.grants()] == ["before"]
    with Store(tmp_path / "state") as store:
        stored = store.load_ledger()
    assert stored is not None and [g["app_id"] for g in stored["grants"]] == ["before"]


def _stopping_allocator(how: str) -> tuple[Allocator, list[int]]:
    """An allocator holding one requested grant and one made from a forecast, then stopping (`how`:
    "refuse" as the daemon does first, or "stop"); the list counts the stores after that."""
    stores: list[int] = []

    def store(ledger: Ledger) -> None:
        stores.append(ledger.revision)
        ledger.commit_changes()

    alloc = Allocator(FakeBackend([FakeDevice("GPU-0", power_limit_mw=700_000)]), clock=FakeClock(),  # type: ignore[arg-type]
                      on_change=store)
    alloc.request_allocation(AllocationRequest("asked", 1000))
    alloc.apply_recommendations([Recommendation("planned", "GPU-0", 2000, 10)])
    assert {g.app_id for g in alloc.ledger.grants()} == {"asked", "planned"}
    if how == "refuse":
        alloc.refuse_changes()
    else:
        alloc.stop()
    stores.clear()
    return alloc, stores


@pytest.mark.parametrize("how", ["refuse", "stop"])
def test_a_stopping_allocator_refuses_every_change_and_stores_nothing(how: str) -> None:
    alloc, stores = _stopping_allocator(how)
    before = sorted((g.grant_id, g.memory_mib) for g in alloc.ledger.grants())
    asked = alloc.ledger.grants(app_id="asked")[0]
    changes = [
        lambda: alloc.request_allocation(AllocationRequest("new", 100)),
        lambda: alloc.release(asked.grant_id),
        lambda: alloc.set_limits(AppLimits("asked", max_memory_mib=10)),
        lambda: alloc.apply_recommendations([Recommendation("planned", "GPU-0", 9000, 50)]),
    ]
    for change in changes:
        with pytest.raises(Unavailable, match="the daemon is stopping"):
            change()
    # what only the daemon does on its own: releases of silent applications keep the grants stored
    assert alloc.forget_app("planned") == []
    assert alloc.release_vanished(idle_s=0.0) == []
    assert alloc.release_departed("asked", reason="gone", seen=None) == []
    assert sorted((g.grant_id, g.memory_mib) for g in alloc.ledger.grants()) == before
    assert alloc.ledger.limits("asked") is None
    assert stores == [] and not any(dataclasses.astuple(alloc.ledger.changes()))
    assert alloc.refusing_changes
    # reads still answer
    assert alloc.available()[0].mem_granted_mib == sum(m for _, m in before)
    assert {a.app_id for a in alloc.list_apps()} >= {"asked"}
    assert not math.isnan(alloc.available()[0].mem_total_mib)


def test_a_profiler_streams_decisions_reaching_a_stopping_allocator_are_refused_quietly() -> None:
    """The manager's apply during the stop's grace: refused, said once at info, no error line."""
    from manager_fakes import EwmaMarginForecaster
    from structlog.testing import capture_logs

    from vgpu.manager.core import Manager
    from vgpu.v1 import ingest_pb2
    from vgpu.v1 import signature_pb2 as spb

    clock = FakeClock()
    alloc = Allocator(FakeBackend([FakeDevice("GPU-0", power_limit_mw=700_000)]), clock=clock)  # type: ignore[arg-type]
    mgr = Manager(alloc, EwmaMarginForecaster(), clock=clock, min_samples=1)
    alloc.refuse_changes()
    with capture_logs() as logs:
        for k in range(1, 4):
            clock.advance(1.0)
            sig = spb.BehavioralSignature(app_id="a", pid=7, device_id="GPU-0", timestamp_s=clock(), seq=k,
                                          process=spb.ProcessCounters(gpu_mem_used_mib=1000.0, sm_util_pct=10.0))
            reply = mgr.ingest(ingest_pb2.SignatureBatch(profiler_id="p", tick=k, sent_at_s=clock(), signatures=[sig]))
            assert len(reply.decisions) == 1  # the stream is still answered
    assert [e["event"] for e in logs if e["log_level"] in ("error", "warning")] == []
    assert [e["event"] for e in logs].count("apply_recommendations_refused") == 1
    assert alloc.ledger.grants() == []


def test_a_store_failure_in_apply_is_an_error_every_time_not_the_stop() -> None:
    """StateNotSaved is an Unavailable too: a sink whose apply could not store its plan has not
    stopped, so each failure is an `apply_recommendations_failed` error (worth an operator's look),
    not the stop's one quiet `apply_recommendations_refused`."""
    from collections.abc import Sequence

    from manager_fakes import EwmaMarginForecaster
    from structlog.testing import capture_logs

    from vgpu.allocator.errors import StateNotSaved
    from vgpu.manager.core import Manager
    from vgpu.v1 import ingest_pb2
    from vgpu.v1 import signature_pb2 as spb

    class FailingStore:
        def apply_recommendations(self, recommendations: Sequence[Recommendation]) -> object:
            raise StateNotSaved("state directory full")

        def forget_app(self, app_id: str) -> list[object]:
            return []

    clock = FakeClock()
    mgr = Manager(FailingStore(), EwmaMarginForecaster(), clock=clock, min_samples=1)  # type: ignore[arg-type]
    with capture_logs() as logs:
        for k in range(1, 4):
            clock.advance(1.0)
            sig = spb.BehavioralSignature(app_id="a", pid=7, device_id="GPU-0", timestamp_s=clock(), seq=k,
                                          process=spb.ProcessCounters(gpu_mem_used_mib=1000.0, sm_util_pct=10.0))
            mgr.ingest(ingest_pb2.SignatureBatch(profiler_id="p", tick=k, sent_at_s=clock(), signatures=[sig]))
    events = [e["event"] for e in logs]
    assert "apply_recommendations_refused" not in events
    assert events.count("apply_recommendations_failed") == 3
