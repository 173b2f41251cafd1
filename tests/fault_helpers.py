"""Helpers shared by the fault tests: waiting for a condition on the event loop, and a manager served
on a Unix socket with profilers streaming to it that can be stopped and started again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from vgpu.allocator.service import Server, build_server
from vgpu.manager.core import Manager
from vgpu.manager.service import IngestServicer
from vgpu.profiler.stream import SignatureStreamer


async def until(pred: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait until `pred()` holds; AssertionError after `timeout_s` (generous: it ends as soon as
    `pred()` holds, and a loaded machine can take seconds for what takes milliseconds alone)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


class Link:
    """`async with Link(tmp_path, manager, make_streamers)`: the manager's Ingest server on a Unix socket
    and the streamers `make_streamers(address)` builds, running; `stop_server` / `start_server` take the
    manager away and bring it (or a new one) back; leaving stops the streamers, then the server. The
    servicer answers quiet batches every `ack_interval_s` (0: every batch)."""

    def __init__(self, tmp_path: Path, manager: Manager,
                 make_streamers: Callable[[str], list[SignatureStreamer]], *, ack_interval_s: float = 0.0) -> None:
        self.address = f"unix:{tmp_path}/m.sock"
        self.manager = manager
        self.ack_interval_s = ack_interval_s
        self.streamers = make_streamers(self.address)
        self._server: Server | None = None
        self._tasks: list[asyncio.Task[object]] = []

    async def start_server(self, manager: Manager | None = None) -> None:
        if manager is not None:
            self.manager = manager
        servicer = IngestServicer(self.manager, ack_interval_s=self.ack_interval_s)
        self._server = build_server(self.address, ingest_servicer=servicer)
        await self._server.start()

    async def stop_server(self, grace_s: float | None) -> None:
        assert self._server is not None
        await self._server.stop(grace_s)

    async def __aenter__(self) -> Link:
        await self.start_server()
        self._tasks = [asyncio.create_task(s.run()) for s in self.streamers]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        for s in self.streamers:
            s.stop()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 5.0)
        await asyncio.sleep(0.05)  # the last replies
        if self._server is not None:
            await self._server.stop(0.5)
