"""The grpc.aio `Ingest` servicer: profiler streams in, `IngestReply`s out.

Each stream keeps its own state (the applications it sent, the decisions it has been given), so a
reply carries the decisions made since the stream's previous reply for its own applications.
Malformed signatures are rejected inside the reply; bytes that are no `SignatureBatch` end the
stream with INVALID_ARGUMENT; an unexpected failure while handling a batch is logged and answered
with every signature of that batch rejected, and the stream goes on.

Replies are sent when they say something. A batch whose reply would carry neither decisions nor
rejections is acknowledged later: its `accepted` count is added to the stream's next reply, which
goes out at the latest `ack_interval_s` after the previous one, and when the profiler ends the
stream (whenever a batch is still unanswered, even one that brought nothing to accept). At 10 Hz
with decisions once a second this halves the messages of a stream, and each message costs the
manager more CPU than the work it carries (docs/performance.md). With `ack_interval_s` 0 every
batch is answered.

A reply's `tick` is what the profiler counts as delivered: it resends, after a reconnect, the
batches no reply had covered when its stream broke (profiler/stream.py). Those this manager had
read are already in its windows: the manager drops such a signature (`WindowStore.holds`: same
application, seq and time as a sample the window has) quietly: no Rejection, no log line of its own,
counted in the manager's stats and per stream (the `profiler_disconnected`
line). A restarted manager holds nothing, so it takes the resent batches like any other.

`replay_ok()` is asked once per stream, as it opens (the daemon: the caller is the operator, or it
accepts replays): a stream for which it is False has its signatures taken only for processes the
node runs (`StreamState.replay_ok`, manager/core.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from vgpu.log import get_logger
from vgpu.manager.core import Manager, StreamState
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc

_log = get_logger("vgpu.manager.service")


class IngestServicer(ingest_pb2_grpc.IngestServicer):
    def __init__(self, manager: Manager, *, ack_interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, replay_ok: Callable[[], bool] | None = None,
                 on_stream_end: Callable[[StreamState], object] | None = None) -> None:
        if not ack_interval_s >= 0:
            raise ValueError(f"ack_interval_s must be >= 0, got {ack_interval_s}")
        self.manager = manager
        self.ack_interval_s = ack_interval_s
        self.clock = clock
        self.replay_ok = replay_ok or (lambda: True)
        # called with each stream once it has ended (closed), e.g. to release what only it kept alive
        self.on_stream_end = on_stream_end
        self.streams_open = 0

    # The read/write form (context.read / context.write) rather than iterating and yielding: grpc.aio
    # runs an async-generator handler through more machinery per message. mypy-protobuf's servicer stub
    # knows only the iterator forms, hence the narrow ignore.
    async def StreamSignatures(  # type: ignore[override]  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[ingest_pb2.SignatureBatch], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        stream = StreamState(peer=context.peer(), replay_ok=self.replay_ok())
        self.streams_open += 1
        _log.info("profiler_connected", peer=stream.peer, replay_ok=stream.replay_ok)
        unacked = 0  # signatures accepted since the last reply, not yet reported
        unanswered = False  # a batch no reply has covered yet
        last_tick = 0
        last_reply_s = self.clock()
        try:
            while True:
                try:
                    batch = await context.read()
                except DecodeError as exc:  # bytes that are no SignatureBatch: the sender's fault
                    _log.warning("undecodable_batch", peer=stream.peer, error=str(exc))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"a message on this stream is no vgpu.v1.SignatureBatch: {exc}")
                if batch is grpc.aio.EOF:
                    if unanswered:  # the profiler hangs up: what it sent last is acknowledged
                        await context.write(ingest_pb2.IngestReply(tick=last_tick, accepted=unacked))
                    break
                last_tick = batch.tick
                try:
                    reply = await self.manager.ingest_async(batch, stream)
                except Exception as exc:  # noqa: BLE001 - one bad batch must not end the stream
                    _log.error("ingest_failed", peer=stream.peer, tick=batch.tick, error=repr(exc), exc_info=exc)
                    reply = ingest_pb2.IngestReply(tick=batch.tick)
                    for i, sig in enumerate(batch.signatures):
                        reply.rejected.add(index=i, app_id=sig.app_id[:256], reason=f"manager error ({type(exc).__name__})")
                now = self.clock()
                if not reply.decisions and not reply.rejected and now - last_reply_s < self.ack_interval_s:
                    unacked += reply.accepted
                    unanswered = True
                    continue
                reply.accepted += unacked
                unacked = 0
                unanswered = False
                last_reply_s = now
                await context.write(reply)
        finally:
            self.streams_open -= 1
            stream.closed = True
            _log.info("profiler_disconnected", peer=stream.peer, duplicates=stream.duplicates)
            if self.on_stream_end is not None and stream.apps:
                try:
                    self.on_stream_end(stream)
                except Exception as exc:  # noqa: BLE001 - what follows a stream's end must not fail its call
                    _log.error("stream_end_failed", peer=stream.peer, error=repr(exc), exc_info=exc)

