"""The `Manager`: signatures in, windows, batched forecasts soon after arrival, decisions out.

It owns the per-application windows (manager/window.py, numpy ring buffers), which applications are
due for a forecast and when, the forecast rounds, the decisions (the newest per application, and
which of them each profiler stream has been given), and when the decisions are handed to the
allocator (`Allocator.apply_recommendations`, in-process). Applications silent for long are evicted
from the windows (so is the one silent longest when a new application finds the store full); the
manager then forgets them (`_forget`) and the allocator releases their forecast grants.

The path of one batch (`ingest_async`, called by the Ingest servicer, manager/service.py):
1. `accept`, on the loop: applications silent too long are evicted; each signature is read in one
   pass (`parse_signature` in vgpu/wire.py: validated and turned into the window's values together;
   a batch's columnar part, `_accept_columns`, is read as arrays by `read_columns`). A signature is
   rejected, with the reason in the reply, when it is malformed, names a device the daemon lacks,
   reads more memory than that device (or MIG instance) has (`device_mem_total_mib`, with the slack of
   `vgpu.wire.mem_limit_mib`), names a process this node does not run (see *Observed processes*), or
   a time too far ahead of the clock;
   one the window already holds (a profiler's resend after a reconnect) is dropped quietly as a
   duplicate; an older one is rejected as out of order. The rest of the batch and the stream go on.
   Kept samples go into the windows and mark their applications dirty.
2. `due_apps`: the dirty applications of this batch that are due (below); the first time a batch
   makes an application due, its boundaries are set (`_anchor_batch`).
3. The due applications join the pending set and the reply waits on a future of its own; the
   round runner (`_run_pending`, one asyncio task at a time) is started when none runs.
4. The runner sleeps `batch_window_s` (longer while the forecasting budget is spent), so every batch
   arriving meanwhile joins the round; then, on the loop, it copies the pending applications'
   windows (`_begin_tick`, a slice copy per application) and, in a worker thread
   (`asyncio.to_thread`), runs one `forecast_batch` over them and turns each forecast into a
   `Decision` (`_decide`).
5. Back on the loop, in one step: the round's waiting replies are woken, then `_act` publishes the
   decisions (`latest`, a serial per decision) and queues the allocator's apply behind the replies
   (`loop.call_soon`), or defers it while the acting budget is spent.
6. Each woken `ingest_async` adds to its reply the decisions its stream has not been given for its
   own applications (`_attach`) and returns it; the servicer writes it.
7. `_apply`, on the loop: the newest undelivered decision of each application still held goes to
   the allocator as one set of recommendations, and the CPU it took is charged to the acting budget.

Threads: everything but the forecast runs on the daemon's one asyncio loop (the windows, the
decisions and the allocator live there); the forecaster runs in a worker thread, at most one round
at a time, so a slow model never stalls other RPCs. `ingest` (no loop: tests, tools) takes the same
steps on the calling thread without waiting: its batch's due applications are forecast at once,
`_act` applies at once, and the reply gets its decisions.

Deciding. An application whose window got new samples is *due* for a forecast when it has at least
`min_samples` samples and either has not been forecast yet, or its last forecast is
`forecast_interval_s` old or more (the per-app rate bound; the daemon's default is 1 s), or the
next of its own *boundaries* (fixed times `forecast_interval_s` apart) has passed since its last
forecast and that forecast is at least half an interval old. An application's boundaries are set
when a batch first makes it due: the k-th application a batch makes due for the first time gets
boundaries k steps of the golden-ratio sequence (fractions of the interval) after the batch's time,
less a twentieth of an interval so that they fall between its profiler's batches. So applications
that arrive together (one profiler stream carries every application of its node in each batch) are
forecast one slice of them per batch instead of all in the same batch once a second: the
forecasting work, and so a decision's wait for the round it is in, is spread evenly over the
interval, while an application arriving alone keeps its own cadence. Boundaries are fixed in time,
so applications do not drift into step (an interval counted from each last forecast would move with
batch timing, and slide to 1.1 s whenever a batch came a hair early); each application is still
forecast once per interval on average (the second forecast of a spread application may come after
half an interval, while it takes its place). So a decision follows its signature by the batching
window plus one forecast, not by up to a whole forecast tick, while the forecasting work stays
bounded at one forecast per application per `forecast_interval_s` (a shorter interval buys fresher
decisions with proportionally more CPU).

Budgets. A forecast call has a fixed cost (a few ms for the shipped model on a CPU whatever the
batch size), so the forecasting thread is held to `forecast_duty_max` of the time (0.25 by default)
by a `DutyBudget`: it earns `forecast_duty_max` seconds of CPU per second, keeps at most
`duty_window_s` (1 s) worth of it, and each round spends its thread CPU time. While the budget
lasts, rounds start after `batch_window_s`; once it is spent, the next round waits until the debt
is earned back and everything that became due meanwhile joins it. So bursts are answered within a
few ms, and under sustained overload the forecasting CPU stays near `forecast_duty_max` of a core
(torch's own intra-op threads come on top), with decisions later and rounds larger.
Each forecast becomes a `Decision` (recommended memory = the peak P90 over the horizons plus
`mem_margin`, recommended SM = the peak P90; `recommend`). An apply plans every application on the
devices it touches (the others stand in with their latest recommendation), so its cost grows with
the applications on a device, not with the decisions it carries: applies are held to
`act_duty_max` of a core (2 % by default) by a second `DutyBudget`. While it lasts, each round's
decisions are applied right after the round, once the replies that waited for it have been woken
(so no reply waits for an apply); once it is spent, decisions wait (the newest per application) for
the first round that ends after it is earned back and are applied together (or, when no round
comes, one forecast interval later). So a node whose applies are cheap acts on every round, and one
with hundreds of applications on a device acts less often on larger sets instead of spending a core
on re-planning.

A round decides for every application in it, whatever fails (`_forecast`, `_decide`):
- the forecaster raises for the round: each application is forecast again alone, so one whose
  features break the model (a NaN where it needs a number) leaves the others on the model; each one
  it fails on alone is *benched* (the fallback forecasts it without asking the model) for
  `BENCH_S`, so a round does not retry it one by one again until then;
- the fallback forecasts what the forecaster could not; where it fails too, the forecast is unknown
  and the application's last value decides (`recommend`: the last observation, plus the margin);
- a forecast that cannot be made a decision (a value that is no number) is replaced by the
  fallback's, then the last value's (a kept signature always has a finite memory value, so there is
  always a last value to decide from);
- a window that cannot be copied (`_begin_tick`) leaves that application out of the round, its
  previous decision (and the grant the allocator made of it) standing, and the others in.
Each kind of failure (`forecaster_failed`, `fallback_failed`, `decision_failed`, `window_failed`)
is logged with the application it struck at most once an hour (`FAILURE_LOG_INTERVAL_S`), not at every
round, the record carrying how many of its kind were left out since the last; each is counted in
`stats.forecast_failures`.

Observed processes. With `pid_observed` (the daemon plugs in its devices' process lists), a stream
that may not replay (`StreamState.replay_ok` False: the profiler token on a node that does not
accept replays) has a signature taken only when the pid it names is a GPU process the node's own
driver lists on the device it names, and no other application's signatures name that pid; anything
else is rejected with the reason. So the profiler token can describe processes that run here, not
invent them; a replay (trace pids, no such process) needs a stream that may replay.
"""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from vgpu.allocator.errors import Stopping
from vgpu.allocator.policy.base import IDLE_MEM_MIB, Recommendation, RecommendationSink
from vgpu.histogram import LatencyHistogram
from vgpu.log import LogBudget, get_logger, worth_logging
from vgpu.manager.baselines import BaselineForecaster
from vgpu.manager.forecast import HORIZONS_S, Forecast, Forecaster, forget_app
from vgpu.manager.window import WindowStore
from vgpu.traces import NUMERIC, AppTrace
from vgpu.v1 import ingest_pb2
from vgpu.wire import (
    COLUMNS,
    MAX_ID_CHARS,
    ColumnRows,
    ColumnsFormatError,
    mem_limit_mib,
    parse_signature,
    read_columns,
)

