"""The Allocator (core) and its gRPC service over a real Unix socket: grants, refusals, release,
validation, the error map, watch events, recommendations and power, stop."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from allocator_fakes import FakeBackend, FakeClock, FakeDevice
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from vgpu.allocator.core import AllocationRequest, Allocator, EventKind, Sizing
from vgpu.allocator.errors import (
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidRequest,
    NoPermission,
    NotFound,
    NotSupported,
    PermissionDenied,
    Unavailable,
    VerifyFailed,
    status_for,
)
from vgpu.allocator.ledger import AppLimits
from vgpu.allocator.policy.base import Recommendation
from vgpu.allocator.service import AllocatorServicer, build_server, event_to_pb
from vgpu.jobs import InvalidJobConfig, JobConfig
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

GPU = "GPU-fake-0"


def make_allocator(**kw: object) -> tuple[Allocator, FakeDevice, FakeClock]:
    dev = FakeDevice(GPU, power_limit_mw=700_000)
    clock = FakeClock()
    return Allocator(FakeBackend([dev]), clock=clock, **kw), dev, clock  # type: ignore[arg-type]


# --- the error map ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InsufficientResources("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoPermission("x"), grpc.StatusCode.PERMISSION_DENIED),
        (PermissionDenied("x"), grpc.StatusCode.PERMISSION_DENIED),
        (NotSupported("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (InUse("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (GpuLost("x"), grpc.StatusCode.UNAVAILABLE),
        (NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (InvalidRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (InvalidJobConfig("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (VerifyFailed("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_error_map(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_for(exc) == (code, "x")


def test_unknown_errors_are_internal_without_details() -> None:
    code, msg = status_for(KeyError("secret path /etc/x"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in msg and "KeyError" in msg


# --- core ------------------------------------------------------------------------------------------
def test_request_release_and_available() -> None:
    alloc, _, _ = make_allocator()
    g = alloc.request_allocation(AllocationRequest("a", 30_000, 40))
    assert g.device_id == GPU
    (d,) = alloc.available()
    assert (d.mem_granted_mib, d.sm_available_pct, d.power_limit_mw) == (30_000, 60, 700_000)
    assert d.power_constraints is not None and d.power_constraints.min_mw == 200_000
    with pytest.raises(InsufficientResources):
        alloc.request_allocation(AllocationRequest("b", 60_000))
    assert alloc.available()[0].mem_granted_mib == 30_000
    alloc.release(g.grant_id)
    with pytest.raises(NotFound):
        alloc.release(g.grant_id)
    assert alloc.counters.granted == 1 and alloc.counters.released == 1


def test_cold_start_sizer_sizes_requests_without_memory() -> None:
    class Sizer:
        def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
            assert mem_total_mib == 81559.0
            return Sizing(1000.0 * job.batch_size, 20.0)

    alloc, _, _ = make_allocator(sizer=Sizer())
    g = alloc.request_allocation(AllocationRequest("a", job=JobConfig(model_type="resnet", batch_size=8)))
    assert (g.memory_mib, g.sm_pct, g.source) == (8000, 20, "cold_start")


def test_nvml_backend_defaults_to_dry_run() -> None:
    class Nvml(FakeBackend):
        name = "nvml"

    assert Allocator(Nvml()).dry_run is True
    assert Allocator(Nvml(), dry_run=False).dry_run is False
    assert Allocator(FakeBackend()).dry_run is False


def rec(app: str, mem: float, sm: float, device: str = GPU) -> Recommendation:
    return Recommendation(app, device, mem, sm, source="baseline", mem_p90_peak_mib=mem, sm_p90_peak_pct=sm,
                          mem_used_mib=mem * 0.9, sm_util_pct=sm * 0.9)


def test_recommendations_create_resize_clamp_and_set_power() -> None:
    alloc, dev, _ = make_allocator()
    req = alloc.request_allocation(AllocationRequest("b", 20_000, 10))
    report = alloc.apply_recommendations([rec("a", 10_000, 20), rec("b", 5_000, 10), rec("x", 1, 1, "GPU-nope")])
    assert [g.app_id for g in report.created] == ["a"] and report.created[0].source == "forecast"
    assert report.resized == ()  # a request grant never shrinks below what was asked
    assert report.skipped and "GPU-nope" in report.skipped[0]
    # power follows the summed SM demand (30 % * 1.15 headroom of the 200-700 W range)
    assert len(report.power) == 1 and report.power[0].changed
    assert dev.limit_mw == 370_000  # 200 W + 500 W * 0.345 = 372.5 W, in 5 W steps
    # growth beyond the device is clamped to what fits
    report = alloc.apply_recommendations([rec("a", 70_000, 20), rec("b", 5_000, 10)])
    (a,) = report.resized
    assert a.memory_mib == pytest.approx(81559.0 - 20_000)
    assert alloc.ledger.get(req.grant_id).memory_mib == 20_000
    # small changes are ignored; an unchanged demand writes no power limit
    writes = len(dev.writes)
    report = alloc.apply_recommendations([rec("a", 61_500, 20), rec("b", 5_000, 10)])
    assert report.resized == () and len(dev.writes) == writes
    apps = {a.app_id: a for a in alloc.list_apps()}
    assert apps["a"].forecast_mem_p90_mib == 61_500 and apps["a"].source == "baseline"
    assert math.isnan(apps["b"].forecast_sm_p90_pct) is False
    # stop restores the original power limit
    results = alloc.stop()
    assert dev.limit_mw == 700_000 and results[0].changed
    assert alloc.counters.power_limit_changes == 1


def test_dry_run_allocator_counts_planned_power_changes_but_writes_nothing() -> None:
    alloc, dev, _ = make_allocator(dry_run=True)
    report = alloc.apply_recommendations([rec("a", 1000, 10)])
    assert report.power[0].dry_run and dev.writes == [] and alloc.counters.power_limit_changes == 1


def test_power_write_refused_is_survived() -> None:
    dev = FakeDevice(GPU, write_error=NoPermission)
    alloc = Allocator(FakeBackend([dev]))
    alloc.apply_recommendations([rec("a", 1000, 10)])
    alloc.apply_recommendations([rec("a", 1000, 90)])
    assert len(dev.writes) == 1 and alloc.power.disabled_reason(GPU)
    assert alloc.counters.power_limit_changes == 0


def test_forget_app_releases_forecast_grants_only() -> None:
    alloc, _, _ = make_allocator()
    mine = alloc.request_allocation(AllocationRequest("a", 100))
    alloc.apply_recommendations([rec("b", 1000, 10)])
    assert alloc.forget_app("b")[0].source == "forecast"
    assert alloc.forget_app("a") == [] and alloc.ledger.get(mine.grant_id)


def test_on_change_sees_every_ledger_change() -> None:
    seen: list[int] = []
    alloc, _, _ = make_allocator(on_change=lambda led: seen.append(len(led.grants())))
    g = alloc.request_allocation(AllocationRequest("a", 100))
    alloc.set_limits(AppLimits("a", max_memory_mib=1000))
    alloc.release(g.grant_id)
    assert seen == [1, 1, 0]


async def test_watch_streams_events_and_ends_on_stop() -> None:
    alloc, _, _ = make_allocator()
    every, only_b = alloc.watch(), alloc.watch("b")
    g = alloc.request_allocation(AllocationRequest("a", 100))
    alloc.request_allocation(AllocationRequest("b", 100))
    alloc.release(g.grant_id)
    alloc.apply_recommendations([rec("b", 5000, 50)])
    alloc.stop()
    kinds = [e.kind async for e in every]
    assert kinds == [
        EventKind.GRANTED,
        EventKind.GRANTED,
        EventKind.RELEASED,
        EventKind.RESIZED,
        EventKind.POWER_LIMIT_CHANGED,
        EventKind.POWER_LIMIT_CHANGED,
    ]
    assert [e.app_id async for e in only_b if e.grant is not None] == ["b", "b"]


async def test_slow_watcher_drops_oldest() -> None:
    alloc, _, _ = make_allocator(watch_queue_size=2)
    sub = alloc.watch()
    for i in range(5):
        alloc.request_allocation(AllocationRequest(f"a{i}", 1))
    alloc.stop()
    assert [e.app_id async for e in sub] == ["a3", "a4"]
    assert sub.dropped == 3 and alloc.counters.events_dropped == 3


async def test_a_waiting_watcher_gets_a_burst_in_order_and_ends_when_closed() -> None:
    alloc, _, _ = make_allocator()
    sub = alloc.watch()
    got: list[str] = []

    async def consume() -> None:
        async for e in sub:
            got.append(e.app_id)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)  # the consumer waits on an empty queue
    for i in range(5):  # published before the consumer runs again
        alloc.request_allocation(AllocationRequest(f"a{i}", 1))
    await asyncio.sleep(0)
    assert got == [f"a{i}" for i in range(5)]
    sub.close()  # wakes the waiting consumer, which ends
    await asyncio.wait_for(task, 1.0)
    assert alloc.watchers == 0


# --- over gRPC -------------------------------------------------------------------------------------
# Every call carries a deadline, so a lost reply fails the test in seconds instead of stalling the run.
T_S = 10.0


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[pb_grpc.AllocatorStub, Allocator, grpc.aio.Channel]]:
    alloc, _, _ = make_allocator()
    address = f"unix:{tmp_path}/alloc.sock"
    server = build_server(address, allocator_servicer=AllocatorServicer(alloc))
    await server.start()
    channel = grpc.aio.insecure_channel(address)
    try:
        yield pb_grpc.AllocatorStub(channel), alloc, channel
    finally:
        await asyncio.wait_for(channel.close(), T_S)
        alloc.stop()
        await asyncio.wait_for(server.stop(0), T_S)


def req(app: str = "a", mem: float = 1000, sm: float = 10) -> pb.RequestResourceAllocationRequest:
    return pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app, memory_mib=mem, sm_pct=sm))


async def test_grpc_grant_refuse_release(served: tuple[pb_grpc.AllocatorStub, Allocator, grpc.aio.Channel]) -> None:
    stub, alloc, _ = served
    g = (await stub.RequestResourceAllocation(req("a", 70_000, 50), timeout=T_S)).grant
    assert g.app_id == "a" and g.device_id == GPU and g.memory_mib == 70_000
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RequestResourceAllocation(req("b", 20_000, 10), timeout=T_S)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "does not fit" in (err.value.details() or "")
    assert len(alloc.ledger.grants()) == 1
    avail = await stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=T_S)
    (d,) = avail.devices
    assert d.mem_granted_mib == 70_000 and d.power_max_mw == 700_000
    released = await stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=g.grant_id), timeout=T_S)
    assert released.released.grant_id == g.grant_id
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=g.grant_id), timeout=T_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetAvailableResources(pb.GetAvailableResourcesRequest(device_id="GPU-nope"), timeout=T_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (req("", 1), "request.app_id is empty"),
        (req("a", -1), "request.memory_mib must be >= 0"),
        (req("a", math.nan), "request.memory_mib must be a finite number"),
        (req("a", 1, 150), "request.sm_pct must be at most 100"),
        (req("a", 1, 100.0000001), "request.sm_pct must be at most 100, got 100.0000001"),  # not "got 100"
        (req("a", -1e-9), "request.memory_mib must be >= 0, got -1e-09"),
        (pb.RequestResourceAllocationRequest(), "request is missing"),
        (pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(
            app_id="a", job=pb.JobConfig(model_type="bert", batch_size=8, precision="fp8"))),
         "request.job: unknown precision 'fp8'"),
    ],
)
async def test_grpc_input_validation(
    served: tuple[pb_grpc.AllocatorStub, Allocator, grpc.aio.Channel],
    message: pb.RequestResourceAllocationRequest,
    match: str,
) -> None:
    stub, alloc, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RequestResourceAllocation(message, timeout=T_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in (err.value.details() or "")
    assert alloc.ledger.grants() == []


async def test_a_negative_zero_is_granted_as_zero(
        served: tuple[pb_grpc.AllocatorStub, Allocator, grpc.aio.Channel]) -> None:
    stub, alloc, _ = served
    g = (await stub.RequestResourceAllocation(req("a", -0.0, -0.0), timeout=T_S)).grant
    assert math.copysign(1.0, g.memory_mib) == math.copysign(1.0, g.sm_pct) == 1.0  # shown as 0, not -0
    assert math.copysign(1.0, alloc.ledger.get(g.grant_id).memory_mib) == 1.0


async def test_grpc_limits_list_and_validation(served: tuple[pb_grpc.AllocatorStub, Allocator, grpc.aio.Channel]) -> None:
    stub, _, _ = served
    lim = (await stub.SetResourceLimits(pb.SetResourceLimitsRequest(
        limits=pb.AppLimits(app_id="a", max_memory_mib=2000, priority=3)), timeout=T_S)).limits
    assert lim.max_memory_mib == 2000 and not lim.HasField("max_sm_pct") and lim.priority == 3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RequestResourceAllocation(req("a", 3000), timeout=T_S)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SetResourceLimits(pb.SetResourceLimitsRequest(limits=pb.AppLimits(app_id="a", max_sm_pct=-1)), timeout=T_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReleaseResources(pb.ReleaseResourcesRequest(), timeout=T_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await stub.RequestResourceAllocation(req("a", 1500), timeout=T_S)
    apps = (await stub.ListApplications(pb.ListApplicationsRequest(), timeout=T_S)).apps
    assert [(a.app_id, len(a.grants), a.limits.max_memory_mib) for a in apps] == [("a", 1, 2000)]


async def test_grpc_identity_is_enforced(tmp_path: Path) -> None:
    alloc, _, _ = make_allocator()
    address = f"unix:{tmp_path}/id.sock"
    server = build_server(address, allocator_servicer=AllocatorServicer(alloc, identify=lambda _ctx: "a"))
    await server.start()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.AllocatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RequestResourceAllocation(req("b"), timeout=T_S)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await stub.RequestResourceAllocation(req("a"), timeout=T_S)).grant.app_id == "a"
    await server.stop(0)


async def test_grpc_watch_and_health(served: tuple[pb_grpc.AllocatorStub, Allocator, grpc.aio.Channel]) -> None:
    stub, alloc, channel = served
    call = stub.WatchAllocations(pb.WatchAllocationsRequest(app_id="a"), timeout=T_S)
    # the server sends initial metadata once the subscription is registered; events before it are missed
    await asyncio.wait_for(call.initial_metadata(), T_S)
    assert alloc.watchers == 1
    g = (await stub.RequestResourceAllocation(req("a"), timeout=T_S)).grant
    await stub.RequestResourceAllocation(req("b"), timeout=T_S)
    await stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=g.grant_id), timeout=T_S)
    events = [await asyncio.wait_for(call.read(), T_S), await asyncio.wait_for(call.read(), T_S)]
    assert [e.kind for e in events] == [pb.AllocationEvent.GRANTED, pb.AllocationEvent.RELEASED]
    assert events[0].grant.grant_id == g.grant_id
    call.cancel()
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "vgpu.v1.Allocator"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=T_S)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    # reflection still describes the service (WatchAllocations is registered by add_allocator_servicer)
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=T_S)  # type: ignore[arg-type,operator]  # the stubs type sync channels only
    await reflect.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = await reflect.read()
    await reflect.done_writing()
    assert "vgpu.v1.Allocator" in [s.name for s in listed.list_services_response.service]


async def test_every_watch_stream_gets_each_event_in_order_serialized_once(tmp_path: Path) -> None:
    alloc, _, _ = make_allocator()
    servicer = AllocatorServicer(alloc)
    address = f"unix:{tmp_path}/fan.sock"
    server = build_server(address, allocator_servicer=servicer)
    await server.start()
    reference = alloc.watch()  # what the allocator published, in order
    async with grpc.aio.insecure_channel(address) as channel:
        # the wire bytes as they arrive (no deserializer), to compare streams byte for byte
        watch: grpc.aio.UnaryStreamMultiCallable[pb.WatchAllocationsRequest, bytes] = channel.unary_stream(
            "/vgpu.v1.Allocator/WatchAllocations", request_serializer=pb.WatchAllocationsRequest.SerializeToString)
        calls = [watch(pb.WatchAllocationsRequest(app_id=app), timeout=T_S) for app in ("", "", "a")]
        for call in calls:
            await asyncio.wait_for(call.initial_metadata(), T_S)
        grants = []
        for i in range(20):  # a burst: every event is queued before any stream runs
            grants.append(alloc.request_allocation(AllocationRequest("a" if i % 2 else "b", 10)))
        for g in grants:
            alloc.release(g.grant_id)
        alloc.end_watches()
        published = [e async for e in reference]
        got = [[bytes(m) async for m in call] for call in calls]
    await server.stop(0)
    expected = [event_to_pb(e).SerializeToString() for e in published]
    assert len(expected) == 40 and got[0] == got[1] == expected
    assert got[2] == [b for e, b in zip(published, expected, strict=True) if e.app_id == "a"]
    assert [pb.AllocationEvent.FromString(b).grant.grant_id for b in got[0][:20]] == [g.grant_id for g in grants]
    # three streams, 40 events: each serialized once, not once per stream
    assert servicer.encoded_events.encoded == 40


async def test_a_watcher_that_falls_a_queue_behind_is_dropped_over_grpc(tmp_path: Path) -> None:
    alloc, _, _ = make_allocator(watch_queue_size=4, drop_slow_watchers=True)
    address = f"unix:{tmp_path}/slow.sock"
    server = build_server(address, allocator_servicer=AllocatorServicer(alloc))
    await server.start()
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.AllocatorStub(channel).WatchAllocations(pb.WatchAllocationsRequest(), timeout=T_S)
        await asyncio.wait_for(call.initial_metadata(), T_S)
        for i in range(10):  # in one step of the loop: the stream cannot send any of them yet
            alloc.request_allocation(AllocationRequest(f"a{i}", 1))
        assert alloc.watchers == 0  # dropped at once, not waited on
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for event in call:
                got.append(event.grant.app_id)
    await server.stop(0)
    # what was still queued when it was dropped (the oldest 4 were lost), then the status
    assert got == ["a4", "a5", "a6"]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "fell 4 events behind" in (err.value.details() or "")


def test_oversubscribed_sm_is_shared_in_proportion_and_shrinks_go_first() -> None:
    alloc, _, _ = make_allocator()
    alloc.apply_recommendations([rec("a", 1000, 80)])
    assert alloc.ledger.grants()[0].sm_pct == 80
    alloc.apply_recommendations([rec("a", 1000, 60), rec("b", 1000, 60)])
    shares = {g.app_id: g.sm_pct for g in alloc.ledger.grants()}
    assert shares == pytest.approx({"a": 50, "b": 50})  # a shrank first, so b could take its share


async def test_a_not_ready_answer_says_nothing_changed_and_other_errors_do_not(
        served: tuple[pb_grpc.AllocatorStub, Allocator, grpc.aio.Channel]) -> None:
    from vgpu.allocator.service import NOTHING_CHANGED_KEY

    stub, alloc, _ = served

    class Loading:
        def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
            raise Unavailable("the cold-start model is still loading")

    alloc.sizer = Loading()
    job = pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(
        app_id="a", job=pb.JobConfig(model_type="resnet50", batch_size=64)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RequestResourceAllocation(job, timeout=T_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (NOTHING_CHANGED_KEY, "1") in tuple(err.value.trailing_metadata() or ())
    assert alloc.ledger.grants() == []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RequestResourceAllocation(req("a", 1e9, 10), timeout=T_S)  # does not fit
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert NOTHING_CHANGED_KEY not in dict(err.value.trailing_metadata() or ())
