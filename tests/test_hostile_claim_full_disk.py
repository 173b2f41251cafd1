"""A claim whose call failed on a full state directory, against the daemon on the simulated GPU in
this process: the call is answered UNAVAILABLE with `vgpu-nothing-changed: 1`, so the claim it made
must not outlive it as an id nobody owns. The store here writes a new claim and then fails the rest,
forgetting the claim included, as a disk that fills between the two writes does."""

from __future__ import annotations

import sqlite3
from typing import Any

import grpc
import pytest

from vgpu import auth
from vgpu.allocator.service import NOTHING_CHANGED_KEY
from vgpu.daemon.serve import Daemon
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


class _FillsAfterTheClaim:
    """A SQLite connection that, while `full`, takes a new claim's row and fails every other write."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.full = True

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        text = sql.lstrip().upper()
        if self.full and text.startswith(("INSERT", "UPDATE", "DELETE")) and not text.startswith("INSERT OR IGNORE INTO APPS"):
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def _ask(app: str) -> pb.RequestResourceAllocationRequest:
    return pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app, memory_mib=500))


async def test_a_claim_whose_call_changed_nothing_is_claimed_afresh_by_the_retry(daemon: Daemon) -> None:
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        stub = pb_grpc.AllocatorStub(ch)
        disk = _FillsAfterTheClaim(daemon.store._db)
        daemon.store._db = disk  # type: ignore[assignment]
        try:
            call = stub.RequestResourceAllocation(_ask("orphan"), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert dict(err.value.trailing_metadata() or ()).get(NOTHING_CHANGED_KEY) == "1"
            # what stays is consistent: the claim the store could not forget, with its token file
            assert daemon.store.app_claimed("orphan") and auth.app_token_file("orphan", daemon.state_dir).exists()
            disk.full = False
            call = stub.RequestResourceAllocation(_ask("orphan"), timeout=10)  # the caller's retry
            reply = await call
            token = dict(await call.trailing_metadata() or ()).get(auth.APP_TOKEN_TRAILER, "")
            assert reply.grant.app_id == "orphan" and token
            await stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=reply.grant.grant_id),
                                        metadata=auth.bearer(token), timeout=10)
        finally:
            daemon.store._db = disk.db
