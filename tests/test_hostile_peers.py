"""The Unix socket's front against a real `vgpu serve`: the daemon knows each caller's uid and pid
(SO_PEERCRED), so a request may name a process of the caller's own uid and no other, one uid cannot
hold the node's connections, the front's private directory cannot be used to pass as someone else,
and the daemon stops and starts again cleanly.

Acting as another user needs root: the test starts `tests/as_user.py`, which becomes uid 65534 (or
65533) and calls the daemon; the socket is then given the group 65534 and put in a directory every
user may traverse. Those parts are skipped without root."""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_fixtures import ROOT, Env, Serve, make_env, metric_samples, wait_for
from hostile import Raw

from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

NOBODY = 65534
OTHER = 65533  # a second unprivileged uid (it need not have a name)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (setuid)")


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    """The socket in a directory every user may traverse (the test's own tmp_path is root's alone)."""
    run = Path(tempfile.mkdtemp(prefix="vgpu-peers-", dir="/tmp"))
    os.chmod(run, 0o711)
    try:
        yield dataclasses.replace(make_env(tmp_path), sock=run / "vgpu.sock")
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _serve(env: Env, *extra: str) -> Serve:
    group = ("--socket-group", grp.getgrgid(NOBODY).gr_name) if os.geteuid() == 0 else ()
    return Serve(env, *group, *extra)


def _as_user(env: Env, uid: int, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "as_user.py"), "--uid", str(uid), "--gid", str(NOBODY),
            str(env.sock), *args]


