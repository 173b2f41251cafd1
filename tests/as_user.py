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
  {"connect", "bind"}: the errno name of each failure, or "ok".
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
