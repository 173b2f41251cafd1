"""Grants of applications that vanished are released: `vgpu serve` with a short `server.idle_release_s`,
driven by the operator CLI; `vgpu apps --json` shows when each application was last seen."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from pathlib import Path

import grpc
import pytest
from daemon_fixtures import Env, Serve, make_env

from vgpu.allocator.core import AllocationRequest, Allocator
from vgpu.device.sim import SimBackend
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

IDLE_S = 2.0


@pytest.fixture
def env(tmp_path: Path) -> Env:
    e = make_env(tmp_path)
    e.env["VGPU_SERVER_IDLE_RELEASE_S"] = str(IDLE_S)
    return e


def apps(env: Env) -> dict[str, dict]:  # type: ignore[type-arg]
    return {a["app_id"]: a for a in env.json("apps").get("apps", [])}


def wait_until(pred, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def test_a_vanished_application_is_released_and_a_live_one_kept(env: Env, serves: list[Serve]) -> None:
    serve = Serve(env)
    serves.append(serve)
    sock = ["--socket", str(env.sock)]
    events: list[pb.AllocationEvent] = []
    channel = grpc.insecure_channel(f"unix:{env.sock}")
    watch = pb_grpc.AllocatorStub(channel).WatchAllocations(pb.WatchAllocationsRequest(), timeout=30)

    def read() -> None:
        try:
            for e in watch:
                events.append(e)
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        env.vgpu("request", *sock, "--app", "ghost", "--memory-mib", "4096")  # no pid, nothing else
        # naming a pid takes the operator token (read from the state directory) or the process's own proof
        env.vgpu("request", *sock, "--state-dir", str(env.state), "--app", "alive", "--memory-mib", "1024",
                 "--pid", str(os.getpid()))
        before = time.time()
        listed = apps(env)
        assert listed["ghost"]["last_seen_s"] == pytest.approx(before, abs=5)
        wait_until(lambda: not apps(env).get("ghost", {}).get("grants"))
        released = serve.event("app_released_idle")
        assert released["app"] == "ghost" and released["limit_s"] == IDLE_S and released["memory_mib"] == 4096
        wait_until(lambda: any(e.kind == pb.AllocationEvent.RELEASED and e.grant.app_id == "ghost" for e in events))
        (event,) = [e for e in events if e.kind == pb.AllocationEvent.RELEASED and e.grant.app_id == "ghost"]
        assert event.detail.startswith("idle: ")
        # Released, it is still listed with when it was last heard from, not N/A.
        assert apps(env)["ghost"]["last_seen_s"] == pytest.approx(before, abs=5)
        assert not [line for line in env.vgpu("apps", *sock).stdout.splitlines() if line.startswith("ghost ")]
        table = env.vgpu("apps", *sock, "--all").stdout  # it holds nothing: listed with --all only
        (row,) = [line for line in table.splitlines() if line.startswith("ghost ")]
        assert row.rstrip().endswith("ago"), table
        # The application with a live process keeps its grant, and is seen now.
        time.sleep(IDLE_S)
        alive = apps(env)["alive"]
        assert len(alive["grants"]) == 1 and alive["last_seen_s"] >= time.time() - IDLE_S
        free = env.json("available")["devices"][0]
        assert free["mem_granted_mib"] == 1024
    finally:
        watch.cancel()
        channel.close()


def test_grants_restored_after_a_restart_are_released_when_nobody_comes_back(env: Env, serves: list[Serve]) -> None:
    first = Serve(dataclasses.replace(env, env={**env.env, "VGPU_SERVER_IDLE_RELEASE_S": "0"}))  # never
    serves.append(first)
    env.vgpu("request", "--socket", str(env.sock), "--app", "left", "--memory-mib", "8192")
    granted_at = apps(env)["left"]["grants"][0]["updated_at_s"]
    assert first.term() == 0
    time.sleep(1.5)
    second = Serve(dataclasses.replace(env, env={**env.env, "VGPU_SERVER_IDLE_RELEASE_S": "6"}))  # time to look
    serves.append(second)
    # the operator sees the application's last sign, the grant's time, not the restart (which still
    # gives the restored grant the whole idle time to show up)
    assert apps(env)["left"]["last_seen_s"] == pytest.approx(granted_at, abs=0.01)
    wait_until(lambda: not apps(env).get("left", {}).get("grants"))
    assert second.event("app_released_idle")["app"] == "left"
    assert env.json("available")["devices"][0]["mem_granted_mib"] == 0


def test_signatures_and_watches_are_signs_of_life() -> None:
    now = [1000.0]
    alloc = Allocator(SimBackend(["h100-80gb"]), clock=lambda: now[0], dry_run=False)
    streamed = {"streaming": 1000.0}
    alloc.signature_seen = streamed.get
    for app in ("streaming", "watching", "silent"):
        alloc.request_allocation(AllocationRequest(app_id=app, memory_mib=100.0))
    now[0] = 1100.0
    streamed["streaming"] = 1099.0

    async def run() -> list[str]:
        sub = alloc.watch("watching")
        try:
            return alloc.release_vanished(60.0)
        finally:
            sub.close()

    assert asyncio.run(run()) == ["silent"]
    assert alloc.last_seen_s("streaming") == 1099.0
    assert alloc.last_seen_s("silent") == 1000.0  # released, it keeps when it was last seen


def test_an_application_s_own_release_is_a_sign_of_life_and_an_operator_s_is_not() -> None:
    now = [1000.0]
    alloc = Allocator(SimBackend(["h100-80gb"]), clock=lambda: now[0], dry_run=False)
    own = alloc.request_allocation(AllocationRequest(app_id="job", memory_mib=100.0), caller="job")
    other = alloc.request_allocation(AllocationRequest(app_id="other", memory_mib=100.0), caller="other")
    now[0] = 1050.0
    alloc.release(own.grant_id, caller="job")  # `vgpu apps --all` shows LAST SEEN as this moment
    alloc.release(other.grant_id, caller=None)  # the operator's
    assert alloc.last_seen_s("job") == 1050.0
    assert alloc.last_seen_s("other") == 1000.0


def test_a_release_that_cannot_be_stored_keeps_its_grant_and_the_sweep_goes_on() -> None:
    """One failing write (a full state directory) keeps that grant, in memory and on disk alike, and
    the sweep still releases every other idle application; the next sweep, the disk freed, releases it."""
    from vgpu.allocator.errors import StateNotSaved
    from vgpu.allocator.ledger import Ledger

    now = [1000.0]
    alloc = Allocator(SimBackend(["h100-80gb"]), clock=lambda: now[0], dry_run=False)
    held = {app: alloc.request_allocation(AllocationRequest(app_id=app, memory_mib=100.0)).grant_id
            for app in ("a-full-disk", "b-after", "c-after")}
    disk_full = [True]

    def store(ledger: Ledger) -> None:
        if disk_full[0] and held["a-full-disk"] in ledger.changes().grants_removed:
            raise StateNotSaved("database or disk is full")
        ledger.commit_changes()

    alloc.on_change = store
    now[0] = 1100.0
    assert alloc.release_vanished(60.0) == ["b-after", "c-after"]
    assert [g.grant_id for g in alloc.ledger.grants()] == [held["a-full-disk"]]
    disk_full[0] = False
    assert alloc.release_vanished(60.0) == ["a-full-disk"]
    assert not alloc.ledger.grants()
