"""The daemon sizes jobs that give no memory with the cold-start model, over gRPC, under its auth."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from daemon_fixtures import sim_daemon

from vgpu.allocator.core import Sizer, Sizing
from vgpu.allocator.policy.forecast import ForecastPolicy
from vgpu.jobs import JobConfig
from vgpu.manager.coldstart import AllocatorSizer, ColdStartSizer
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


def _request(app: str, job: pb.JobConfig, memory_mib: float = 0.0) -> pb.RequestResourceAllocationRequest:
    return pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app, memory_mib=memory_mib, job=job))


async def test_a_job_without_memory_is_sized_by_the_cold_start_model(tmp_path: Path) -> None:
    d = sim_daemon(tmp_path)  # the production loader: the shipped artefact
    await d.start()
    try:
        assert d.sizer.wait(120) and d.sizer.error is None
        job = pb.JobConfig(model_type="resnet50", batch_size=64, input_size=224, mode="train")
        async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
            stub = pb_grpc.AllocatorStub(ch)
            grant = (await stub.RequestResourceAllocation(_request("train-r50", job))).grant
            total = d.allocator.ledger.capacity(grant.device_id).mem_total_mib
            want = AllocatorSizer(ColdStartSizer.load()).size(JobConfig.from_proto(job), mem_total_mib=total)
            assert grant.source == "cold_start"
            assert grant.memory_mib == pytest.approx(want.memory_mib) and 0 < grant.memory_mib <= total
            assert grant.sm_pct == pytest.approx(want.sm_pct)

            # A job that cannot be sized is the caller's mistake, said so, and changes nothing.
            for bad, says in [
                (pb.JobConfig(model_type="resnet50", batch_size=0), "batch_size must be >= 1"),
                (pb.JobConfig(model_type="", batch_size=8), "model_type is empty"),
                (pb.JobConfig(model_type="bert", batch_size=8, precision="fp7"), "unknown precision 'fp7'"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.RequestResourceAllocation(_request("bad-job", bad))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert "request.job" in (err.value.details() or "") and says in (err.value.details() or "")
            # A job with an explicit memory request is granted what it asks.
            asked = (await stub.RequestResourceAllocation(_request("sized", job, memory_mib=1234))).grant
            assert (asked.memory_mib, asked.source) == (1234, "request")
        assert {g.app_id for g in d.allocator.ledger.grants()} == {"train-r50", "sized"}
    finally:
        await d.stop("test")


class _Broken(Exception):
    pass


async def test_the_daemon_degrades_when_the_sizer_does_not_load(tmp_path: Path) -> None:
    gate = threading.Event()

    def load() -> Sizer:
        gate.wait(10)
        raise _Broken("artefact unreadable")

    d = sim_daemon(tmp_path, load_sizer=load)
    await d.start()
    try:
        job = pb.JobConfig(model_type="resnet50", batch_size=8)
        async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
            stub = pb_grpc.AllocatorStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # still loading: retry later
                await stub.RequestResourceAllocation(_request("early", job))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in (err.value.details() or "")
            gate.set()
            assert d.sizer.wait(10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RequestResourceAllocation(_request("late", job))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "artefact unreadable" in (err.value.details() or "") and "give memory_mib" in (err.value.details() or "")
            ok = (await stub.RequestResourceAllocation(_request("explicit", job, memory_mib=512))).grant
            assert ok.memory_mib == 512  # the daemon still serves requests that state their memory
        assert d.sizer.error == "_Broken: artefact unreadable"
    finally:
        await d.stop("test")


async def test_a_loaded_sizer_is_what_the_allocator_asks(tmp_path: Path) -> None:
    class Fixed:
        def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
            return Sizing(100.0 * job.batch_size, 7.0, "fixed")

    d = sim_daemon(tmp_path, load_sizer=Fixed)
    await d.start()
    try:
        assert d.sizer.wait(10)
        async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
            grant = (await pb_grpc.AllocatorStub(ch).RequestResourceAllocation(
                _request("x", pb.JobConfig(model_type="mlp", batch_size=30)))).grant
        assert (grant.memory_mib, grant.sm_pct, grant.source) == (3000, 7, "cold_start")
        assert isinstance(d.allocator.policy, ForecastPolicy)  # the daemon plans with the predictive policy
    finally:
        await d.stop("test")


async def test_the_background_loads_begin_once_the_daemon_serves(tmp_path: Path) -> None:
    """The cold-start sizer and the shipped model load in worker threads that begin after `serving`:
    begun earlier, their imports (torch) held the interpreter's lock through the rest of the start-up."""
    import structlog
    from structlog.testing import capture_logs

    structlog.reset_defaults()  # another test's `main()` may have configured warning level for the process
    seen: list[list[str]] = []

    def load() -> Sizer:
        seen.append([e["event"] for e in logs])
        raise _Broken("not needed here")

    d = sim_daemon(tmp_path, load_sizer=load)
    with capture_logs() as logs:
        await d.start()
        try:
            assert d.sizer.wait(30)
            assert d.model_loader is not None and d.model_loader.ident is not None  # the shipped model's load began
        finally:
            await d.stop("test")
    assert len(seen) == 1 and "serving" in seen[0]


async def test_a_start_that_fails_before_serving_begins_no_load_and_waits_for_none(tmp_path: Path) -> None:
    """A start-up that fails before `serving` (here: the socket's path is a directory) has begun no
    background load, so its stop does not wait for one (a load takes seconds; up to LOADER_JOIN_S)."""
    import time

    from vgpu.daemon.serve import StartupError

    calls: list[float] = []

    def load() -> Sizer:
        calls.append(time.monotonic())
        time.sleep(30)
        raise _Broken("too slow")

    (tmp_path / "v.sock").mkdir()
    d = sim_daemon(tmp_path, load_sizer=load)
    started = time.monotonic()
    with pytest.raises(StartupError):
        await d.start()
    await d.stop("start-up failed")
    assert calls == [] and time.monotonic() - started < 15
    assert d.model_loader is None or d.model_loader.ident is None