_MAX_APP_ID = MAX_ID_CHARS
_MEM = COLUMNS.index("mem_used_mib")  # a row's memory reading (process memory, else in-app reserved)
_NB = len(NUMERIC)  # a row's values: the format's columns first, then the in-app counters (vgpu.wire.COLUMNS)
_NAMED_SOURCES = ("model", "mixture")  # forecast sources a decision names; any other is "baseline"
# The share of a core the allocator's acting may take on average (see `Manager._act`).
ACT_DUTY_MAX = 0.02
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # the phase sequence's step (a fraction of the interval)
# An application the forecaster failed on alone is forecast by the fallback for this long before the
# forecaster is tried on it again.
BENCH_S = 60.0
# A kind of round failure is logged at most once in this many seconds; the rest are counted.
FAILURE_LOG_INTERVAL_S = 3600.0
# An application's boundaries sit this fraction of the interval before its first forecast's phase,
# between its profiler's batches rather than on them (a batch a hair early would wait a whole tick).
_LEAD = 0.05


def default_baseline() -> Forecaster:
    """The fallback forecaster: the VPA-style percentile baseline (`vgpu.manager.baselines`)."""
    return BaselineForecaster()


@dataclass(frozen=True)
class Decision:
    app_id: str
    device_id: str
    forecast: Forecast
    recommended_mem_mib: float
    recommended_sm_pct: float
    source: str  # "model", "mixture" or "baseline"
    for_seq: int
    decided_at_s: float
    mem_used_mib: float = math.nan
    sm_util_pct: float = math.nan
    first_use_s: float = math.nan

    def fill_pb(self, msg: ingest_pb2.Decision) -> None:
        """Write the decision into an empty `msg` (a reply's `decisions.add()`: filled in place, not
        built and then copied into the reply)."""
        f = self.forecast
        msg.app_id = self.app_id
        msg.device_id = self.device_id
        add = msg.forecasts.add
        for i, h in enumerate(f.horizons_s):
            add(horizon_s=h, mem_p50_mib=_z(f.mem_p50_mib[i]), mem_p90_mib=_z(f.mem_p90_mib[i]),
                sm_p50_pct=_z(f.sm_p50_pct[i]), sm_p90_pct=_z(f.sm_p90_pct[i]))
        msg.recommended_mem_mib = self.recommended_mem_mib
        msg.recommended_sm_pct = self.recommended_sm_pct
        msg.source = self.source
        msg.for_seq = self.for_seq
        msg.decided_at_s = self.decided_at_s

    def to_recommendation(self) -> Recommendation:
        return Recommendation(
            app_id=self.app_id,
            device_id=self.device_id,
            memory_mib=self.recommended_mem_mib,
            sm_pct=self.recommended_sm_pct,
            source=self.source,
            mem_p90_peak_mib=self.forecast.peak_mem_p90_mib(),
            sm_p90_peak_pct=self.forecast.peak_sm_p90_pct(),
            mem_used_mib=self.mem_used_mib,
            sm_util_pct=self.sm_util_pct,
            for_seq=self.for_seq,
            decided_at_s=self.decided_at_s,
            mem_p50_peak_mib=_peak(self.forecast.mem_p50_mib),
            sm_p50_peak_pct=_peak(self.forecast.sm_p50_pct),
            first_use_s=self.first_use_s,
        )


def _z(x: float) -> float:
    """NaN has no place in a proto double a person reads; unknown is sent as 0 (the field docs say so)."""
    return x if math.isfinite(x) else 0.0


@dataclass
class ManagerStats:
    batches: int = 0
    signatures: int = 0
    accepted: int = 0
    rejected: int = 0
    out_of_order: int = 0
    duplicates: int = 0  # resent signatures the windows already held: dropped quietly, not rejected
    # forecaster calls (one per batch of due applications) and their summed wall time
    forecast_batches: int = 0
    forecast_failures: int = 0
    decisions: int = 0
    evicted: int = 0
    dropped_by_profilers: int = 0
    forecast_s_total: float = 0.0
    # allocator calls with decisions; and rounds whose decisions found the acting budget (`act_duty_max`)
    # spent and were left for a later apply (counted per round, not per decision or per apply)
    applies: int = 0
    applies_deferred: int = 0
    unknown_device: int = 0  # rejected (and in `rejected`): the signature names a device the daemon lacks
    # rejected (and in `rejected`): from a stream that may not replay, naming no GPU process of this
    # node, or a pid another application's signatures name
    unobserved_pid: int = 0
    # rejected (and in `rejected`): the memory reading is above the named device's total memory
    over_capacity: int = 0
    # in-app values left out of kept signatures (not finite, negative, above their bound), by reason
    # (vgpu.wire.inapp_reason: a counter and a kind, never a value: a small, fixed set of keys)
    inapp_dropped: dict[str, int] = field(default_factory=dict)
    # wall time of each forecaster call, and of each tick (windows copied, forecast, allocator acted)
    forecast_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    tick_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass(eq=False)
class StreamState:
    """One profiler stream: which applications it sent, which decisions it has been given."""

    peer: str = ""
    apps: set[str] = field(default_factory=set)
    delivered: int = 0
    duplicates: int = 0
    closed: bool = False  # the stream has ended (set by the servicer)
    # Signatures naming processes the node does not run (a replay) are taken from this stream; when
    # False, only those whose pid the manager's `pid_observed` confirms.
    replay_ok: bool = True


@dataclass(frozen=True)
class Item:
    """One application due for a forecast: its window copied on the loop, with the latest usage."""

    app_id: str
    device_id: str
    seq: int
    window: AppTrace
    mem_used_mib: float
    sm_util_pct: float
    # when the application first used the GPU (`first_use_s`); inf: not yet
    first_use_s: float = math.inf


class DutyBudget:
    """How long the next forecast batch must wait so that the forecasting thread stays busy at most
    `duty` of the time: `duty` seconds of CPU are earned per second, at most `duty * window_s` are
    kept (the burst allowance), and each batch spends the CPU it took. Over any interval T the
    thread is busy at most duty * (T + window_s) plus one batch. window_s 0: no burst; after a
    batch that took d, the next waits d / duty."""

    def __init__(self, duty: float, window_s: float) -> None:
        if not 0 < duty <= 1 or not window_s >= 0:
            raise ValueError(f"duty must be in (0, 1] and window_s >= 0, got {duty} and {window_s}")
        self.duty = duty
        self.cap_s = duty * window_s
        self._credit_s = self.cap_s
        self._at = -math.inf  # when the credit was last brought up to date

    def _earn(self, now: float) -> None:
        if now > self._at:
            self._credit_s = min(self.cap_s, self._credit_s + self.duty * (now - self._at)) if math.isfinite(self._at) \
                else self.cap_s
            self._at = now

    def wait_s(self, now: float) -> float:
        """Seconds from `now` until a batch may start."""
        self._earn(now)
        return max(0.0, -self._credit_s / self.duty)

    def spend(self, now: float, cpu_s: float) -> None:
        """A batch that ended at `now` took `cpu_s` seconds of the thread's CPU."""
        self._earn(now)
        self._credit_s -= max(0.0, cpu_s)


