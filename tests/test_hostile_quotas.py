"""What callers pile up is bounded, against a real `vgpu serve`: grants per application and per node,
watchers per caller, samples stamped far in the future; and signatures for an application id the
profiler made up do not lock the id's real owner out."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from daemon_fixtures import Env, Serve, make_env, metric_samples
from hostile import Raw, operator_token

from vgpu import auth
from vgpu.manager.window import AppWindow
from vgpu.traces import NUMERIC
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.v1 import signature_pb2 as spb


@pytest.fixture
def env(tmp_path: Path) -> Env:
    e = make_env(tmp_path)
    e.env.update({"VGPU_SERVER_MAX_GRANTS_PER_APP": "3", "VGPU_SERVER_MAX_GRANTS_PER_NODE": "5",
                  "VGPU_SERVER_MAX_WATCHERS_PER_CALLER": "2", "VGPU_SERVER_MAX_WATCHERS": "3",
                  "VGPU_AUTH_MAX_SELF_REGISTERED_APPS": "2"})
    return e


def test_grant_quotas_per_app_and_per_node(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env, "--metrics-port", "auto"))
    op = operator_token(env.state)
    for _ in range(3):
        client.request("a", 1, token=op)
    with pytest.raises(grpc.RpcError) as err:
        client.request("a", 1, token=op)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_grants_per_app = 3" in str(err.value.details())
    client.request("b", 1, token=op)
    client.request("c", 1, token=op)
    with pytest.raises(grpc.RpcError) as err:
        client.request("d", 1, token=op)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_grants_per_node = 5" in str(err.value.details())
    assert client.granted_mib() == 5 and "d" not in [a.app_id for a in client.apps()]
    # the operator sees each refusal: counted by setting, and logged with who was refused
    refused = metric_samples(serves[-1].metrics_port)
    assert refused[("vgpu_quota_refusals_total", (("quota", "max_grants_per_app"),))] == 1
    assert refused[("vgpu_quota_refusals_total", (("quota", "max_grants_per_node"),))] == 1
    assert refused[("vgpu_quota_refusals_total", (("quota", "max_watchers"),))] == 0  # counted from 0
    logged = [e for e in serves[-1].events() if e.get("event") == "quota_refused"]
    assert [e["quota"] for e in logged] == ["max_grants_per_app", "max_grants_per_node"]
    assert all(e["caller"] == "operator" and e["method"] == "RequestResourceAllocation" for e in logged)
    assert serves[-1].term() == 0


def test_self_registered_app_ids_are_bounded(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    for app in ("x1", "x2"):
        client.request(app, 1)
    with pytest.raises(grpc.RpcError) as err:
        client.request("x3", 1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_self_registered_apps = 2" in str(err.value.details())
    assert not auth.app_token_file("x3", env.state).exists()
    assert client.request("x3", 1, token=operator_token(env.state)).app_id == "x3"  # the operator still may
    assert serves[-1].term() == 0


def test_watchers_are_bounded_per_caller_and_in_all(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    op = auth.bearer(operator_token(env.state))
    calls = []
    try:
        for md in ((), ()):
            call = client.stub.WatchAllocations(pb.WatchAllocationsRequest(), metadata=md, timeout=30)
            calls.append(call)
            call.initial_metadata()  # the watch is registered
        third = client.stub.WatchAllocations(pb.WatchAllocationsRequest(), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            next(third)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_watchers_per_caller = 2" in str(err.value.details())
        # another caller (the operator) has its own bound, under the node's (3)
        calls.append(client.stub.WatchAllocations(pb.WatchAllocationsRequest(), metadata=op, timeout=30))
        calls[-1].initial_metadata()
        fourth = client.stub.WatchAllocations(pb.WatchAllocationsRequest(), metadata=op, timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            next(fourth)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_watchers = 3" in str(err.value.details())
    finally:
        for c in calls:
            c.cancel()
    assert serves[-1].term() == 0


def test_far_future_samples_are_rejected_and_invented_ids_do_not_lock_out_owners(env: Env, serves: list[Serve],
                                                                                client: Raw) -> None:
    serves.append(Serve(env))
    gpu = client.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10).devices[0].device_id
    token = auth.read_token_file(auth.role_token_file("profiler", env.state))
    now = time.time()
    sigs = [spb.BehavioralSignature(app_id="victim", pid=7, device_id=gpu, timestamp_s=now - 3 + i, seq=i + 1)
            for i in range(3)]
    for s in sigs:
        s.process.gpu_mem_used_mib = 20_000.0
        s.process.sm_util_pct = 50.0
    future = spb.BehavioralSignature(app_id="victim", pid=7, device_id=gpu, timestamp_s=now + 365 * 86400, seq=4)
    future.process.gpu_mem_used_mib = 1.0
    # a minute ahead: accepted, it would make every honest sample after it "out of order" for that minute
    ahead = spb.BehavioralSignature(app_id="victim", pid=7, device_id=gpu, timestamp_s=now + 60, seq=5)
    honest = spb.BehavioralSignature(app_id="victim", pid=7, device_id=gpu, timestamp_s=now + 0.5, seq=6)
    for s in (ahead, honest):
        s.process.gpu_mem_used_mib = 20_000.0
    with grpc.insecure_channel(f"unix:{env.sock}") as ch:
        stub = ingest_pb2_grpc.IngestStub(ch)
        batch = ingest_pb2.SignatureBatch(tick=1, signatures=[*sigs, future, ahead, honest])
        replies = stub.StreamSignatures(iter([batch]), metadata=auth.bearer(token), timeout=10)
        reply = next(replies)
        replies.cancel()
    assert reply.accepted == 4
    assert [r.index for r in reply.rejected] == [3, 4]
    assert all("ahead of the manager's clock" in r.reason for r in reply.rejected)
    # The forecast grant for "victim" arrives from the signatures ...
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any(a.app_id == "victim" and a.grants for a in client.apps()):
        time.sleep(0.1)
    assert any(a.app_id == "victim" and a.grants for a in client.apps())
    # ... and the real owner of the id may still claim it (before: PERMISSION_DENIED, "owned by another client").
    grant = client.request("victim", 16)
    assert grant.app_id == "victim"
    assert auth.app_token_file("victim", env.state).is_file()
    assert serves[-1].term() == 0


def test_a_window_trace_is_bounded_by_its_span_not_by_time_stamps() -> None:
    win = AppWindow("a", 16, max_span_s=3600.0)
    for k, t in enumerate((1.0, 1e4, 1e8 - 10, 1e8)):
        win.append("GPU-0", k + 1, t, np.zeros(len(NUMERIC)))
    trace = win.trace()
    assert list(trace.t_s) == [1e8 - 10, 1e8]  # a 1 s grid of it has 11 bins, not 1e8


async def test_a_watcher_that_does_not_read_is_dropped() -> None:
    # in process: a subscription of the daemon's kind (drop_slow), fed more than two queues of events
    from vgpu.allocator.core import AllocationEvent, EventKind, Subscription

    closed: list[Subscription] = []
    sub = Subscription(None, 4, closed.append, owner="anonymous", drop_slow=True)
    for k in range(9):
        sub.push(AllocationEvent(EventKind.GRANTED, float(k)))
    assert sub.overflowed and closed == [sub] and sub.dropped == 4
    assert [e.at_s async for e in sub] == [4.0, 5.0, 6.0]  # what it still had, then the end


def test_a_connection_that_never_speaks_is_closed(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        idle.connect(str(env.sock))
        idle.settimeout(30)
        t0 = time.monotonic()
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := idle.recv(4096):  # the server's settings frame, then the close
                data += chunk
        assert 5 < time.monotonic() - t0 < 25  # grpc.server_handshake_timeout_ms = 10 s
    finally:
        idle.close()
    assert client.granted_mib() == 0  # and the daemon serves on
    assert serves[-1].term() == 0


def test_connections_beyond_the_bound_are_closed_at_once(env: Env, serves: list[Serve], client: Raw) -> None:
    env.env["VGPU_SERVER_MAX_CONNECTIONS"] = "8"
    serves.append(Serve(env))
    assert client.granted_mib() == 0  # the client's own connection is one of the 8
    idle = []
    try:
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(env.sock))  # the kernel accepts; the daemon decides
            idle.append(s)
        def closed_now() -> int:
            closed = 0
            for s in idle:
                s.setblocking(False)
                try:
                    closed += s.recv(65536, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    closed += 1
            return closed

        # polled until the refusals are in, not a fixed 2 s: a loaded daemon takes longer to accept
        # and close them, and the wait stays inside the 10 s handshake timeout, so that only the
        # bound has closed connections when they are counted
        connected = time.monotonic()
        closed = closed_now()
        while closed < 13 and time.monotonic() < connected + 7:
            time.sleep(0.05)
            closed = closed_now()
        assert closed >= 13  # 20 + the client's > 8: at least 13 refused at once
        assert time.monotonic() < connected + 9, "counted too late to tell the bound from the handshake timeout"
        assert closed < 20  # and those within the bound are held
        assert client.granted_mib() == 0  # a connection the daemon already holds is served
    finally:
        for s in idle:
            s.close()
    # once they are gone, a new client gets in: as soon as the daemon has seen them go (polled, not
    # a fixed 1 s), and refused meanwhile
    deadline = time.monotonic() + 30
    while True:
        fresh = Raw(env.sock)
        try:
            assert fresh.granted_mib() == 0
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
        finally:
            fresh.close()
        time.sleep(0.1)
    assert serves[-1].term() == 0


def test_the_operator_lists_every_application_when_the_list_is_larger_than_4_mib(env: Env, serves: list[Serve]) -> None:
    """`ListApplications` lists every claimed id. Ids of 256 characters claimed by the thousand (by
    anonymous callers within the default quotas: 6,832 such applications, 4,096 with a grant, made a
    3.85 MB reply; the operator may claim more) pushed the reply past gRPC's default receive limit of
    4 MiB, and `vgpu apps` failed RESOURCE_EXHAUSTED for the operator. The claims are written into the
    store here (much faster than 16,000 calls), which the daemon's own Store makes first."""
    from vgpu.allocator.store import Store

    Store(env.state).close()
    ids = [f"a{i:05d}-" + "x" * 249 for i in range(16_000)]
    with sqlite3.connect(env.state / "vgpu.sqlite3") as db:
        db.executemany("INSERT INTO apps(app_id, claimed_at_s) VALUES (?, ?)", [(a, 1.0) for a in ids])
    serves.append(Serve(env))
    apps = env.json("apps")["apps"]
    assert len(apps) == len(ids) and apps[0]["app_id"] == ids[0] and all(a["claimed"] for a in apps)
    assert serves[-1].term() == 0
