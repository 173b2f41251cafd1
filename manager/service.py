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
read are already in its windows: such a signature (`WindowStore.holds`: same application, seq and
time as a sample the window has) is dropped before the batch reaches the manager, quietly: no
Rejection, no log line of its own, counted in `WindowStore.duplicates` (and per stream in the
`profiler_disconnected` line). Rejection indexes still refer to the batch as sent. A restarted
manager holds nothing, so it takes the resent batches like any other.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from manager.core import Manager, StreamState
from manager.window import WindowStore
from vgpu.log import get_logger
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc

_log = get_logger("vgpu.manager.service")


class IngestServicer(ingest_pb2_grpc.IngestServicer):
    def __init__(self, manager: Manager, *, ack_interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ack_interval_s >= 0:
            raise ValueError(f"ack_interval_s must be >= 0, got {ack_interval_s}")
        self.manager = manager
        self.ack_interval_s = ack_interval_s
        self.clock = clock
        self.streams_open = 0

    # The read/write form (context.read / context.write) rather than iterating and yielding: grpc.aio
    # runs an async-generator handler through more machinery per message. mypy-protobuf's servicer stub
    # knows only the iterator forms, hence the narrow ignore.
    async def StreamSignatures(  # type: ignore[override]  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[ingest_pb2.SignatureBatch], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        stream = StreamState(peer=context.peer())
        self.streams_open += 1
        _log.info("profiler_connected", peer=stream.peer)
        unacked = 0  # signatures accepted since the last reply, not yet reported
        unanswered = False  # a batch no reply has covered yet
        duplicates = 0  # resent signatures this stream brought that the windows already held
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
                batch, sent_index = without_held(batch, self.manager.windows)
                if sent_index is not None:
                    duplicates += sent_index.dropped
                try:
                    reply = await self.manager.ingest_async(batch, stream)
                except Exception as exc:  # noqa: BLE001 - one bad batch must not end the stream
                    _log.error("ingest_failed", peer=stream.peer, tick=batch.tick, error=repr(exc), exc_info=exc)
                    reply = ingest_pb2.IngestReply(tick=batch.tick)
                    for i, sig in enumerate(batch.signatures):
                        reply.rejected.add(index=i, app_id=sig.app_id[:256], reason=f"manager error ({type(exc).__name__})")
                if sent_index is not None:
                    for r in reply.rejected:
                        r.index = sent_index(r.index)
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
            _log.info("profiler_disconnected", peer=stream.peer, duplicates=duplicates)


class SentIndex:
    """Maps a signature's index in a batch with held signatures taken out back to its index in the
    batch as sent: `rows` the kept rows' indexes, `columns` the kept columnar rows' (relative to the
    columnar part, which starts after `sent_rows` rows in the batch as sent)."""

    def __init__(self, rows: list[int], sent_rows: int, columns: np.ndarray, dropped: int) -> None:
        self.rows = rows
        self.sent_rows = sent_rows
        self.columns = columns
        self.dropped = dropped

    def __call__(self, index: int) -> int:
        if index < len(self.rows):
            return self.rows[index]
        j = index - len(self.rows)
        return self.sent_rows + (int(self.columns[j]) if j < len(self.columns) else j)


def without_held(batch: ingest_pb2.SignatureBatch,
                 windows: WindowStore) -> tuple[ingest_pb2.SignatureBatch, SentIndex | None]:
    """`batch` less the signatures `windows` already holds (a profiler's resend after a reconnect),
    and the map from the new batch's indexes back to the sent one's; (batch, None) when nothing is
    held, the usual case, which costs a window lookup per row (per application for columns). The held ones are counted in
    `windows.duplicates`. A columnar part whose arrays do not fit together is left as it is (the
    manager rejects it with the reason)."""
    rows = batch.signatures
    behind = windows.behind
    held_rows = [i for i, s in enumerate(rows) if behind(s.app_id, s.seq, s.timestamp_s)]
    if held_rows:  # resent or late: which does the window have?
        maybe = [rows[i] for i in held_rows]
        held = windows.holds_rows([s.app_id for s in maybe], np.arange(len(maybe)),
                                  np.array([s.seq for s in maybe], dtype=np.uint64),
                                  np.array([s.timestamp_s for s in maybe], dtype=np.float64))
        held_rows = [i for i, h in zip(held_rows, held.tolist(), strict=True) if h]
    held_cols = _held_columns(batch.columns, windows) if batch.HasField("columns") else None
    n_cols = 0 if held_cols is None else int(held_cols.sum())
    if not held_rows and not n_cols:
        return batch, None
    out = ingest_pb2.SignatureBatch(profiler_id=batch.profiler_id, tick=batch.tick, sent_at_s=batch.sent_at_s,
                                    dropped_since_last=batch.dropped_since_last)
    skip = set(held_rows)
    kept_rows = [i for i in range(len(rows)) if i not in skip]
    out.signatures.extend(rows[i] for i in kept_rows)
    kept_cols = np.arange(len(batch.columns.seq_u64) // 8)
    if held_cols is not None and n_cols:
        kept_cols = np.flatnonzero(~held_cols)
        if len(kept_cols):
            out.columns.CopyFrom(_take_columns(batch.columns, kept_cols))
    elif batch.HasField("columns"):
        out.columns.CopyFrom(batch.columns)
    windows.duplicates += len(held_rows) + n_cols
    return out, SentIndex(kept_rows, len(rows), kept_cols, len(held_rows) + n_cols)


def _held_columns(msg: ingest_pb2.SignatureColumns, windows: WindowStore) -> np.ndarray | None:
    """Which columnar rows the windows hold, or None when the arrays do not fit together."""
    n, odd = divmod(len(msg.seq_u64), 8)
    names = len(msg.column_names)
    if (odd or len(msg.timestamp_s_f64) != 8 * n or len(msg.app_index_u32) != 4 * n
            or len(msg.device_index_u32) != 4 * n or len(msg.pid_u32) not in (0, 4 * n)
            or len(msg.values_f64) != 8 * n * names):
        return None
    return windows.holds_rows(msg.app_ids, np.frombuffer(msg.app_index_u32, "<u4"),
                              np.frombuffer(msg.seq_u64, "<u8"), np.frombuffer(msg.timestamp_s_f64, "<f8"))


def _take_columns(msg: ingest_pb2.SignatureColumns, keep: np.ndarray) -> ingest_pb2.SignatureColumns:
    """The rows `keep` of a columnar part whose arrays fit together (`_held_columns`)."""
    n = len(msg.seq_u64) // 8

    def take(data: bytes, dtype: str) -> bytes:
        return bytes(np.frombuffer(data, dtype)[keep].tobytes())

    values = np.frombuffer(msg.values_f64, "<f8").reshape(len(msg.column_names), n)[:, keep]
    return ingest_pb2.SignatureColumns(
        app_ids=msg.app_ids, device_ids=msg.device_ids, column_names=msg.column_names,
        app_index_u32=take(msg.app_index_u32, "<u4"), device_index_u32=take(msg.device_index_u32, "<u4"),
        seq_u64=take(msg.seq_u64, "<u8"), timestamp_s_f64=take(msg.timestamp_s_f64, "<f8"),
        pid_u32=take(msg.pid_u32, "<u4") if msg.pid_u32 else b"", values_f64=values.tobytes())
