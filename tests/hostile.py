"""Shared by the tests/test_hostile_*.py suites: raw gRPC calls to a real `vgpu serve`, as a hostile
caller with access to the socket would make them (no CLI, no client stub in the way)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from vgpu import auth
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


class Raw:
    """A channel to the daemon's socket and the Allocator stub on it."""

    def __init__(self, sock: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix:{sock}")
        self.stub = pb_grpc.AllocatorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def request(self, app_id: str, memory_mib: float = 1.0, *, pid: int = 0, token: str | None = None,
                timeout_s: float = 10.0) -> pb.Grant:
        md = auth.bearer(token) if token else ()
        reply = self.stub.RequestResourceAllocation(
            pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app_id, memory_mib=memory_mib, pid=pid)),
            metadata=md, timeout=timeout_s,
        )
        return reply.grant

    def release(self, grant_id: str, *, token: str) -> pb.Grant:
        return self.stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=grant_id), metadata=auth.bearer(token),
                                          timeout=10.0).released

    def apps(self) -> list[pb.ApplicationInfo]:
        return list(self.stub.ListApplications(pb.ListApplicationsRequest(), timeout=10.0).apps)

    def wait_granted(self, app_id: str, wait_s: float) -> bool:
        """Whether `app_id` holds a grant within `wait_s` (polled every 0.1 s)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if any(a.app_id == app_id and a.grants for a in self.apps()):
                return True
            time.sleep(0.1)
        return False

    def granted_mib(self) -> float:
        devs = self.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10.0).devices
        return sum(d.mem_granted_mib for d in devs)


def raw(sock: Path) -> Iterator[Raw]:
    """For a fixture: a Raw client closed after the test."""
    r = Raw(sock)
    try:
        yield r
    finally:
        r.close()


def operator_token(state: Path) -> str:
    return auth.read_token_file(auth.role_token_file("operator", state))