def run_as(env: Env, uid: int, *args: str) -> dict[str, Any]:
    out = subprocess.run(_as_user(env, uid, *args), env=env.env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_a_pid_of_the_callers_own_uid_is_taken_without_a_token(env: Env, serves: list[Serve]) -> None:
    serves.append(_serve(env))
    client = Raw(env.sock)
    try:
        # this test's own process runs as the caller's uid: no token, no in-app report needed
        grant = client.request("mine", 8, pid=os.getpid())
        assert grant.app_id == "mine" and grant.memory_mib == 8
        if os.geteuid() != 0:  # pid 1 is root's, not ours
            with pytest.raises(grpc.RpcError) as err:
                client.request("theirs", 8, pid=1)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"uid {os.geteuid()}" in str(err.value.details())
    finally:
        client.close()
    assert serves[-1].term() == 0


@ROOT_ONLY
def test_another_users_pid_is_refused_and_the_denial_names_the_caller(env: Env, serves: list[Serve]) -> None:
    serves.append(_serve(env))
    own = run_as(env, NOBODY, "request", "nobody-app", "self")
    assert own.get("grant_id"), own  # its own process: taken without a token
    for victim in (1, os.getpid()):  # init (cgroup "/") and this test, both root's
        out = run_as(env, NOBODY, "request", "intruder", str(victim))
        assert out["code"] == "PERMISSION_DENIED", out
        assert f"uid {NOBODY}" in out["details"] and f"process {victim}" in out["details"]
        assert "operator token" in out["details"]
        denied = [e for e in serves[-1].events() if e.get("event") == "access_denied" and e.get("pid") == out["pid"]]
        assert denied and denied[-1]["uid"] == NOBODY
    client = Raw(env.sock)
    try:
        apps = {a.app_id for a in client.apps()}
        assert "nobody-app" in apps and "intruder" not in apps
    finally:
        client.close()
    assert serves[-1].term() == 0


@ROOT_ONLY
def test_connections_beyond_the_per_uid_bound_are_refused_and_other_users_are_not(env: Env,
                                                                                  serves: list[Serve]) -> None:
    env.env["VGPU_SERVER_MAX_CONNECTIONS_PER_UID"] = "4"
    serves.append(_serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    holder = subprocess.Popen(_as_user(env, NOBODY, "hold", "10"), env=env.env, cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        held = json.loads(holder.stdout.readline())
        # its channel (opened first) is one of the 4: three raw connections held, seven closed at once
        assert held["first_call"] and (held["held"], held["refused"]) == (3, 7), held
        assert held["call_after"]  # the connection opened before keeps working
        # another uid, and root, are not affected
        other = run_as(env, OTHER, "hold", "2")
        assert other["first_call"] and other["held"] == 2 and other["call_after"], other
        client = Raw(env.sock)
        try:
            assert client.granted_mib() >= 0
        finally:
            client.close()
        samples = metric_samples(port)
        assert samples[("vgpu_connections_refused_total", (("reason", "max_connections_per_uid"),))] == 7
        assert samples[("vgpu_connections_open", ())] >= 4
        # one record for the seven refusals (once per uid per interval), naming the uid and the bound
        refused = [e for e in serves[-1].events() if e.get("event") == "connection_refused"]
        assert len(refused) == 1 and refused[0]["uid"] == NOBODY and refused[0]["bound"] == 4, refused
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(30)
    # the holder is gone: its uid gets in again
    wait_for("the uid's connections to close",
             lambda: metric_samples(port)[("vgpu_connections_open", ())] == 0, timeout_s=10)
    assert run_as(env, NOBODY, "hold", "1")["held"] == 1
    assert serves[-1].term() == 0


def test_the_front_directory_is_private_and_a_peer_cannot_be_forged(env: Env, serves: list[Serve]) -> None:
    """Why a peer name cannot be forged: gRPC reports as a call's peer the address of the socket that
    connected to gRPC's own socket. That socket is the front's, bound by the daemon in the front's
    directory; a caller's own socket address never reaches gRPC. To connect to gRPC's socket directly,
    or to bind a name beside it, a process needs search and write permission on that directory, which
    is mode 0700 and the daemon's: only the daemon's user (and root, who can stop the daemon anyway)
    has it. And only names directly under that exact directory are read as credentials."""
    serves.append(_serve(env))
    front = env.state / "front"
    st = os.lstat(front)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    client = Raw(env.sock)
    try:
        assert client.granted_mib() == 0
        # the front's names are unlinked right after each connect: only gRPC's socket is left
        assert sorted(os.listdir(front)) == ["grpc.sock"]
        if os.geteuid() == 0:
            touched = run_as(env, NOBODY, "touch", str(front / "grpc.sock"))
            assert (touched["connect"], touched["bind"]) == ("EACCES", "EACCES"), touched
        # a connection that does not come through the front carries no credentials: its pid is refused
        with grpc.insecure_channel(f"unix:{front / 'grpc.sock'}") as direct:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.AllocatorStub(direct).RequestResourceAllocation(pb.RequestResourceAllocationRequest(
                    request=pb.ResourceRequest(app_id="direct", memory_mib=8, pid=os.getpid())), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "user is unknown" in str(err.value.details())
        # through the front, the same request is taken: the caller's uid runs the process
        assert client.request("direct", 8, pid=os.getpid()).memory_mib == 8
    finally:
        client.close()
    assert serves[-1].term() == 0


def test_a_stream_and_a_large_reply_pass_the_front(env: Env, serves: list[Serve]) -> None:
    serves.append(_serve(env))
    with grpc.insecure_channel(f"unix:{env.sock}") as ch:
        stub = pb_grpc.AllocatorStub(ch)
        watch = stub.WatchAllocations(pb.WatchAllocationsRequest(), timeout=30)
        events: list[pb.AllocationEvent] = []
        reader = threading.Thread(target=lambda: events.extend(e for _, e in zip(range(60), watch, strict=False)))
        reader.start()
        wait_for("the watch to open", lambda: watch.initial_metadata() is not None, timeout_s=10)
        client = Raw(env.sock)
        try:
            op = (env.state / "tokens" / "operator.token").read_text().strip()
            # 60 grants with long ids: ListApplications' reply is well over one relay chunk (64 KiB)
            for i in range(60):
                client.request(f"app-{i:02d}-" + "x" * 240, 1, token=op)
            reader.join(20)
            assert len(events) == 60  # every grant reached the watcher through the front
            reply = client.stub.ListApplications(pb.ListApplicationsRequest(), timeout=10)
            assert len(reply.apps) == 60 and reply.ByteSize() > 0
        finally:
            client.close()
            watch.cancel()
    assert serves[-1].term() == 0


def test_the_daemon_stops_cleanly_and_starts_again(env: Env, serves: list[Serve]) -> None:
    # A connection that never speaks carries no call: the stop closes it at once, where gRPC's own
    # stop would hold it until its handshake timeout (10 s) or the grace period (30 s here) ran out
    env.env["VGPU_SERVER_GRACE_S"] = "30"
    serves.append(_serve(env))
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(str(env.sock))  # held open through the stop
    try:
        client = Raw(env.sock)
        assert client.granted_mib() == 0
        client.close()
        serves[-1].proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        idle.settimeout(30)
        while idle.recv(65536):  # gRPC's settings frame, if it came, then the close
            pass
        assert time.monotonic() - signalled < 5
        assert serves[-1].term() == 0
    finally:
        idle.close()
    # the relay's files are gone: the public socket and the front's directory (gRPC's socket in it)
    assert not env.sock.exists() and not (env.state / "front").exists()
    assert '"stopped"' in serves[-1].log_path.read_text()
    serves.append(_serve(env))
    assert Raw(env.sock).granted_mib() == 0
    serves[-1].kill9()  # a crash leaves the directory and both sockets behind ...
    assert (env.state / "front" / "grpc.sock").exists()
    serves.append(_serve(env))  # ... and the next start replaces them
    client = Raw(env.sock)
    try:
        assert client.request("after-crash", 8, pid=os.getpid()).memory_mib == 8
    finally:
        client.close()
    assert serves[-1].term() == 0


async def test_the_relay_thread_ends_with_the_daemon(tmp_path: Path) -> None:
    from daemon_fixtures import sim_daemon

    d = sim_daemon(tmp_path)
    await d.start()
    try:
        assert d.front is not None and d.front.running
        assert any(t.name == "vgpu-front" for t in threading.enumerate())
    finally:
        await d.stop("test")
    assert not d.front.running and not any(t.name == "vgpu-front" for t in threading.enumerate())
    assert not (tmp_path / "state" / "front").exists() and not (tmp_path / "v.sock").exists()


def test_the_front_can_be_turned_off(env: Env, serves: list[Serve]) -> None:
    env.env["VGPU_SERVER_PEER_CREDENTIALS"] = "false"
    serves.append(_serve(env))
    assert not (env.state / "front").exists()
    client = Raw(env.sock)
    try:
        assert client.granted_mib() == 0
        with pytest.raises(grpc.RpcError) as err:  # the caller's uid is unknown: its own pid needs a proof
            client.request("mine", 8, pid=os.getpid())
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        client.close()
    assert serves[-1].event("serving")["peer_credentials"] is False
    assert serves[-1].term() == 0


def test_callers_without_a_token_are_one_caller_per_uid() -> None:
    """Per-caller bounds (watchers) key callers without a token by uid where the front knows it."""
    from vgpu.auth import ANONYMOUS, Principal, caller_label
    from vgpu.peers import PeerCred

    assert caller_label(ANONYMOUS, PeerCred(pid=10, uid=1000, gid=100)) == "anonymous (uid 1000)"
    assert caller_label(ANONYMOUS, PeerCred(pid=11, uid=1001, gid=100)) == "anonymous (uid 1001)"
    assert caller_label(ANONYMOUS, None) == "anonymous"  # TCP, or the front off: one caller
    assert caller_label(Principal("app", app_id="a", via="token"), PeerCred(1, 1000, 100)) == "app:a"
    assert caller_label(Principal("operator", via="token"), PeerCred(1, 0, 0)) == "operator"


async def test_a_front_that_ended_stops_the_watchdog(tmp_path: Path) -> None:
    """The relay thread ending on its own (a fault) leaves the daemon alive but unreachable: the
    watchdog pings stop, so systemd restarts it."""
    import asyncio

    from daemon_fixtures import sim_daemon

    class Pings:
        def __init__(self) -> None:
            self.sent: list[str] = []

        def notify(self, message: str) -> bool:
            self.sent.append(message)
            return True

    d = sim_daemon(tmp_path)
    await d.start()
    pings = Pings()
    d.notifier = pings  # type: ignore[assignment]
    try:
        task = asyncio.create_task(d._ping_watchdog(0.01))
        await asyncio.sleep(0.1)
        assert "WATCHDOG=1" in pings.sent and not task.done()
        assert d.front is not None
        await asyncio.to_thread(d.front.stop)  # as if the thread had died
        await asyncio.wait_for(task, 5)  # the pinger ends ...
        n = len(pings.sent)
        await asyncio.sleep(0.1)
        assert len(pings.sent) == n  # ... and pings no more
    finally:
        await d.stop("test")


@ROOT_ONLY
def test_the_socket_s_new_directories_let_its_group_through_under_a_strict_umask(env: Env, serves: list[Serve]) -> None:
    """`vgpu serve --socket /new/dir/vgpu.sock` by hand as root under umask 077: the directories it
    made were 0700, so the socket's mode and group let no one else in, while doctor said OK."""
    env = dataclasses.replace(env, sock=env.sock.parent / "new" / "deeper" / "vgpu.sock")
    old = os.umask(0o077)
    try:
        serves.append(_serve(env))
    finally:
        os.umask(old)
    for directory in (env.sock.parent, env.sock.parent.parent):
        assert directory.stat().st_mode & 0o777 == 0o755, directory
    assert run_as(env, NOBODY, "touch", str(env.sock))["connect"] == "ok"
