"""The grpc.aio `Ingest` servicer: profiler streams in, one `IngestReply` per batch out.

Each stream keeps its own state (the applications it sent, the decisions it has been given), so a
reply carries the decisions made since the stream's previous reply for its own applications.
Malformed signatures are rejected inside the reply; an unexpected failure while handling a batch is
logged and answered with every signature of that batch rejected, and the stream goes on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from manager.core import Manager, StreamState
from vgpu.log import get_logger
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc

_log = get_logger("vgpu.manager.service")


class IngestServicer(ingest_pb2_grpc.IngestServicer):
    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self.streams_open = 0

    async def StreamSignatures(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[ingest_pb2.SignatureBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ingest_pb2.IngestReply]:
        stream = StreamState(peer=context.peer())
        self.streams_open += 1
        _log.info("profiler_connected", peer=stream.peer)
        try:
            async for batch in request_iterator:
                try:
                    reply = await self.manager.ingest_async(batch, stream)
                except Exception as exc:  # noqa: BLE001 - one bad batch must not end the stream
                    _log.error("ingest_failed", peer=stream.peer, tick=batch.tick, error=repr(exc), exc_info=exc)
                    reply = ingest_pb2.IngestReply(tick=batch.tick)
                    for i, sig in enumerate(batch.signatures):
                        reply.rejected.add(index=i, app_id=sig.app_id[:256], reason=f"manager error ({type(exc).__name__})")
                yield reply
        finally:
            self.streams_open -= 1
            _log.info("profiler_disconnected", peer=stream.peer)
