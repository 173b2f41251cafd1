"""Calls whose request never finishes, against a real `vgpu serve`: gRPC holds a request in memory until
the whole message has arrived, so a local user who starts many calls and sends all but the last byte
of each made the daemon grow by the announced lengths (4 MiB each, any number of calls per
connection). Now a connection carries at most `server.max_streams_per_connection` calls and a
request at most `server.max_request_bytes`, so what one uid can pin is bounded by
max_connections_per_uid x max_streams_per_connection x max_request_bytes, and other clients are
served meanwhile.

The attacker is bench/halfsent.py's hand-made HTTP/2 client, in a child process; as root the child
becomes uid 65534 before it connects (root is exempt from the per-uid bound), otherwise it is the
test's own uid."""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_fixtures import ROOT, Env, Serve, make_env, wait_for

from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

NOBODY = 65534
MIB = 2**20
PER_UID = 4  # server.max_connections_per_uid for the test: small, so the bound is small too
STREAMS = 16  # server.max_streams_per_connection's default
REQUEST_BYTES = 256 * 1024  # server.max_request_bytes's default

# Run in the child: imports first (as root, the interpreter's files may not be readable by uid 65534),
# then the switch, then the connections; prints what was held, then holds it until stdin closes.
_ATTACKER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import halfsent
uid = int(sys.argv[3])
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
conns, pile = halfsent.hold(sys.argv[2], int(sys.argv[4]), int(sys.argv[5]),
                            [int(x) for x in sys.argv[6].split(",")], float(sys.argv[7]))
print(json.dumps(pile), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    """The socket in a directory every user may traverse (the test's own tmp_path is root's alone)."""
    run = Path(tempfile.mkdtemp(prefix="vgpu-halfsent-", dir="/tmp"))
    os.chmod(run, 0o711)
    try:
        e = dataclasses.replace(make_env(tmp_path), sock=run / "vgpu.sock")
        e.env["VGPU_SERVER_MAX_CONNECTIONS_PER_UID"] = str(PER_UID)
        yield e
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for {pid}")


def _available(channel: grpc.Channel) -> int:
    return len(pb_grpc.AllocatorStub(channel).GetAvailableResources(pb.GetAvailableResourcesRequest(),
                                                                     timeout=10).devices)


def test_one_uid_s_half_sent_calls_are_bounded_and_others_are_served(env: Env) -> None:
    root = os.geteuid() == 0
    group = ("--socket-group", grp.getgrgid(NOBODY).gr_name) if root else ()
    daemon = Serve(env, *group)
    try:
        # the forecaster loads in the background after "serving": its memory is not the attack's
        wait_for("the forecaster loaded",
                 lambda: any(e.get("event") in ("forecaster_loaded", "forecaster_fallback") for e in daemon.events()),
                 30.0)
        # the other client's connection is open before the attack (without root it is of the attacker's
        # uid, and takes one of that uid's connections)
        other = grpc.insecure_channel(f"unix:{env.sock}")
        assert _available(other) > 0
        before = _rss_mib(daemon.proc.pid)
        # 6 connections (over the uid's bound) x 32 calls, every other one announcing 4 MiB (over the
        # request limit) and the rest exactly the limit: without the bounds this held 4 x 32 calls,
        # +277 MiB (bench/halfsent.py, same shape)
        child = subprocess.Popen(
            [sys.executable, "-c", _ATTACKER, str(ROOT / "bench"), str(env.sock), str(NOBODY if root else -1),
             "6", "32", f"{4 * MIB},{REQUEST_BYTES}", "3"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert child.stdout is not None
            pile = json.loads(child.stdout.readline())
            # held: the daemon still serves the other client, and has not grown past the bound
            assert _available(other) > 0
            if root:  # a fresh connection of another uid too
                with grpc.insecure_channel(f"unix:{env.sock}") as fresh:
                    assert _available(fresh) > 0
            held = _rss_mib(daemon.proc.pid)
        finally:
            child.communicate(timeout=30)  # closes stdin: the attacker lets go
        attacker_connections = PER_UID if root else PER_UID - 1
        assert pile["connections_closed"] == 6 - attacker_connections  # the front's per-uid bound
        bound_mib = attacker_connections * STREAMS * REQUEST_BYTES / MIB  # at most 16 MiB of messages
        assert held - before < 4 * bound_mib + 32, (before, held, pile)  # generous: allocator and stream overheads
        assert pile["max_streams_per_connection"] == STREAMS
        assert pile["streams_refused"] >= attacker_connections * (32 - STREAMS)  # REFUSED_STREAM past the 16th
        # a request over the limit is refused before it is read, and the daemon goes on serving
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.AllocatorStub(other).RequestResourceAllocation(pb.RequestResourceAllocationRequest(
                request=pb.ResourceRequest(app_id="big", job=pb.JobConfig(model_type="x" * (REQUEST_BYTES + 1)))),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in str(err.value.details()), err.value.details()
        assert _available(other) > 0 and daemon.proc.poll() is None
        other.close()
        assert daemon.term() == 0
    finally:
        daemon.stop_now()
