"""Stream one `SignatureBatch` per tick to the manager's `Ingest.StreamSignatures`, come what may.

* **Fixed rate on monotonic deadlines.** Tick k is due at `start + k * period`. A tick that finds itself a
  whole period or more behind skips to the latest due deadline; the skipped ticks are counted in
  `late_ticks` and never run in a burst to catch up. Tick numbers in the batches skip with them.
* **Reconnects** with capped exponential backoff and jitter (`Backoff`), on its own task so ticks keep
  their pace while the manager is away. The backoff restarts once a batch has gone through.
* **At-least-once delivery within a bounded buffer.** A signature waits in `buffer` (pending) until it is
  written in a batch, then in the unacknowledged queue until a reply whose `tick` is at least its batch's
  arrives (the stream is ordered: one reply acknowledges every earlier batch; the manager answers at
  least every `ack_interval_ms` and when the stream ends). When the stream breaks, the unacknowledged
  signatures go back in front of the pending ones, in order, and are written again after the reconnect
  (`resent`, logged once per reconnect). A manager that had read some of them drops those quietly
  (same application, seq and time as a sample in its window; Manager.accept); a restarted one
  takes them all. So, while the profiler runs, every signature the source produced reaches the manager
  at least once (and its window once), unless the bound drops it, and then it is counted.
* **The bound** covers both: unacknowledged + pending <= `buffer_max`. When full, the oldest go first.
  A pending signature dropped is counted at once (`dropped_total`), logged when drops start, and
  reported in the next batch's `dropped_since_last`. An unacknowledged one dropped (`unacked_dropped`)
  was written, so it is most likely delivered: it is counted as dropped only if its stream then breaks
  before a reply covers it. A drop report is itself delivered at least once (re-reported when the batch
  carrying it was not acknowledged), so the manager's count may exceed the profiler's, never fall short.
  `dropped_written` counts the dropped signatures that had been written before: the manager may hold
  them after all.
* **A clean end** (stop) writes what is pending in one last batch, half-closes the stream and waits up to
  `final_ack_timeout_s` for the manager's last reply; what stays unacknowledged is logged.

Clock, sleep, random, the channel factory and a reply callback are constructor arguments.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from vgpu.client import grpc_target
from vgpu.config import MAX_BATCH_BYTES
from vgpu.log import Logger, get_logger, worth_logging
from vgpu.profiler.source import SignatureSource
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc, signature_pb2
from vgpu.wire import columns_from_signatures

Sleep = Callable[[float], Awaitable[None]]
# A batch stays within half the daemon's smallest receive limit (server.max_request_bytes); a tick of
# 256 applications is 55-115 KiB as columns (115 with 256-character app ids).
DEFAULT_MAX_BATCH_BYTES = MAX_BATCH_BYTES
# A batch of this many signatures or more goes as columns (vgpu/wire.py), which the manager
# reads about ten times faster; smaller ones go as rows, with their host and in-app counters.
DEFAULT_COLUMNS_FROM = 256
_FIELD_OVERHEAD_BYTES = 6  # a signature's tag and length prefix inside the batch
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass(frozen=True)
class Backoff:
    """Delay before reconnect attempt n (0-based): min(max_s, initial_s * multiplier**n), times a random
    factor in [1 - jitter, 1 + jitter], and never above max_s."""

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not (self.initial_s > 0 and self.max_s >= self.initial_s and self.multiplier >= 1 and 0 <= self.jitter < 1):
            raise ValueError(f"bad backoff {self}: need 0 < initial_s <= max_s, multiplier >= 1, 0 <= jitter < 1")

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return min(self.max_s, base * rng.uniform(1 - self.jitter, 1 + self.jitter))


class FixedRateSchedule:
    """Deadlines start_s + k * period_s; pure, so its arithmetic is tested without a loop."""

    def __init__(self, period_s: float, start_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"period must be positive, got {period_s}")
        self.period_s = period_s
        self.start_s = start_s
        self._k = 0

    def next(self, now_s: float) -> tuple[int, float, int]:
        """(tick index, its deadline, ticks skipped) for the next tick, given the time now."""
        k = self._k
        deadline = self.start_s + k * self.period_s
        skipped = 0
        if now_s - deadline >= self.period_s:
            skipped = int(math.floor((now_s - deadline) / self.period_s))
            k += skipped
            deadline = self.start_s + k * self.period_s
        self._k = k + 1
        return k, deadline, skipped


@dataclass
class LoopStats:
    ticks: int = 0
    late_ticks: int = 0  # deadlines skipped because the loop was a period or more behind
    max_lag_s: float = 0.0  # worst delay between a tick's deadline and its start


class FixedRateLoop:
    """Runs `tick(k)` at each deadline of a `FixedRateSchedule` until `stop` is set or `max_ticks` ran."""

    def __init__(
        self,
        period_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.period_s = period_s
        self._clock = clock
        self._sleep = sleep
        self.stats = LoopStats()

    async def run(
        self,
        tick: Callable[[int], Awaitable[None]],
        stop: asyncio.Event,
        max_ticks: int | None = None,
    ) -> LoopStats:
        schedule = FixedRateSchedule(self.period_s, self._clock())
        while not stop.is_set() and (max_ticks is None or self.stats.ticks < max_ticks):
            k, deadline, skipped = schedule.next(self._clock())
            self.stats.late_ticks += skipped
            now = self._clock()
            if deadline > now:
                await self._sleep(deadline - now)
                if stop.is_set():
                    break
            self.stats.max_lag_s = max(self.stats.max_lag_s, self._clock() - deadline)
            await tick(k)
            self.stats.ticks += 1
        return self.stats


@dataclass
class StreamStats:
    batches_sent: int = 0
    signatures_sent: int = 0  # written, resends included
    dropped_total: int = 0  # given up for lost (and reported in dropped_since_last)
    dropped_written: int = 0  # of those, written once before: the manager may hold them after all
    acked: int = 0  # signatures a reply acknowledged
    resent: int = 0  # signatures written again after a broken stream (the first write may have failed)
    unacked_dropped: int = 0  # dropped by the bound while unacknowledged (lost only if the stream broke)
    connects: int = 0
    connect_failures: int = 0
    disconnects: int = 0
    replies: int = 0
    decisions: int = 0
    rejected: int = 0
    source_errors: int = 0
    refused: int = 0  # streams the manager refused (no or a bad token)
    oversized: int = 0  # signatures dropped because one alone is over max_batch_bytes


@dataclass(slots=True)
class _Written:
    """One written batch not yet acknowledged: its tick, its signatures still held, the drop count it
    reported, and how many of its signatures the bound has dropped since (`forgotten`)."""

    tick: int
    sigs: deque[signature_pb2.BehavioralSignature]
    reported: int
    forgotten: int = 0


class SignatureStreamer:
    """Pulls `source.sample()` every `period_s` and streams the signatures to the manager at `target`
    (`unix:///run/vgpu/vgpu.sock`, a socket path, or host:port).

    `buffer_max` bounds the signatures held while disconnected; `max_batch` and `max_batch_bytes` bound
    one batch (the rest waits for the next tick; one signature alone over the byte budget is dropped and
    counted in `dropped_total`, `oversized` and the next `dropped_since_last`). A batch of `columns_from`
    signatures or more (a backlog, a big node) is sent as one `SignatureColumns` (window values only:
    no host or in-app counters; signatures the manager would reject stay rows, so it says why); None
    sends rows always. `on_reply` is called with each `IngestReply`. `clock`/`sleep` pace the
    ticks, `rng` jitters the backoff, `wall_clock` stamps `sent_at_s`; `channel_factory(target)` makes the
    grpc.aio channel (tests may wrap it). `metadata()` is called at every (re)connect for the stream's call
    metadata (the profiler token: `authorization: Bearer ...`, see vgpu/auth.py); a stream the manager
    refuses (UNAUTHENTICATED / PERMISSION_DENIED) is logged as `manager refused the profiler` and retried
    with backoff, so a token that is fixed (or a daemon whose tokens change) is picked up.
    `final_ack_timeout_s` bounds the wait for the manager's last reply when the stream ends cleanly.
    Delivery (at least once within `buffer_max`) is described in the module docstring.
    """

    def __init__(
        self,
        source: SignatureSource,
        target: str,
        *,
        period_s: float = 0.1,
        profiler_id: str | None = None,
        buffer_max: int = 10_000,
        max_batch: int = 2_000,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        columns_from: int | None = DEFAULT_COLUMNS_FROM,
        backoff: Backoff | None = None,
        connect_timeout_s: float = 2.0,
        write_timeout_s: float = 1.0,
        final_ack_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        backoff_sleep: Sleep | None = None,
        rng: random.Random | None = None,
        channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
        on_reply: Callable[[ingest_pb2.IngestReply], None] | None = None,
        metadata: Callable[[], Sequence[tuple[str, str]]] | None = None,
        sample_in_thread: bool = False,
        logger: Logger | None = None,
    ) -> None:
        if buffer_max < 1 or max_batch < 1 or max_batch_bytes < 1024:
            raise ValueError("buffer_max and max_batch must be at least 1, max_batch_bytes at least 1024")
        self.source = source
        self.target = grpc_target(target)
        self.profiler_id = profiler_id or f"{socket.gethostname()}:profiler"
        self.buffer_max = buffer_max
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.columns_from = columns_from
        self.backoff = backoff or Backoff()
        self._connect_timeout_s = connect_timeout_s
        self._write_timeout_s = write_timeout_s
        self._final_ack_timeout_s = final_ack_timeout_s
        self._wall = wall_clock
        self._backoff_sleep = backoff_sleep or asyncio.sleep
        self._rng = rng or random.Random()
        self._channel_factory = channel_factory or (lambda t: grpc.aio.insecure_channel(t))
        self._on_reply = on_reply
        self._metadata = metadata
        self._in_thread = sample_in_thread
        self._log = logger or get_logger("vgpu.profiler.stream")
        self.loop = FixedRateLoop(period_s, clock=clock, sleep=sleep)
        self.stats = StreamStats()
        self.buffer: deque[signature_pb2.BehavioralSignature] = deque()  # pending, oldest first
        self._written: deque[_Written] = deque()  # unacknowledged batches, oldest first
        self._unacked = 0  # signatures held in self._written
        self._resend_left = 0  # how many at the front of `buffer` were written before (put back)
        self._last_tick = -1  # the tick of the last batch written
        self._sending = asyncio.Lock()
        self.dropped_since_last = 0
        self._dropping = False
        self._forgetting = False
        self._stop = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None  # type: ignore[type-arg]
        self._lost: asyncio.Event | None = None
        self._sent_ok = False
        self._reader: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._call is not None

    @property
    def unacked(self) -> int:
        """Signatures written and not yet acknowledged (held for a resend)."""
        return self._unacked

    def stop(self) -> None:
        self._stop.set()

    async def run(self, *, max_ticks: int | None = None) -> StreamStats:
        """Tick until `stop()` (or `max_ticks`); then flush once, close the stream and the channel."""
        conn = asyncio.create_task(self._connection_loop(), name="profiler-connection")
        try:
            await self.loop.run(self._tick, self._stop, max_ticks)
            if self.connected and self.buffer:
                await self._send(self._last_tick + 1)
        finally:
            self._stop.set()
            conn.cancel()
            await asyncio.gather(conn, return_exceptions=True)
            await self._close_call(done_writing=True)
        self._log.info(
            "profiler stream stopped",
            ticks=self.loop.stats.ticks,
            late_ticks=self.loop.stats.late_ticks,
            sent=self.stats.signatures_sent,
            acked=self.stats.acked,
            resent=self.stats.resent,
            rejected=self.stats.rejected,
            dropped=self.stats.dropped_total,
            unacked=self._unacked,
            buffered=len(self.buffer),
        )
        return self.stats

    # --- ticks ---------------------------------------------------------------------------------------
    async def _tick(self, k: int) -> None:
        try:
            sigs = await asyncio.to_thread(self.source.sample) if self._in_thread else self.source.sample()
        except Exception as exc:  # noqa: BLE001 - a bad tick is counted, the loop goes on
            self.stats.source_errors += 1
            if worth_logging(self.stats.source_errors):
                self._log.error("signature source failed", error=repr(exc), count=self.stats.source_errors)
            sigs = []
        self.enqueue(sigs)
        if self.connected:
            await self._send(k)

    def enqueue(self, sigs: list[signature_pb2.BehavioralSignature]) -> None:
        """Add signatures to the buffer; beyond `buffer_max` signatures held (unacknowledged and
        pending), drop the oldest: unacknowledged ones first (counted as dropped only if their stream
        breaks before a reply covers them, `_put_back`), then pending ones (counted at once)."""
        self.buffer.extend(sigs)
        over = len(self.buffer) + self._unacked - self.buffer_max
        if over <= 0:
            return
        forgotten = self._forget_unacked(over)
        dropped = over - forgotten
        for _ in range(dropped):
            self.buffer.popleft()
        written = min(dropped, self._resend_left)  # put back after a broken stream: written before
        self._resend_left -= written
        self.stats.dropped_written += written
        self.dropped_since_last += dropped
        self.stats.dropped_total += dropped
        if dropped and not self._dropping:
            self._dropping = True
            self._log.warning(
                "signature buffer full; dropping the oldest", buffer_max=self.buffer_max, connected=self.connected,
            )
        if forgotten and not self._forgetting:  # once per stream: most likely delivered, so no warning
            self._forgetting = True
            self._log.info(
                "unacknowledged signatures over the buffer bound are no longer held for a resend",
                buffer_max=self.buffer_max, unacked=self._unacked,
                hint="a buffer that holds less than the manager's ack interval of signatures cannot resend them all",
            )

    def _forget_unacked(self, n: int) -> int:
        """Drop up to `n` of the oldest unacknowledged signatures, noting them in their batch's
        `forgotten`; returns how many. A batch left with no signatures hands its counts to the next
        one (a reply that covers the next covers it), so empty entries do not pile up."""
        done = 0
        written = self._written
        while done < n and self._unacked:
            head = written[0]
            take = min(n - done, len(head.sigs))
            for _ in range(take):
                head.sigs.popleft()
            head.forgotten += take
            self._unacked -= take
            done += take
            if not head.sigs and len(written) > 1:
                written.popleft()
                written[0].reported += head.reported
                written[0].forgotten += head.forgotten
        self.stats.unacked_dropped += done
        return done

    def _acknowledge(self, tick: int) -> None:
        """A reply covering batches up to `tick`: they were delivered; stop holding them."""
        written = self._written
        while written and written[0].tick <= tick:
            head = written.popleft()
            self._unacked -= len(head.sigs)
            self.stats.acked += len(head.sigs) + head.forgotten

    def _put_back(self) -> int:
        """The stream broke: the unacknowledged signatures go back in front of the pending ones, in
        order, to be written again; the drop counts their batches carried are reported again, and
        signatures the bound dropped from them are now counted as dropped (they may be lost).
        Returns how many signatures were put back."""
        back = self._unacked
        for w in reversed(self._written):
            self.buffer.extendleft(reversed(w.sigs))
            self.dropped_since_last += w.reported + w.forgotten
            self.stats.dropped_total += w.forgotten
            self.stats.dropped_written += w.forgotten
        self._written.clear()
        self._unacked = 0
        self._resend_left += back
        self._forgetting = False
        return back

    async def _send(self, k: int) -> None:
        async with self._sending:  # the stream's end puts the unacknowledged back only between writes
            await self._send_one(k)

    async def _send_one(self, k: int) -> None:
        call = self._call
        if call is None:
            return
        n, batch = self._next_batch(k)
        try:
            await asyncio.wait_for(call.write(batch), self._write_timeout_s)
            ok = True
        except Exception as exc:  # noqa: BLE001 - any failed write means the stream is gone
            ok = False
            if self._call is call:
                self._log.warning("write to manager failed; buffering", error=_describe(exc), buffered=len(self.buffer))
                self._mark_lost()
        # Written, or perhaps written (a failed write may still have gone out): held until a reply
        # covers it, or put back in front of the pending signatures when the stream breaks.
        held = deque(self.buffer.popleft() for _ in range(n))
        again = min(n, self._resend_left)
        self._resend_left -= again
        self.stats.resent += again
        if n:
            self._written.append(_Written(k, held, self.dropped_since_last))
            self._unacked += n
        elif self.dropped_since_last:  # only a drop report: the last batch held carries it (acknowledged later)
            if self._written:
                self._written[-1].tick = k
                self._written[-1].reported += self.dropped_since_last
            else:
                self._written.append(_Written(k, deque(), self.dropped_since_last))
        self._last_tick = k
        if ok and self.dropped_since_last:
            self._log.info("reported dropped signatures", dropped=self.dropped_since_last)
        self.dropped_since_last = 0
        if not ok:
            return
        self._dropping = False
        self._sent_ok = True
        self.stats.batches_sent += 1
        self.stats.signatures_sent += n

    def _next_batch(self, k: int) -> tuple[int, ingest_pb2.SignatureBatch]:
        """Batch `k` of the signatures at the front of the buffer, and how many it carries: at most
        `max_batch` and `max_batch_bytes` serialised (a message over the daemon's receive limit ends
        the stream). Columns carry every known column for every row, so signatures that are small as
        rows may be larger as columns: such a batch is halved until it is within the budget (the rest
        waits for the next tick)."""
        n = self._batch_len()
        batch = self._batch(k, n)
        while n > 1 and batch.ByteSize() > self.max_batch_bytes:
            n //= 2
            batch = self._batch(k, n)
        return n, batch

    def _batch(self, k: int, n: int) -> ingest_pb2.SignatureBatch:
        """Batch `k` of the first `n` buffered signatures: as columns from `columns_from` on, else rows."""
        sigs = [self.buffer[i] for i in range(n)]
        batch = ingest_pb2.SignatureBatch(
            profiler_id=self.profiler_id, tick=k, sent_at_s=self._wall(), dropped_since_last=self.dropped_since_last
        )
        if self.columns_from is not None and n >= self.columns_from:
            columns, rows = columns_from_signatures(sigs)
            batch.columns.CopyFrom(columns)
            batch.signatures.extend(rows)
        else:
            batch.signatures.extend(sigs)
        return batch

    def _batch_len(self) -> int:
        """How many signatures from the front of the buffer go in the next batch: at most `max_batch`
        and `max_batch_bytes` serialised (the manager refuses a message over its receive limit,
        server.max_request_bytes, and ends the stream). A signature alone over the byte budget could never be sent:
        it is dropped and counted like a buffer overflow."""
        n = size = 0
        while n < min(len(self.buffer), self.max_batch):
            b = self.buffer[n].ByteSize() + _FIELD_OVERHEAD_BYTES
            if b > self.max_batch_bytes:
                app_id = self.buffer[n].app_id[:64]
                del self.buffer[n]
                self.dropped_since_last += 1
                self.stats.dropped_total += 1
                self.stats.oversized += 1
                self._log.warning("dropping a signature too large to send", app_id=app_id,
                                  bytes=b, max_batch_bytes=self.max_batch_bytes)
                continue
            if size + b > self.max_batch_bytes:
                break
            size += b
            n += 1
        return n

    # --- connection ----------------------------------------------------------------------------------
    async def _connection_loop(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            self._sent_ok = False
            try:
                await self._connect()
            except Exception as exc:  # noqa: BLE001 - every failure to connect is retried
                self.stats.connect_failures += 1
                if attempt == 0 or attempt % 10 == 0:
                    self._log.warning("cannot reach manager", target=self.target, error=_describe(exc), attempt=attempt)
                await self._close_call()
            else:
                assert self._lost is not None
                await self._lost.wait()
                self.stats.disconnects += 1
                await self._close_call()  # the reader is gone: no reply can acknowledge anything now
                async with self._sending:  # a write under way ends first (its batch is then held too)
                    back = self._put_back()
                self._log.warning("lost the manager stream; reconnecting", target=self.target,
                                  resending=back, buffered=len(self.buffer))
                if self._sent_ok:
                    attempt = 0
            if self._stop.is_set():
                return
            await self._backoff_sleep(self.backoff.delay_s(attempt, self._rng))
            attempt += 1

    async def _connect(self) -> None:
        channel = self._channel_factory(self.target)
        self._channel = channel
        await asyncio.wait_for(channel.channel_ready(), self._connect_timeout_s)
        md = tuple(self._metadata()) if self._metadata is not None else ()
        call = ingest_pb2_grpc.IngestStub(channel).StreamSignatures(metadata=md or None)
        self._lost = asyncio.Event()
        self._call = call
        self.stats.connects += 1
        self._reader = asyncio.get_running_loop().create_task(self._read_replies(call, self._lost))
        self._log.info(
            "connected to manager",
            target=self.target,
            buffered=len(self.buffer),
            dropped_since_last=self.dropped_since_last,
        )

    async def _read_replies(self, call: grpc.aio.StreamStreamCall, lost: asyncio.Event) -> None:  # type: ignore[type-arg]
        try:
            async for reply in call:
                self.stats.replies += 1
                self._acknowledge(reply.tick)
                self.stats.decisions += len(reply.decisions)
                if reply.rejected:
                    self.stats.rejected += len(reply.rejected)
                    first = reply.rejected[0]
                    self._log.warning(
                        "manager rejected signatures", tick=reply.tick, count=len(reply.rejected),
                        app_id=first.app_id, reason=first.reason,
                    )
                if self._on_reply is not None:
                    try:
                        self._on_reply(reply)
                    except Exception as exc:  # noqa: BLE001 - a caller's callback must not kill the stream
                        self._log.error("reply callback failed", error=repr(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _REFUSED:
                self.stats.refused += 1
                if worth_logging(self.stats.refused):
                    self._log.error(
                        "manager refused the profiler", error=_describe(exc), count=self.stats.refused,
                        hint="check the profiler token (--token-file) or the daemon's auth.open_ingest",
                    )
            elif not self._stop.is_set():
                self._log.warning("reply stream ended", error=_describe(exc))
        if self._call is call:
            self._call = None
        lost.set()

    def _mark_lost(self) -> None:
        self._call = None
        if self._lost is not None:
            self._lost.set()

    async def _close_call(self, *, done_writing: bool = False) -> None:
        call, channel, reader = self._call, self._channel, self._reader
        self._call, self._channel, self._reader = None, None, None
        if call is not None:
            if done_writing:
                # half-close, then give the manager a moment to acknowledge what it got and end the stream
                try:
                    await asyncio.wait_for(call.done_writing(), self._final_ack_timeout_s)
                    if reader is not None:
                        await asyncio.wait_for(asyncio.shield(reader), self._final_ack_timeout_s)
                except Exception:  # noqa: BLE001, S110 - closing a broken stream
                    pass
            call.cancel()
        if reader is not None and not reader.done():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if channel is not None:
            await channel.close(grace=None)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return repr(exc)
