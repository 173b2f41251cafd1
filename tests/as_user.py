"""Run as root by tests/test_hostile_peers.py: imports what it needs, then becomes another user
(`--uid`, `--gid`; the interpreter's own files may not be readable by that user, so nothing is
imported after the switch) and acts on the daemon's socket as that user would. Prints one JSON
object per action on stdout.

    python tests/as_user.py --uid 65534 --gid 65534 SOCKET ACTION [ARGS...]

Actions:
- `request APP PID`: one RequestResourceAllocation without a token (PID `self`: this process's own);
  {"grant_id"} or {"code", "details"};
- `hold N`: one gRPC call on a channel, then N raw connections (nothing sent), then after a second
  {"first_call", "held", "refused", "call_after"}: how many the daemon still holds, how many it
  closed, and whether the channel opened first still serves; then waits for stdin to close;
- `touch PATH`: tries to connect to, and to bind a socket in the directory of, PATH (a socket);
  {"connect", "bind"}: the errno name of each failure, or "ok";
- `grants PREFIX APPS PER_APP`: claims the ids PREFIX0.. PREFIX<APPS-1> and asks for PER_APP grants
  of 0 MiB for each, every request after an id's first with its token; stops at the first refusal:
  {"granted", "tokens", "code", "details"};
- `claims PREFIX N`: claims N ids (a 0-MiB request, then its release with the id's token); stops at
  the first refusal: {"claimed", "code", "details"};
- `watch PREFIX APPS PER_APP`: claims APPS ids, then opens PER_APP watches of each with its token;
  stops at the first refused watch, prints {"opened", "code", "details"}, then holds the watches
  open until stdin closes.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vgpu.v1 import allocator_pb2 as pb  # noqa: E402
from vgpu.v1 import allocator_pb2_grpc as pb_grpc  # noqa: E402


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return bool(s.recv(65536, socket.MSG_PEEK))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _call(stub: pb_grpc.AllocatorStub) -> bool:
    try:
        stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10)
        return True
    except grpc.RpcError:
        return False


def _try(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))


def _grant(stub: pb_grpc.AllocatorStub, app: str, token: str) -> tuple[str, str]:
    """(the grant's id, the token: the one sent, or the one the reply carries for a new claim)."""
    md = (("authorization", f"Bearer {token}"),) if token else ()
    reply, call = stub.RequestResourceAllocation.with_call(pb.RequestResourceAllocationRequest(
        request=pb.ResourceRequest(app_id=app, memory_mib=0.0)), metadata=md, timeout=10)
    return reply.grant.grant_id, token or dict(call.trailing_metadata() or ()).get("vgpu-app-token", "")


def _refusal(out: dict[str, object], err: grpc.RpcError) -> None:
    out.update(code=err.code().name, details=err.details())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--uid", type=int, required=True)
    p.add_argument("--gid", type=int, required=True)
    p.add_argument("socket")
    p.add_argument("action")
    p.add_argument("args", nargs="*")
    ns = p.parse_args()
    # grpc imports its channel modules only when a channel is first made: make one (it connects at its
    # first call, after the switch) so that they are loaded while the files are still readable
    grpc.insecure_channel(f"unix:{ns.socket}").close()
    os.setgroups([])
    os.setgid(ns.gid)
    os.setuid(ns.uid)
    out: dict[str, object] = {"uid": os.getuid(), "pid": os.getpid()}
    if ns.action == "request":
        app, pid = ns.args[0], os.getpid() if ns.args[1] == "self" else int(ns.args[1])
        with grpc.insecure_channel(f"unix:{ns.socket}") as ch:
            try:
                reply = pb_grpc.AllocatorStub(ch).RequestResourceAllocation(pb.RequestResourceAllocationRequest(
                    request=pb.ResourceRequest(app_id=app, memory_mib=8.0, pid=pid)), timeout=10)
                out["grant_id"] = reply.grant.grant_id
            except grpc.RpcError as err:
                out.update(code=err.code().name, details=err.details())
    elif ns.action == "hold":
        with grpc.insecure_channel(f"unix:{ns.socket}") as ch:
            stub = pb_grpc.AllocatorStub(ch)
            out["first_call"] = _call(stub)
            idle = []
            for _ in range(int(ns.args[0])):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(ns.socket)  # the kernel accepts; the daemon decides
                idle.append(s)
            time.sleep(1.0)
            held = sum(_still_open(s) for s in idle)
            out.update(held=held, refused=len(idle) - held, call_after=_call(stub))
            print(json.dumps(out), flush=True)
            sys.stdin.read()  # hold them until the test is done
            for s in idle:
                s.close()
        return 0
    elif ns.action == "grants":
        prefix, apps, per_app = ns.args[0], int(ns.args[1]), int(ns.args[2])
        out.update(granted=0, tokens=0)
        with grpc.insecure_channel(f"unix:{ns.socket}") as ch:
            stub = pb_grpc.AllocatorStub(ch)
            try:
                for i in range(apps):
                    token = ""
                    for _ in range(per_app):
                        _, token = _grant(stub, f"{prefix}{i}", token)
                        out["granted"] = int(str(out["granted"])) + 1
                    out["tokens"] = i + 1
            except grpc.RpcError as err:
                _refusal(out, err)
    elif ns.action == "claims":
        prefix, n = ns.args[0], int(ns.args[1])
        out["claimed"] = 0
        with grpc.insecure_channel(f"unix:{ns.socket}") as ch:
            stub = pb_grpc.AllocatorStub(ch)
            try:
                for i in range(n):
                    grant_id, token = _grant(stub, f"{prefix}{i}", "")
                    stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=grant_id),
                                          metadata=(("authorization", f"Bearer {token}"),), timeout=10)
                    out["claimed"] = i + 1
            except grpc.RpcError as err:
                _refusal(out, err)
    elif ns.action == "watch":
        prefix, apps, per_app = ns.args[0], int(ns.args[1]), int(ns.args[2])
        with grpc.insecure_channel(f"unix:{ns.socket}") as ch:
            stub = pb_grpc.AllocatorStub(ch)
            tokens = [_grant(stub, f"{prefix}{i}", "")[1] for i in range(apps)]
            calls = []
            try:
                for i, token in enumerate(tokens):
                    for _ in range(per_app):
                        call = stub.WatchAllocations(pb.WatchAllocationsRequest(app_id=f"{prefix}{i}"),
                                                     metadata=(("authorization", f"Bearer {token}"),), timeout=60)
                        calls.append(call)
                        call.initial_metadata()  # sent once the watch is live; a refused one has ended
                        if call.done():
                            raise call  # type: ignore[misc]  # a grpc.RpcError
            except grpc.RpcError as err:
                _refusal(out, err)
            out["opened"] = sum(1 for c in calls if not c.done())
            print(json.dumps(out), flush=True)
            sys.stdin.read()  # hold them until the test is done
            for c in calls:
                c.cancel()
        return 0
    elif ns.action == "touch":
        path = Path(ns.args[0])

        def connect() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))

        def bind() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(str(path.parent / "0-0-1-1"))

        out.update(connect=_try(connect), bind=_try(bind))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