class Manager:
    """See the module docstring. `allocator` None: decide only (tests, dry analysis)."""

    def __init__(
        self,
        allocator: RecommendationSink | None,
        forecaster: Forecaster | None = None,
        *,
        fallback: Forecaster | None = None,
        clock: Callable[[], float] = time.time,
        windows: WindowStore | None = None,
        forecast_interval_s: float = 1.0,
        batch_window_s: float = 0.001,
        forecast_duty_max: float = 0.25,
        duty_window_s: float = 1.0,
        act_duty_max: float = ACT_DUTY_MAX,
        min_samples: int = 3,
        mem_margin: float = 0.10,
        max_future_s: float | None = None,
        logger: structlog.typing.FilteringBoundLogger | None = None,
        device_known: Callable[[str], bool] | None = None,
        pid_observed: Callable[[str, int], bool] | None = None,
        device_mem_total_mib: Callable[[str], float | None] | None = None,
    ) -> None:
        if forecast_interval_s < 0 or batch_window_s < 0 or not 0 < forecast_duty_max <= 1 or not 0 < act_duty_max <= 1:
            raise ValueError("forecast_interval_s and batch_window_s must be >= 0, forecast_duty_max and act_duty_max "
                             "in (0, 1]")
        self.allocator = allocator
        self.fallback = fallback if fallback is not None else default_baseline()
        self.forecaster = forecaster if forecaster is not None else self.fallback
        self.clock = clock
        self.windows = windows if windows is not None else WindowStore()
        self.forecast_interval_s = forecast_interval_s
        self.batch_window_s = batch_window_s
        self.forecast_duty_max = forecast_duty_max
        self._duty = DutyBudget(forecast_duty_max, duty_window_s)
        self.act_duty_max = act_duty_max
        self._act_duty = DutyBudget(act_duty_max, duty_window_s)
        self._unapplied: dict[str, Decision] = {}  # app -> its newest decision not yet given to the allocator
        self._apply_later: asyncio.TimerHandle | None = None
        self._apply_soon: asyncio.Handle | None = None  # an apply queued behind a round's replies
        self.min_samples = min_samples
        self.mem_margin = mem_margin
        # Samples stamped more than this ahead of the clock are rejected (None: no bound).
        self.max_future_s = max_future_s
        self.stats = ManagerStats()
        self.latest: dict[str, Decision] = {}
        self._serial: dict[str, int] = {}  # app -> serial of its latest decision
        self._next_serial = 0
        self._last_forecast_s: dict[str, float] = {}  # app -> when its window was last taken to forecast
        self._anchor_s: dict[str, float] = {}  # app -> one of its forecast boundaries (they are an interval apart)
        self._dirty: set[str] = set()  # apps with samples not yet forecast
        self._pending: set[str] = set()  # due apps waiting for the next batched forecast
        # one future per reply waiting for the next batched forecast (its own, so that a cancelled
        # waiter cancels nothing else, and a finished round wakes each waiter directly)
        self._pending_waiters: list[asyncio.Future[None]] = []
        self._runner: asyncio.Task[None] | None = None
        self._streams: weakref.WeakSet[StreamState] = weakref.WeakSet()
        self._last_kept: set[str] = set()  # the apps the last accepted batch added samples to
        self._delivered_plain = 0  # decisions handed out to callers without stream state
        self._pids: dict[str, int] = {}  # app -> the pid its latest signature named
        self._first_use_s: dict[str, float] = {}  # app -> time of its first signature with GPU use
        self._pid_app: dict[int, str] = {}  # pid -> the app whose signatures named it last
        # Whether `pid` is a GPU process the node's driver lists on `device_id` (None: no check).
        self.pid_observed = pid_observed
        self._device_newest_s: dict[str, float] = {}  # device -> when its newest kept signature arrived
        self._log = logger or get_logger("vgpu.manager")
        self._inapp_dropped_batches: dict[str, int] = {}
        # Whether a signature's device is one the daemon has (None: every device is taken). A
        # signature for another device could never become a grant: it is rejected, with the reason.
        self.device_known = device_known
        self._unknown_devices_said: set[str] = set()
        # A device's total memory, MiB (None: unknown; the callable None: no check). A signature whose
        # memory reading is above it (`mem_limit_mib`) describes no process that device can run: it
        # is rejected, with the value and the capacity in the reason.
        self.device_mem_total_mib = device_mem_total_mib
        self._over_capacity_batches = 0  # batches with such rejections (logged at the 1st, 10th, ...)
        # round failures: the first of each kind is logged, then at most one an hour (carrying the
        # count left out), so a failure that persists is seen again in a log read days later
        self._failures_log = LogBudget(interval_s=FAILURE_LOG_INTERVAL_S, burst=1)
        self._benched: dict[str, float] = {}  # app -> until when the fallback forecasts it (BENCH_S)
        self._apply_refused_said = False
        # `app_evicted` records: at most 10 a minute, the next one counting those left out
        self._evicted_log = LogBudget()

    @property
    def source(self) -> str:
        """"model" when the forecaster is the trained model, "mixture" when it is the expert mixture
        (manager/experts.py), else "baseline"."""
        name = getattr(self.forecaster, "name", "")
        return name if name in _NAMED_SOURCES else "baseline"

    # --- ingest ----------------------------------------------------------------------------------
    def accept(self, batch: ingest_pb2.SignatureBatch, stream: StreamState | None = None) -> ingest_pb2.IngestReply:
        """Validate and window a batch; the reply has the counts and rejections, no decisions yet."""
        now = self.clock()
        reply = ingest_pb2.IngestReply(tick=batch.tick)
        stats = self.stats
        stats.batches += 1
        stats.dropped_by_profilers += batch.dropped_since_last
        gone = self.windows.evict_idle(now)
        if gone:
            self._forget(gone)
        add = self.windows.add_row
        dirty = self._dirty
        apps = stream.apps if stream is not None else None
        if stream is not None:
            self._streams.add(stream)
        accepted = 0
        kept_apps: set[str] = set()
        sigs = batch.signatures
        stats.signatures += len(sigs)
        dropped: list[str] = []
        totals: dict[str, float | None] = {}  # device -> its total memory, asked once per batch
        over: list[tuple[str, float, float]] = []  # (device, reading, total) of the rows rejected for it
        check_mem = self.device_mem_total_mib is not None
        limits: dict[str, float] = {}  # device -> the largest memory reading taken (inf: no bound known)
        for i, sig in enumerate(sigs):
            reason, values = parse_signature(sig, dropped)
            if reason is None and not self._device_ok(sig.device_id):
                reason = self._unknown_device(sig.device_id)
            if reason is None and check_mem:  # the common case is one dict look-up and one comparison
                limit = limits.get(sig.device_id)
                if limit is None:
                    total = self._total_of(sig.device_id, totals)
                    limit = limits[sig.device_id] = mem_limit_mib(total) if total is not None else math.inf
                if values[_MEM] > limit:
                    reason = self._over_capacity(sig.device_id, values[_MEM], totals, over)
            if reason is None:
                reason = self._unobserved(sig.app_id, sig.device_id, sig.pid, stream)
            if reason is not None:
                stats.rejected += 1
                reply.rejected.add(index=i, app_id=sig.app_id[:_MAX_APP_ID], reason=reason)
                continue
            app_id = sig.app_id
            if self.max_future_s is not None and sig.timestamp_s > now + self.max_future_s:
                stats.rejected += 1
                reply.rejected.add(index=i, app_id=app_id, reason=_future_reason(sig.timestamp_s, now, self.max_future_s))
                continue
            kept, evicted = add(app_id, sig.device_id, sig.seq, sig.timestamp_s, values, now)
            if evicted:
                self._forget(evicted)
            if kept:
                accepted += 1
                dirty.add(app_id)
                kept_apps.add(app_id)
                if sig.pid:
                    self._name_pid(app_id, sig.pid)
                if apps is not None:
                    apps.add(app_id)
            elif self.windows.holds(app_id, sig.seq, sig.timestamp_s):
                self._duplicates(1, stream)
            else:
                stats.out_of_order += 1
                win = self.windows.window(app_id)
                reply.rejected.add(index=i, app_id=app_id, reason=(
                    f"out of order: seq {sig.seq} at {sig.timestamp_s:.6f} s after seq {win.last_seq} "
                    f"at {win.last_t_s:.6f} s"))
        for why in dropped:  # counted whether or not the signature was kept: the value was refused
            self._inapp_dropped(why, 1)
        bulk: list[str] = []  # the devices of the applications `_accept_columns` added in bulk
        if batch.HasField("columns"):
            accepted += self._accept_columns(batch.columns, len(sigs), reply, now, stream, kept_apps, bulk,
                                             totals, over)
        if over:
            self._over_capacity_said(over)
        reply.accepted = accepted
        stats.accepted += accepted
        self._last_kept = kept_apps
        self._note_devices_seen(kept_apps, bulk, now)
        return reply

    def _note_devices_seen(self, kept_apps: set[str], bulk: list[str], now: float) -> None:
        """Remember `now` as when each kept application's device (its window's, after the batch; the
        devices of `bulk` when the columns were added in bulk) got its newest signature, past the
        applications' eviction (`profiler_states`)."""
        newest = self._device_newest_s
        for device_id in (set(bulk) if bulk else ()):
            newest[device_id] = now
        for app_id in (kept_apps if not bulk else ()):
            if app_id in self.windows:
                newest[self.windows.window(app_id).device_id] = now
        while len(newest) > self.windows.max_apps:  # device ids come from the wire: bounded
            del newest[min(newest, key=newest.__getitem__)]

    def _accept_columns(self, msg: ingest_pb2.SignatureColumns, base: int, reply: ingest_pb2.IngestReply,
                        now: float, stream: StreamState | None, kept_apps: set[str], bulk: list[str],
                        totals: dict[str, float | None], over: list[tuple[str, float, float]]) -> int:
        """The columnar part of a batch (vgpu/wire.py): checked as arrays, then one bulk
        window append per application. Row i answers as index `base + i`. Returns how many were kept.

        A good row (`rows.good`) has passed `read_columns`: its app_index is within `rows.app_ids`
        and its id keeps to the id rule (vgpu/ids.py: at most MAX_APP_ID_BYTES, the wire's
        MAX_ID_CHARS), so it is used as it is; only a rejected row's id needs the bound and the cut.
        A batch with one sample per application, every one taken, is added in bulk
        (`WindowStore.add_latest`) and its rows' devices listed in `bulk`, which is then the device of
        every application kept in the batch (left empty otherwise)."""
        stats = self.stats
        try:
            rows = read_columns(msg)
        except ColumnsFormatError as exc:  # no row can be read: one Rejection stands for them all
            n = max(1, len(msg.seq_u64) // 8)
            stats.signatures += n
            stats.rejected += n
            reply.rejected.add(index=base, app_id="", reason=str(exc))
            return 0
        stats.signatures += len(rows)
        for why, n in rows.dropped:
            self._inapp_dropped(why, n)
        for i, why in rows.rejected:
            stats.rejected += 1
            k = int(rows.app_index[i])
            reply.rejected.add(index=base + i, app_id=rows.app_ids[k][:_MAX_APP_ID] if k < len(rows.app_ids) else "",
                               reason=why)
        # the checks of `accept`'s signatures, in the same order, each clearing `rows.good` where it refuses
        if self.device_known is not None:
            self._refuse_unknown_devices(rows, base, reply)
        if self.device_mem_total_mib is not None:
            self._refuse_over_capacity(rows, base, reply, totals, over)
        pids = np.frombuffer(msg.pid_u32, dtype="<u4") if len(msg.pid_u32) == 4 * len(rows.seq) else None
        if self._checks_pids(stream):
            self._refuse_unobserved(rows, pids, base, reply, stream)
        good = np.flatnonzero(rows.good)
        if self.max_future_s is not None and len(good):
            good = self._refuse_future(rows, good, base, reply, now, self.max_future_s)
        if not len(good):
            return 0
        order = good[np.argsort(rows.app_index[good], kind="stable")]  # by app, batch order within
        by_app = rows.app_index[order]
        if len(order) == 1 or bool((by_app[1:] != by_app[:-1]).all()):
            return self._add_one_per_app(rows, order, pids, base, reply, now, stream, kept_apps, bulk)
        return self._add_per_app(rows, order, by_app, pids, base, reply, now, stream, kept_apps)

    def _refuse_unknown_devices(self, rows: ColumnRows, base: int, reply: ingest_pb2.IngestReply) -> None:
        """Reject the good rows that name a device the daemon does not have."""
        stats = self.stats
        for k, device_id in enumerate(rows.device_ids):
            if self._device_ok(device_id):
                continue
            reason = self._unknown_device(device_id, count=0)
            for row in np.flatnonzero(rows.good & (rows.device_index == k)).tolist():
                stats.rejected += 1
                stats.unknown_device += 1
                rows.good[row] = False
                reply.rejected.add(index=base + row, reason=reason, app_id=rows.app_ids[int(rows.app_index[row])])

    def _refuse_over_capacity(self, rows: ColumnRows, base: int, reply: ingest_pb2.IngestReply,
                              totals: dict[str, float | None], over: list[tuple[str, float, float]]) -> None:
        """Reject the good rows whose memory reading is above their device's total (`_over_capacity`),
        each device's rows in one comparison."""
        mem = rows.values[_MEM]
        for k, device_id in enumerate(rows.device_ids):
            total = self._total_of(device_id, totals)
            if total is None:
                continue
            with np.errstate(invalid="ignore"):  # NaN (not reported) is no reading to refuse
                bad = rows.good & (rows.device_index == k) & (mem > mem_limit_mib(total))
            for row in np.flatnonzero(bad).tolist():
                reason = self._over_capacity(device_id, float(mem[row]), totals, over)
                if reason is None:  # cannot happen: the same bound
                    continue
                self.stats.rejected += 1
                rows.good[row] = False
                reply.rejected.add(index=base + row, reason=reason, app_id=rows.app_ids[int(rows.app_index[row])])

    def _refuse_unobserved(self, rows: ColumnRows, pids: np.ndarray | None, base: int,
                           reply: ingest_pb2.IngestReply, stream: StreamState | None) -> None:
        """Reject the good rows whose pid is not a GPU process of this node (`_unobserved`), asked
        once per (application, device, pid) of the batch."""
        stats = self.stats
        said: dict[tuple[int, int, int], str | None] = {}
        for row in np.flatnonzero(rows.good).tolist():
            a, d = int(rows.app_index[row]), int(rows.device_index[row])
            pid = int(pids[row]) if pids is not None else 0
            key = (a, d, pid)
            if key not in said:
                said[key] = self._unobserved(rows.app_ids[a], rows.device_ids[d], pid, stream, count=0)
            refusal = said[key]
            if refusal is not None:
                stats.rejected += 1
                stats.unobserved_pid += 1
                rows.good[row] = False
                reply.rejected.add(index=base + row, app_id=rows.app_ids[a], reason=refusal)

    def _refuse_future(self, rows: ColumnRows, good: np.ndarray, base: int, reply: ingest_pb2.IngestReply,
                       now: float, max_future_s: float) -> np.ndarray:
        """Reject the rows of `good` stamped more than `max_future_s` ahead of `now`; the rest."""
        ahead = rows.t_s[good] > now + max_future_s
        for i in good[ahead]:
            self.stats.rejected += 1
            reply.rejected.add(index=base + int(i), app_id=rows.app_ids[int(rows.app_index[i])],
                               reason=_future_reason(float(rows.t_s[i]), now, max_future_s))
        rest: np.ndarray = good[~ahead]
        return rest

    def _add_one_per_app(self, rows: ColumnRows, order: np.ndarray, pids: np.ndarray | None, base: int,
                         reply: ingest_pb2.IngestReply, now: float, stream: StreamState | None,
                         kept_apps: set[str], bulk: list[str]) -> int:
        """Add rows `order`, one per application (a profiler's usual tick), through the windows'
        one-sample path (the same rules as a group of one), on Python lists instead of numpy slices
        per application; in one bulk append when every row is taken. Returns how many were kept."""
        apps = stream.apps if stream is not None else None
        by_app = rows.app_index[order]
        values = rows.values[:, order]
        if len(values) > _NB and np.isnan(values[_NB:]).all():
            values = values[:_NB]  # no in-app value in the batch: the format's columns only
        app_at, dev_at = by_app.tolist(), rows.device_index[order].tolist()
        pid_at = pids[order].tolist() if pids is not None else None
        names = [rows.app_ids[k] for k in app_at]
        devices = [rows.device_ids[d] for d in dev_at]
        if not kept_apps and self.windows.add_latest(names, devices, rows.seq[order], rows.t_s[order], values,
                                                     now):
            # every row kept, as one by one below, without a Python pass per sample
            self._dirty.update(names)
            kept_apps.update(names)
            if apps is not None:
                apps.update(names)
            if pid_at is not None:
                pid_of, app_of = self._pids.get, self._pid_app.get
                for app_id, pid in zip(names, pid_at, strict=True):
                    if pid and (pid_of(app_id) != pid or app_of(pid) != app_id):
                        self._name_pid(app_id, pid)
            bulk += devices
            return len(names)
        accepted = 0
        cols, seqs, ts = values.T.tolist(), rows.seq[order].tolist(), rows.t_s[order].tolist()
        add_row, dirty = self.windows.add_row, self._dirty
        for j in range(len(app_at)):
            app_id = rows.app_ids[app_at[j]]
            kept_one, evicted = add_row(app_id, rows.device_ids[dev_at[j]], seqs[j], ts[j], cols[j], now)
            if evicted:
                self._forget(evicted)
            if kept_one:
                accepted += 1
                dirty.add(app_id)
                if pid_at is not None and pid_at[j]:
                    self._name_pid(app_id, pid_at[j])
                kept_apps.add(app_id)
                if apps is not None:
                    apps.add(app_id)
            else:
                self._not_kept(app_id, order[j:j + 1], rows, base, reply, stream)
        return accepted

    def _add_per_app(self, rows: ColumnRows, order: np.ndarray, by_app: np.ndarray, pids: np.ndarray | None,
                     base: int, reply: ingest_pb2.IngestReply, now: float, stream: StreamState | None,
                     kept_apps: set[str]) -> int:
        """Add rows `order` (sorted by application, `by_app` their applications) one window append
        per application; a group's pid and device are its last row's. Returns how many were kept."""
        apps = stream.apps if stream is not None else None
        accepted = 0
        for grp in np.split(order, np.flatnonzero(np.diff(by_app)) + 1):
            app_id = rows.app_ids[int(rows.app_index[grp[0]])]
            kept, evicted = self.windows.add_rows(app_id, rows.device_ids[int(rows.device_index[grp[-1]])],
                                                  rows.seq[grp], rows.t_s[grp], rows.values[:, grp], now)
            if evicted:
                self._forget(evicted)
            n_kept = int(kept.sum())
            if n_kept:
                accepted += n_kept
                self._dirty.add(app_id)
                if pids is not None and pids[grp[-1]]:
                    self._name_pid(app_id, int(pids[grp[-1]]))
                kept_apps.add(app_id)
                if apps is not None:
                    apps.add(app_id)
            if n_kept < len(grp):
                self._not_kept(app_id, grp[~kept], rows, base, reply, stream)
        return accepted

    def _not_kept(self, app_id: str, behind: np.ndarray, rows: ColumnRows, base: int, reply: ingest_pb2.IngestReply,
                  stream: StreamState | None) -> None:
        """Rows `behind` of `app_id` that its window did not take: those it holds are duplicates
        (dropped quietly), the others are rejected as out of order."""
        win = self.windows.window(app_id)
        held = win.has(rows.seq[behind], rows.t_s[behind])
        self._duplicates(int(held.sum()), stream)
        for i in behind[~held]:
            self.stats.out_of_order += 1
            reply.rejected.add(index=base + int(i), app_id=app_id, reason=(
                f"out of order: seq {int(rows.seq[i])} at {float(rows.t_s[i]):.6f} s; the window has seq "
                f"{win.last_seq} at {win.last_t_s:.6f} s"))

    def _inapp_dropped(self, why: str, n: int) -> None:
        """`n` in-app values left out for `why`: counted, and logged at the 1st, 10th, 100th...
        batch that has them (the sample itself is kept; the counter reads as not reported)."""
        counts = self.stats.inapp_dropped
        if why not in counts and len(counts) >= 256:  # reasons are a fixed set; a bound all the same
            why = "other"
        counts[why] = counts.get(why, 0) + n
        if worth_logging(self._inapp_dropped_batches.setdefault(why, 0) + 1):
            self._log.warning("inapp_values_dropped", reason=why, values_total=counts[why])
        self._inapp_dropped_batches[why] += 1

    def _duplicates(self, n: int, stream: StreamState | None) -> None:
        """`n` signatures the windows already held: a profiler resends, after a reconnect, what no
        reply had acknowledged (profiler/stream.py), and what this manager did read is held. They are
        dropped quietly: no Rejection, counted per manager and per stream."""
        self.stats.duplicates += n
        if stream is not None:
            stream.duplicates += n

    def due_apps(self, candidates: Iterable[str] | None = None) -> list[str]:
        """Applications (of `candidates`, by default every one with new samples) with new samples,
        enough of them, and no forecast for `forecast_interval_s`."""
        now = self.clock()
        out = []
        dirty = self._dirty
        for app_id in dirty if candidates is None else candidates:
            if app_id not in dirty:
                continue
            if app_id in self._pending or app_id not in self.windows:
                continue
            if len(self.windows.window(app_id)) < self.min_samples:
                continue
            if self._is_due(app_id, now):
                out.append(app_id)
        return out

    def _is_due(self, app_id: str, now: float) -> bool:
        """Whether `app_id` (with new samples) may be forecast at `now`: never forecast yet, or
        `forecast_interval_s` since its last forecast, or its phase's next slot boundary passed since
        the last one with at least half an interval between the two forecasts."""
        last = self._last_forecast_s.get(app_id)
        interval = self.forecast_interval_s
        if last is None or now - last >= interval - 1e-6:
            return True
        if now - last < interval / 2:
            return False
        anchor = self._anchor_s.get(app_id, last)
        return math.floor((now - anchor) / interval) > math.floor((last - anchor) / interval)

    def _anchor(self, app_id: str, now: float, k: int) -> None:
        """Set the boundaries of an application forecast for the first time, the k-th such one of its
        batch: k golden-ratio steps on from now (k = 0: its own time), a little earlier."""
        if app_id not in self._anchor_s:
            self._anchor_s[app_id] = now + ((k * _GOLDEN) % 1.0 - _LEAD) * self.forecast_interval_s

    def _anchor_batch(self, due: Sequence[str]) -> None:
        """Spread the applications one batch makes due for the first time over the interval."""
        now, k = self.clock(), 0
        for app_id in due:
            if app_id not in self._anchor_s:
                self._anchor(app_id, now, k)
                k += 1

    def ingest(self, batch: ingest_pb2.SignatureBatch, stream: StreamState | None = None) -> ingest_pb2.IngestReply:
        """Accept a batch and forecast and act for the applications that are due, all on this thread."""
        reply = self.accept(batch, stream)
        due = self.due_apps(self._last_kept)
        if due:
            self._anchor_batch(due)
            started = time.perf_counter()
            self._act(self._decide(self._begin_tick(due)))
            self.stats.tick_latency.observe(time.perf_counter() - started)
        self._attach(reply, stream)
        return reply

    async def ingest_async(
        self, batch: ingest_pb2.SignatureBatch, stream: StreamState | None = None
    ) -> ingest_pb2.IngestReply:
        """Like `ingest`; the due applications join the next batched forecast (in a worker thread),
        and the reply waits for it."""
        reply = self.accept(batch, stream)
        due = self.due_apps(self._last_kept)
        if due:
            self._anchor_batch(due)
            self._pending.update(due)
            done = asyncio.get_running_loop().create_future()
            self._pending_waiters.append(done)
            if self._runner is None or self._runner.done():
                self._runner = asyncio.create_task(self._run_pending())
            await done
        self._attach(reply, stream)
        return reply

    async def _run_pending(self) -> None:
        """Forecast the pending applications in batches until none is left: wait `batch_window_s`
        for more to join, copy their windows here, forecast in a worker thread, act here."""
        loop = asyncio.get_running_loop()
        while self._pending:
            await asyncio.sleep(max(self.batch_window_s, self._duty.wait_s(loop.time())))
            apps, self._pending = sorted(self._pending), set()
            waiters, self._pending_waiters = self._pending_waiters, []
            try:
                started = time.perf_counter()
                items = self._begin_tick(apps)
                decisions, took = await asyncio.to_thread(self._timed_decide, items)
                self._duty.spend(loop.time(), took)
                # The replies waiting for this round are woken first (their wake-ups are queued now),
                # then `_act` publishes the decisions they will read, in this same step, and queues
                # the allocator's apply behind them: no reply waits for the apply.
                _wake(waiters)
                self._act(decisions, after_replies=True)
                self.stats.tick_latency.observe(time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001 - the waiting replies go out without decisions
                self._log.error("forecast_batch_failed", error=repr(exc), exc_info=exc)
            finally:
                _wake(waiters)

    def _timed_decide(self, items: list[Item]) -> tuple[list[Decision], float]:
        """`_decide` and the CPU time this thread spent on it (not a loaded machine's wall time)."""
        started = time.thread_time()
        decisions = self._decide(items)
        return decisions, time.thread_time() - started

    def _attach(self, reply: ingest_pb2.IngestReply, stream: StreamState | None) -> None:
        """Add the decisions this stream has not seen yet for its own applications (all
        decisions of this call when there is no stream state)."""
        if stream is None:
            for app_id, serial in self._serial.items():
                if serial > self._delivered_plain:
                    self.latest[app_id].fill_pb(reply.decisions.add())
            self._delivered_plain = self._next_serial
            return
        if self._next_serial > stream.delivered:
            for app_id in stream.apps:
                if self._serial.get(app_id, 0) > stream.delivered:
                    self.latest[app_id].fill_pb(reply.decisions.add())
        stream.delivered = self._next_serial

    # --- what operators see ---------------------------------------------------------------------
    def app_pids(self, app_id: str) -> list[int]:
        """The pid the application's latest signature named (empty when none did)."""
        pid = self._pids.get(app_id)
        return [pid] if pid else []

    def open_streams(self) -> int:
        """Profiler streams open now that have sent a batch (a profiler sends one every tick)."""
        return sum(1 for stream in list(self._streams) if not stream.closed)

    def apps_of_open_streams(self) -> set[str]:
        """The applications that the profiler streams open now have sent signatures for."""
        return {app for stream in list(self._streams) if not stream.closed for app in stream.apps}

    def profiler_states(self) -> dict[str, tuple[int, float | None]]:
        """device -> (open profiler streams that sent for applications on it that are still held,
        when its newest signature arrived, remembered after its applications are evicted)."""
        streams: dict[str, int] = {}
        newest = dict(self._device_newest_s)
        for stream in list(self._streams):
            if stream.closed:
                continue
            devices = {self.windows.window(a).device_id for a in stream.apps if a in self.windows}
            for dev in devices:
                streams[dev] = streams.get(dev, 0) + 1
        return {dev: (streams.get(dev, 0), newest.get(dev)) for dev in sorted({*streams, *newest})}

    # --- forecasts -------------------------------------------------------------------------------
    def _begin_tick(self, apps: Sequence[str]) -> list[Item]:
        """Copy the windows of `apps` for a forecast (on the loop: the windows change there)."""
        now = self.clock()
        out = []
        for app_id in apps:
            self._dirty.discard(app_id)
            if app_id not in self.windows:
                continue
            win = self.windows.window(app_id)
            if len(win) < self.min_samples:
                continue
            self._last_forecast_s[app_id] = now
            self._anchor(app_id, now, 0)  # (set already when a batch made it due)
            try:
                trace = win.trace()
                if app_id not in self._first_use_s:
                    used = first_use_s(trace)
                    if math.isfinite(used):
                        self._first_use_s[app_id] = used
                out.append(Item(app_id, win.device_id, win.last_seq, trace, win.latest_value("mem_used_mib"),
                                win.latest_value("sm_util_pct"), self._first_use_s.get(app_id, math.inf)))
            except Exception as exc:  # noqa: BLE001 - this application sits the round out; the others go on
                self._round_failed("window_failed", exc, app_id)
        return out

    def _round_failed(self, kind: str, exc: BaseException, app_id: str, **kw: object) -> None:
        """Count a failure in a round; log its kind at most once an hour (with the application it struck)."""
        self.stats.forecast_failures += 1
        left_out = self._failures_log.admit((kind,))
        if left_out is not None:
            self._log.error(kind, app=app_id, error=repr(exc), count=self.stats.forecast_failures,
                            left_out=left_out,
                            said="at most once an hour: the others are counted (vgpu_forecast_failures_total)", **kw)

    @staticmethod
    def _call(forecaster: Forecaster, traces: list[AppTrace]) -> list[Forecast]:
        result = forecaster.forecast_batch(traces)
        if len(result) != len(traces):
            raise ValueError(f"{len(result)} forecasts for {len(traces)} histories")
        return result

    def _forecast(self, items: list[Item]) -> list[Forecast]:
        """One forecast per item, whatever fails (the module docstring's list): the forecaster's for
        the round, or alone for each item once the round's call failed; the fallback's for the rest
        and for benched applications; unknown where the fallback fails too."""
        now = self.clock()
        out: list[Forecast | None] = [None] * len(items)
        model = self.forecaster is not self.fallback
        asked = [i for i, it in enumerate(items) if not model or self._benched.get(it.app_id, -math.inf) <= now]
        if asked:
            self._forecast_into(out, self.forecaster, asked, items, "forecaster_failed",
                                forecaster=getattr(self.forecaster, "name", "?"))
            for i in asked:
                if out[i] is None and model:
                    self._benched[items[i].app_id] = now + BENCH_S
        rest = [i for i, fc in enumerate(out) if fc is None]
        if rest and model:  # unknown where the fallback fails too: the last value decides
            self._forecast_into(out, self.fallback, rest, items, "fallback_failed")
        return [fc if fc is not None else _unknown() for fc in out]

    def _forecast_into(self, out: list[Forecast | None], by: Forecaster, idx: list[int],
                       items: list[Item], kind: str, **kw: object) -> None:
        """`by`'s forecasts of `items[i]` for each i in `idx` into `out[i]`: in one call, or,
        once that call raised (counted and logged as `kind`), alone for each (when there is more than
        one), leaving None where that fails too."""
        try:
            for i, fc in zip(idx, self._call(by, [items[i].window for i in idx]), strict=True):
                out[i] = fc
        except Exception as exc:  # noqa: BLE001 - each application alone: one bad history fails only itself
            self._round_failed(kind, exc, items[idx[0]].app_id, apps=len(idx), **kw)
            for i in idx if len(idx) > 1 else ():
                try:
                    out[i] = self._call(by, [items[i].window])[0]
                except Exception:  # noqa: BLE001 - counted in the round's failure; out[i] stays None
                    pass

    def _fallback_one(self, it: Item) -> Forecast:
        """The fallback's forecast for one item; unknown when it fails."""
        try:
            return self._call(self.fallback, [it.window])[0]
        except Exception:  # noqa: BLE001 - the last value decides
            return _unknown()

    def _decide(self, items: list[Item]) -> list[Decision]:
        if not items:
            return []
        started = time.perf_counter()
        forecasts = self._forecast(items)
        took = time.perf_counter() - started
        self.stats.forecast_s_total += took
        self.stats.forecast_latency.observe(took)
        self.stats.forecast_batches += 1
        now = self.clock()
        decisions = []
        for it, fc in zip(items, forecasts, strict=True):
            decision = None
            for attempt in (fc, None, _unknown()):  # the forecast, the fallback's, the last value alone
                try:
                    decision = self._decision(it, attempt if attempt is not None else self._fallback_one(it), now)
                    break
                except Exception as exc:  # noqa: BLE001 - the next way of deciding for this application
                    if attempt is fc:
                        self._round_failed("decision_failed", exc, it.app_id)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def _decision(self, it: Item, fc: Forecast, now: float) -> Decision | None:
        """The decision from one forecast; None when nothing is known (no forecast, no last value)."""
        mem, sm = self.recommend(fc, it.mem_used_mib, it.sm_util_pct)
        if math.isnan(mem) and math.isnan(sm):
            return None
        source = fc.source if fc.source in _NAMED_SOURCES else "baseline"
        return Decision(it.app_id, it.device_id, fc, 0.0 if math.isnan(mem) else mem, 0.0 if math.isnan(sm) else sm,
                        source, it.seq, now, it.mem_used_mib, it.sm_util_pct, it.first_use_s)

    def recommend(self, fc: Forecast, mem_used_mib: float, sm_util_pct: float) -> tuple[float, float]:
        """(memory MiB, SM %) to recommend: the peak P90 over the horizons (P50 where no P90, the last
        observation where no forecast), memory with `mem_margin` on top; NaN where nothing is known."""
        mem = _first_finite(fc.peak_mem_p90_mib(), _peak(fc.mem_p50_mib), mem_used_mib)
        sm = _first_finite(fc.peak_sm_p90_pct(), _peak(fc.sm_p50_pct), sm_util_pct)
        if not math.isnan(mem):
            mem = max(0.0, mem) * (1 + self.mem_margin)
        if not math.isnan(sm):
            sm = min(100.0, max(0.0, sm))
        return mem, sm

    def _act(self, decisions: list[Decision], *, after_replies: bool = False) -> None:
        """Publish the decisions (the replies carry them from now on) and hand them to the allocator.
        Without a running loop, at once. On the loop, at once while the acting budget
        (`act_duty_max`) lasts (`after_replies`: in a callback queued now, so that the replies
        already woken for this round are written before it); once it is spent, they wait, with any
        later ones, for the first round that ends after the budget is earned back (acting right
        after a round keeps it out of the way of the next batch), or for a timer one forecast
        interval later when no round comes."""
        decisions = [d for d in decisions if d.app_id in self.windows]  # not one evicted meanwhile
        for d in decisions:
            self._next_serial += 1
            self._serial[d.app_id] = self._next_serial
            self.latest[d.app_id] = d
        self.stats.decisions += len(decisions)
        if self.allocator is None or not decisions:
            return
        for d in decisions:
            self._unapplied[d.app_id] = d
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._apply()
            return
        if self._apply_soon is not None:  # queued already: it takes these too
            return
        wait_s = self._act_duty.wait_s(loop.time())
        if wait_s <= 0:
            if after_replies:
                self._apply_soon = loop.call_soon(self._apply)
            else:
                self._apply()
            return
        self.stats.applies_deferred += 1
        if self._apply_later is None:
            self._apply_later = loop.call_later(wait_s + self.forecast_interval_s, self._apply)

    def _apply(self) -> None:
        """Give the allocator the newest undelivered decision of each application still held, as one
        set of recommendations, and charge the acting budget with the CPU it took."""
        if self._apply_later is not None:
            self._apply_later.cancel()
            self._apply_later = None
        if self._apply_soon is not None:
            self._apply_soon.cancel()
            self._apply_soon = None
        pending = [d for d in self._unapplied.values() if d.app_id in self.windows]
        self._unapplied = {}
        if self.allocator is None or not pending:
            return
        started = time.thread_time()
        try:
            report = self.allocator.apply_recommendations([d.to_recommendation() for d in pending])
        except Stopping as exc:  # the daemon is stopping: it acts on nothing more (said once)
            if not self._apply_refused_said:
                self._apply_refused_said = True
                self._log.info("apply_recommendations_refused", reason=str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - acting failed; the stream and the next tick go on
            self._log.error("apply_recommendations_failed", error=repr(exc))
            return
        finally:
            self.stats.applies += 1
            self._act_duty.spend(self._loop_time(), time.thread_time() - started)
        if report.skipped:
            self._log.debug("recommendations_skipped", skipped=list(report.skipped))

    @staticmethod
    def _loop_time() -> float:
        """The running loop's clock (the acting budget's), else the monotonic clock it reads."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    def _checks_pids(self, stream: StreamState | None) -> bool:
        """Whether this stream's signatures must name processes the node runs."""
        return self.pid_observed is not None and stream is not None and not stream.replay_ok

    def _unobserved(self, app_id: str, device_id: str, pid: int, stream: StreamState | None, *,
                    count: int = 1) -> str | None:
        """Why a signature from `stream` may not be taken for the process it names (None: it may);
        `count` rejections are added to `stats.unobserved_pid` when it may not."""
        if self.pid_observed is None or not self._checks_pids(stream):
            return None
        if pid <= 0:
            why = "it names no pid"
        elif not self.pid_observed(device_id, pid):
            why = f"pid {pid} is not a GPU process on device {device_id[:128]!r} (this node's driver does not list it)"
        elif (owner := self._pid_app.get(pid)) is not None and owner != app_id and owner in self.windows:
            why = f"pid {pid} is named by application {owner[:_MAX_APP_ID]!r}'s signatures"
        else:
            return None
        self.stats.unobserved_pid += count
        return (f"{why}: the profiler token may describe only processes this node runs; a replay needs the "
                "operator token or a daemon that accepts replays (manager.accept_replay)")

    def _name_pid(self, app_id: str, pid: int) -> None:
        old = self._pids.get(app_id)
        if old is not None and self._pid_app.get(old) == app_id:
            del self._pid_app[old]
        self._pids[app_id] = pid
        self._pid_app[pid] = app_id

    def _device_ok(self, device_id: str) -> bool:
        return self.device_known is None or self.device_known(device_id)

    def _unknown_device(self, device_id: str, count: int = 1) -> str:
        """The rejection reason for a signature naming `device_id`, which the daemon does not have;
        counted, and logged once per device id."""
        self.stats.unknown_device += count
        reason = (f"unknown device {device_id[:128]!r}: this daemon has no such device (`vgpu available` lists "
                  "them; a replay names one with --device-id)")
        if device_id not in self._unknown_devices_said and len(self._unknown_devices_said) < 64:
            self._unknown_devices_said.add(device_id)
            self._log.warning("signatures_rejected_unknown_device", device=device_id[:128])
        return reason

    def _total_of(self, device_id: str, totals: dict[str, float | None]) -> float | None:
        """`device_id`'s total memory (MiB; None where unknown), asked of `device_mem_total_mib` once
        per batch (`totals`)."""
        if device_id not in totals:
            ask = self.device_mem_total_mib
            total = ask(device_id) if ask is not None else None
            totals[device_id] = total if total is not None and math.isfinite(total) and total > 0 else None
        return totals[device_id]

    def _over_capacity(self, device_id: str, mem_mib: float, totals: dict[str, float | None],
                       over: list[tuple[str, float, float]]) -> str | None:
        """The rejection reason of a signature on `device_id` whose memory reading `mem_mib` is above
        the device's total (beyond `mem_limit_mib`'s slack), counted and noted in `over`; None when
        it is not (or the total is unknown, or the reading NaN: not reported). The caller counts the
        rejection in `stats.rejected`."""
        total = self._total_of(device_id, totals)
        if total is None or not mem_mib > mem_limit_mib(total):
            return None
        self.stats.over_capacity += 1
        over.append((device_id, mem_mib, total))
        return (f"memory reading {mem_mib:g} MiB is above the {total:g} MiB of device {device_id[:128]!r}: no "
                "process on it can use that much (process.gpu_mem_used_mib, else in_app.torch_reserved_mib)")

    def _over_capacity_said(self, over: list[tuple[str, float, float]]) -> None:
        """Log a batch's over-capacity rejections in one record, at the 1st, 10th, 100th... such batch."""
        self._over_capacity_batches += 1
        if worth_logging(self._over_capacity_batches):
            device_id, mem_mib, total = over[0]
            self._log.warning("signatures_rejected_over_capacity", device=device_id[:128], mem_mib=mem_mib,
                              mem_total_mib=total, in_batch=len(over), rejected_total=self.stats.over_capacity,
                              batches=self._over_capacity_batches)

    def _forget(self, app_ids: list[str]) -> None:
        for app_id in app_ids:
            self.stats.evicted += 1
            self.latest.pop(app_id, None)
            self._serial.pop(app_id, None)
            self._last_forecast_s.pop(app_id, None)
            self._anchor_s.pop(app_id, None)
            self._unapplied.pop(app_id, None)
            self._first_use_s.pop(app_id, None)
            self._benched.pop(app_id, None)
            pid = self._pids.pop(app_id, None)
            if pid is not None and self._pid_app.get(pid) == app_id:
                del self._pid_app[pid]
            self._dirty.discard(app_id)
            for stream in self._streams:
                stream.apps.discard(app_id)
            if self.allocator is not None:
                self.allocator.forget_app(app_id)
            # a forecaster with per-application state (the served mixture) drops the app too, so
            # an id that comes back starts afresh; stateless ones (a model, the baselines) are left alone
            forget_app(self.forecaster, app_id)
            if self.fallback is not self.forecaster:
                forget_app(self.fallback, app_id)
            # bounded: a stream may make up ids by the thousand, each evicting another application
            since = self._evicted_log.admit(("app_evicted",))
            if since is not None:
                self._log.info("app_evicted", app=app_id, **({"evicted_since_last_record": since} if since else {}))


def first_use_s(trace: AppTrace) -> float:
    """When the application first used the GPU: the time of the window's first sample with memory
    above `IDLE_MEM_MIB` (the few MiB a process that has not touched the GPU reads) or SM in use; inf
    when none has. The policy's start-up window counts from here, not from registration: a job that
    registers, then loads its data for a minute, starts its memory ramp only then. The manager asks
    at every forecast until the answer is finite, so the first use is still in the window."""
    busy = np.zeros(len(trace.t_s), dtype=bool)
    for column, idle in (("mem_used_mib", IDLE_MEM_MIB), ("sm_util_pct", 0.0)):
        values = trace.columns.get(column)
        if values is not None:
            busy |= np.nan_to_num(np.asarray(values, dtype=float), nan=0.0) > idle
    hits = np.flatnonzero(busy)
    return float(trace.t_s[hits[0]]) if len(hits) else math.inf


def _wake(waiters: Iterable[asyncio.Future[None]]) -> None:
    """Resolve the futures that replies wait on (those whose waiter went away are cancelled already)."""
    for w in waiters:
        if not w.done():
            w.set_result(None)


def _peak(values: Sequence[float]) -> float:
    """Largest finite value (NaN if none). Plain Python: a forecast has five values, and numpy's
    per-call cost is many times the work."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def _first_finite(*values: float) -> float:
    for v in values:
        if math.isfinite(v):
            return v
    return math.nan


def _unknown() -> Forecast:
    nan = (math.nan,) * len(HORIZONS_S)
    return Forecast(HORIZONS_S, nan, nan, nan, nan, "none")


def _future_reason(t_s: float, now_s: float, max_future_s: float) -> str:
    return (f"timestamp_s {t_s:.3f} is {t_s - now_s:.0f} s ahead of the manager's clock; at most {max_future_s:g} s "
            "ahead is accepted (check the profiler host's clock)")
