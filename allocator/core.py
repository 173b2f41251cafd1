"""The `Allocator`: the ledger, the policy and the mechanisms behind one object.

The allocator alone writes to devices. It owns:
- the `Ledger` of grants and limits (allocator/ledger.py) and the moment its changes are stored
  (`on_change`, the daemon's store);
- the latest `Recommendation` of each application and the `Policy` (allocator/policy/base.py) that
  turns them into a `Plan`;
- the mechanisms that write to devices: power limits (allocator/mechanisms/power.py), MIG layouts (a
  `MigMechanism`, plugged in) and each application's cgroup memory cap through NVML's per-cgroup
  limits, where the pid is known and `cgroup_limits` is given (allocator/mechanisms/limits.py);
- each device's hard/cooperative memory decision (below);
- the `watch()` subscriptions, the `Counters` and the per-application `History`;
- applications' signs of life (`last_seen_s`, `release_vanished`) and the exit of the processes
  their grants name (`release_exited`);
and it restores device settings on `stop()`.

Stopping: once `refuse_changes()` (a stopping daemon calls it first, before it closes its doors) or
`stop()` was called, every change to the grants (request, release, limits, a plan, the releases of
applications that went silent) is refused with Stopping (an Unavailable: "the daemon is stopping") before
anything changes: nothing is stored, announced or enforced after the daemon decided to stop, so the
ledger it saves last and the store agree. Reads (available, list_apps) still answer.

Every change to the grants (request, release, limits, a plan) goes check -> change -> store ->
enforce -> announce:
1. check: the ledger refuses what does not fit or is not the caller's (InsufficientResources,
   PermissionDenied, InvalidRequest, NotFound) before it changes anything;
2. change: the ledger changes in memory;
3. store: `_changed()` hands the ledger to `on_change` (the daemon writes the changed rows,
   `Ledger.changes()`) before anyone hears of the change; when that fails (StateNotSaved) the
   ledger is rolled back in memory, so the change was never made; without `on_change` the changes
   are only committed;
4. enforce: the device's cgroup caps follow (`_sync_cgroup_limits`); a failure there is counted
   (`Counters.failures`) and logged, and never undoes the stored change;
5. announce: counters, a log line and an `AllocationEvent` per change. After the caps, so that an
   event's `mem_limit` (and a request's answer) says what is in force once the change is made.

`apply_recommendations` runs these steps for a whole plan:
1. admit each recommendation: one naming a MIG instance moves to its GPU, one for an unknown device
   is skipped; the cold-start size of the application's grant fills a recommendation that has none;
   each becomes its application's latest;
2. the other applications on the devices touched stand in with their latest recommendation (a
   device's plan weighs every application on it);
3. read each device touched (`DeviceView`); an unreadable one is skipped with its recommendations;
4. plan (`Policy.plan`);
5. change the ledger, shrinks first so that what one application gives back is there for another;
   new grants and growth are clamped to what fits; a target the ledger refuses is skipped;
6. store once for the plan: when that fails none of its grant changes stand, all are reported
   skipped ("not saved") and none is announced;
7. keep the plan's hard/cooperative word for each device touched and sync the cgroup caps of each
   device whose grants changed or whose decision changed;
8. announce the GRANTED / RESIZED events;
9. one history point per fresh recommendation (an OOM event is logged when its use was over the
   grant it held before this plan);
10. power limits, then MIG layouts, through their mechanisms, each check -> change -> verify
    inside the mechanism, the original saved before the first write; a failure is counted and
    logged and the grants stand.

An `AllocationEvent` carries its kind, the time, the application and device, the grant as it is
after the change (GRANTED, RESIZED, RELEASED), a detail (a grant's source, a resize's "memory
4096 -> 2048 MiB", a release's reason, a power limit's "before -> target mW", MIG profiles, limits)
and `mem_limit`: how the application's memory is enforced on that device when it was published,
"hard" only while a cgroup of a process its grants there name holds our cap (`_device_memory_limit`),
else "cooperative"; "" for an event of no application or device. A change of that kind from the
caps going on or off is sent to the application as LIMITS_CHANGED. Events without an application (power,
MIG) reach every watcher; an application's watch gets its own events besides. A grant change is
also counted by reason (`Counters.grant_changes`) and marked in the `History` whether or not anyone
watches.

Hard or cooperative memory limits, per device (`memory_enforcement`): a grant is always published to
its application, which keeps to it itself (the client stub's memory fraction: an allocation beyond
fails, the application lives). The cgroup cap, beyond which the application runs out of memory and
ends, is applied only on a device whose memory is contended: its grants reach `hard_limit_at_frac` of
it, or the policy's latest plan for it says so (`Plan.enforcement`); it is lifted (the cgroup's
original written back) when the device stops being contended. `hard_limit_at_frac` 0: hard wherever
a pid is known. What an application is told (`app_memory_limit`, events, a request's answer) is
what is in force on its processes, not the device's decision: "cooperative" on a contended device
where no cap could be written (no pid, the mechanism off or unsupported, dry run, a failed write).

Concurrency: the daemon runs on one asyncio loop and every method here is synchronous and must be
called from that loop's thread (the gRPC servicers call them directly; none of them awaits). Device
writes (NVML power limit) block for a few milliseconds, which the loop tolerates. Nothing here is
safe to call from another thread; `watch()` subscriptions are asyncio objects of that loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

import structlog

from vgpu.allocator.errors import (
    DeviceError,
    InsufficientResources,
    InvalidRequest,
    NotSupported,
    QuotaExceeded,
    StateNotSaved,
    Stopping,
    VerifyFailed,
)
from vgpu.allocator.history import History, HistoryEvent, HistoryPoint
from vgpu.allocator.ledger import SOURCES, AppLimits, DeviceCapacity, DeviceUsage, Grant, Ledger
from vgpu.allocator.mechanisms.limits import CgroupMemoryLimits, read_cgroup
from vgpu.allocator.mechanisms.power import PowerLimitMechanism, PowerLimitResult
from vgpu.allocator.policy.base import (
    BaselinePolicy,
    DeviceView,
    Enforcement,
    GrantTarget,
    MigOutcome,
    MigTarget,
    Plan,
    PlanReason,
    Policy,
    Recommendation,
    Sizer,
    Sizing,
    limits_are_hard,
)
from vgpu.allocator.reclaim import ReclaimPlan, Slack, plan_reclaim
from vgpu.device.base import Backend, Device, GpuInstance, PowerConstraints, ProcessInfo
from vgpu.jobs import InvalidJobConfig, JobConfig
from vgpu.log import get_logger

T = TypeVar("T")


class MigMechanism(Protocol):
    """Applies MIG layouts (allocator/mechanisms/mig.py). `apply` says what it did in a `MigOutcome`: whether
    instances changed and how many steps it left undone (the allocator counts a failure for those);
    it raises only for device errors it does not handle."""

    def apply(self, device: Device, profiles: Sequence[str]) -> MigOutcome: ...

    def restore(self) -> None: ...


@dataclass(frozen=True)
class AllocationRequest:
    app_id: str
    memory_mib: float = 0.0
    sm_pct: float = 0.0
    device_id: str | None = None
    priority: int | None = None
    deadline_s: float = 0.0
    critical: bool = False
    job: JobConfig | None = None
    pid: int = 0
    # the uid whose share of the node's grants the grant takes (`Grant.uid`; None: none)
    uid: int | None = None


@dataclass(frozen=True)
class Allocated:
    """A request's answer: the grant, and whether it is one the requesting process already held
    for the same job (`held`: nothing was granted or changed)."""

    grant: Grant
    held: bool = False


def job_digest(job: JobConfig) -> str:
    """The job's fields as one SHA-256 digest (`Grant.job_digest`): equal for two declarations of
    the same job. The model type, precision, mode and optimizer are read as the sizer reads them
    (case and surrounding spaces aside; "" is fp32 and train; an optimizer it does not know is one not
    given); every other field as given."""
    fields = dataclasses.asdict(job)
    fields.update(model_type=job.model_type.strip().lower(), precision=job.precision_norm, mode=job.mode_norm,
                  optimizer=job.optimizer_norm)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def job_text(job: JobConfig) -> str:
    """The job in a few words, for a message: "resnet50, batch 64"."""
    return f"{job.model_type[:64]}, batch {job.batch_size}"


@dataclass(frozen=True)
class DeviceResources(DeviceUsage):
    """The ledger's account of a device plus what the device itself says."""

    power_limit_mw: int | None = None
    power_constraints: PowerConstraints | None = None
    mig_enabled: bool = False
    mig_instances: tuple[GpuInstance, ...] = ()
    # What the device reports now; None where it cannot (reads degrade field by field).
    index: int = 0
    pci_bus_id: str | None = None
    mem_used_mib: float | None = None
    power_draw_mw: int | None = None
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    sm_util_pct: float | None = None
    mem_bw_util_pct: float | None = None
    dry_run: bool = False
    processes: tuple[ProcessInfo, ...] = ()


@dataclass(frozen=True)
class AppInfo:
    app_id: str
    grants: tuple[Grant, ...]
    limits: AppLimits | None
    mem_used_mib: float = math.nan
    sm_util_pct: float = math.nan
    forecast_mem_p90_mib: float = math.nan
    forecast_sm_p90_pct: float = math.nan
    source: str = ""
    # When the application last showed a sign of life (Allocator.last_seen_s); None: never.
    last_seen_s: float | None = None
    # The device of the latest recommendation, else of the first grant; "" when neither.
    device_id: str = ""
    forecast_mem_p50_mib: float = math.nan
    forecast_sm_p50_pct: float = math.nan
    # Processes named by the application's grants.
    pids: tuple[int, ...] = ()
    # How its memory grant is enforced: "hard" (a cgroup cap), "cooperative" (it keeps to its grant
    # itself), "" without a grant; and why (allocator.app_memory_limit)
    mem_limit: str = ""
    mem_limit_reason: str = ""
    # the latest plan's size for it and the rules that set it; None while it is not planned
    plan: PlanReason | None = None


class EventKind(StrEnum):
    GRANTED = "granted"
    RESIZED = "resized"
    RELEASED = "released"
    LIMITS_CHANGED = "limits_changed"
    POWER_LIMIT_CHANGED = "power_limit_changed"
    MIG_CHANGED = "mig_changed"


@dataclass(frozen=True)
class AllocationEvent:
    kind: EventKind
    at_s: float
    app_id: str = ""
    device_id: str = ""
    grant: Grant | None = None
    detail: str = ""
    # the device's memory limits when the event was published: "hard" or "cooperative" ("" for
    # events without a device)
    mem_limit: str = ""


@dataclass(frozen=True)
class ApplyReport:
    """What one `apply_recommendations` call did."""

    created: tuple[Grant, ...] = ()
    resized: tuple[Grant, ...] = ()
    power: tuple[PowerLimitResult, ...] = ()
    mig_changes: int = 0
    skipped: tuple[str, ...] = ()


# every (event kind, reason) a grant change is counted under (`Counters.grant_changes`): granted by
# source, resized to grow, to shrink, to an operator's limits or for another's request (reclaim),
# released, released because the application's declared job superseded it, or released because the
# process the grant named exited (`release_exited`)
GRANT_CHANGE_KEYS: tuple[tuple[str, str], ...] = (
    *(("granted", source) for source in SOURCES),
    ("resized", "grow"), ("resized", "shrink"), ("resized", "limits"), ("resized", "reclaim"),
    ("released", "released"), ("released", "superseded"), ("released", "exited"),
)

# A process counts as the one a grant names only when it started no later than the grant was made,
# give or take this much: a process's start time is read from the kernel in clock ticks after boot,
# and the boot time in whole seconds, so the two clocks disagree by up to about a second.
PROCESS_START_TOLERANCE_S = 1.0


@dataclass
class Counters:
    """Totals since start, for the demo and metrics."""

    granted: int = 0
    resized: int = 0
    released: int = 0
    power_limit_changes: int = 0
    mig_changes: int = 0
    recommendations: int = 0
    events_dropped: int = 0
    # requests admitted by cutting the policy's managed grants (each cut is also a grant change
    # ("resized", "reclaim"))
    reclaims: int = 0
    # requests answered with the cold-start grant their process already held for the same job
    # (`Allocator.allocate`): nothing granted, nothing changed
    cold_start_reused: int = 0
    # (event kind, reason) -> grant changes: ("granted", source), ("resized", "grow"|"shrink"|"limits"|
    # "reclaim"), ("released", "released"|"superseded")
    grant_changes: dict[tuple[str, str], int] = field(default_factory=dict)
    # (device_id, mechanism) -> device changes that failed: "power_limit" (write refused, raised or
    # did not read back; device unreadable), "mig" (raised, refused, or steps left undone; device
    # unreadable) and "cgroup_memory" (a cap or a restore of a cgroup's original that failed)
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    # quota setting -> calls refused at it (`QuotaExceeded`: max_grants_per_uid, max_watchers, ...)
    quota_refusals: dict[str, int] = field(default_factory=dict)

    def failed(self, device_id: str, mechanism: str) -> None:
        key = (device_id, mechanism)
        self.failures[key] = self.failures.get(key, 0) + 1


class Subscription:
    """An async iterator of `AllocationEvent`s, for one consumer. Registered when created, so no event
    published after `watch()` returns is missed. Bounded: when the consumer lags, the oldest events
    are dropped and counted in `dropped`; with `drop_slow`, a consumer that has lost a whole queue of
    events is dropped itself (closed, `overflowed` set): the publisher never waits for anyone.

    The queue is a deque and a waiting consumer is woken by one future: events published while the
    consumer runs (a burst, or while its stream sends) are taken without waking it again, and a push
    costs an append (this runs once per event for every watcher)."""

    def __init__(self, app_id: str | None, maxsize: int, on_close: Callable[[Subscription], None], *,
                 owner: str = "", uid: int | None = None, drop_slow: bool = False) -> None:
        self.app_id = app_id or None
        self.owner = owner
        self.uid = uid
        self.dropped = 0
        self.overflowed = False
        self._maxsize = max(1, maxsize)
        self._drop_slow = drop_slow
        self._queue: collections.deque[AllocationEvent] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._on_close = on_close
        self._closed = False

    def wants(self, event: AllocationEvent) -> bool:
        return self.app_id is None or event.app_id in ("", self.app_id)

    def push(self, event: AllocationEvent) -> None:
        if self._closed:
            return
        if len(self._queue) >= self._maxsize:
            self._queue.popleft()
            self.dropped += 1
            if self._drop_slow and self.dropped >= self._maxsize:
                self.overflowed = True
                self.close()
                return
        self._queue.append(event)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """End the subscription: iteration yields what is queued, then stops."""
        if not self._closed:
            self._closed = True
            self._wake()
            self._on_close(self)

    def drain_nowait(self) -> list[AllocationEvent]:
        """Take every queued event without waiting (for a consumer outside an event loop)."""
        out = list(self._queue)
        self._queue.clear()
        return out

    def __aiter__(self) -> AsyncIterator[AllocationEvent]:
        return self

    async def __anext__(self) -> AllocationEvent:
        while not self._queue:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()


def device_capacities(backend: Backend) -> list[DeviceCapacity]:
    """One ledger capacity per device of the backend (whole GPUs)."""
    return [DeviceCapacity(d.uuid, d.memory().total_mib, 100.0, d.name) for d in backend.devices()]


class Allocator:
    """See the module docstring. `dry_run` None: on for the NVML backend (real GPUs are changed
    only when asked explicitly with dry_run=False), off for the simulator."""

    def __init__(
        self,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.time,
        dry_run: bool | None = None,
        sizer: Sizer | None = None,
        policy: Policy | None = None,
        ledger: Ledger | None = None,
        power: PowerLimitMechanism | None = None,
        mig: MigMechanism | None = None,
        cgroup_limits: CgroupMemoryLimits | None = None,
        cgroup_of: Callable[[int], str | None] = read_cgroup,
        on_change: Callable[[Ledger], None] | None = None,
        watch_queue_size: int = 1024,
        max_watchers: int | None = None,
        max_watchers_per_caller: int | None = None,
        max_watchers_per_uid: int | None = None,
        drop_slow_watchers: bool = False,
        logger: structlog.typing.FilteringBoundLogger | None = None,
        history: History | None = None,
        hard_limit_at_frac: float = 0.0,
        reclaim: bool = True,
        reclaim_margin_frac: float = 0.10,
        reclaim_min_mib: float = 256.0,
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.dry_run = (getattr(backend, "name", "") == "nvml") if dry_run is None else dry_run
        self.sizer = sizer
        self.policy: Policy = policy if policy is not None else BaselinePolicy()
        self._log = logger or get_logger("vgpu.allocator")
        self.ledger = ledger if ledger is not None else Ledger(device_capacities(backend), clock=clock)
        self.power = power if power is not None else PowerLimitMechanism(dry_run=self.dry_run, logger=self._log)
        self.mig = mig
        # None: the mechanism is off. `cgroup_of(pid)` finds an application's cgroup (/proc/<pid>/cgroup).
        self.cgroup_limits = cgroup_limits
        self._cgroup_of = cgroup_of
        if not hard_limit_at_frac >= 0:
            raise ValueError(f"hard_limit_at_frac must be >= 0, got {hard_limit_at_frac}")
        self.hard_limit_at_frac = hard_limit_at_frac
        # A request that does not fit in what is free may take the slack of the policy's managed
        # grants, down to their applications' usage x (1 + margin), at least `reclaim_min_mib`
        # (`_grant_reclaiming`); off: refused as soon as the free room is short.
        if not (reclaim_margin_frac >= 0 and reclaim_min_mib >= 0):
            raise ValueError(f"reclaim margins must be >= 0, got {reclaim_margin_frac}, {reclaim_min_mib}")
        self.reclaim = reclaim
        self.reclaim_margin_frac = reclaim_margin_frac
        self.reclaim_min_mib = reclaim_min_mib
        self._plan_enforcement: dict[str, Enforcement] = {}  # device -> the latest plan's decision
        # device -> the decision `memory_enforcement` made and what it was made from (the ledger,
        # its revision, the plan's decision, hard_limit_at_frac): judged again only when one changed
        self._enforcement_made: dict[str, tuple[tuple[Ledger, int, Enforcement | None, float], Enforcement]] = {}
        self._enforced: dict[str, bool] = {}  # device -> hard memory limits in force (as last synced)
        # app -> its cold-start size: the latest one of its grants keeps (so it survives a restart)
        self._cold_start_mib: dict[str, float] = {
            g.app_id: g.cold_start_mib for g in self.ledger.grants() if g.cold_start_mib is not None}
        self.on_change = on_change
        self.counters = Counters()
        self.history = history if history is not None else History()
        self._watch_queue_size = watch_queue_size
        self._max_watchers = max_watchers
        self._max_watchers_per_caller = max_watchers_per_caller
        self._max_watchers_per_uid = max_watchers_per_uid
        self._drop_slow_watchers = drop_slow_watchers
        self._subscriptions: list[Subscription] = []
        self._latest: dict[str, Recommendation] = {}
        # each planned application's latest plan reasons (`vgpu apps`), kept while it is planned
        self._why: dict[str, PlanReason] = {}
        self._stopped = False
        self._refusing = False  # refuse_changes() or stop() was called: no change is made any more
        self._watches_ended = False
        self._warned: set[str] = set()
        self._mig_parent: dict[str, str] = {}  # MIG instance UUID -> its GPU's UUID
        self._mig_mem_mib: dict[str, float] = {}  # MIG instance UUID -> its memory (MiB), as the device reports it
        self._mig_parent_at_s = -math.inf
        # Signs of life of applications (see last_seen_s): the daemon plugs in the manager's
        # "last signature" and a look at the processes the grants name; the start time is the floor,
        # so grants restored after a restart get the full idle time to show up again.
        self.signature_seen: Callable[[str], float | None] = lambda _app: None
        # pid -> when its process started (Unix seconds), None when there is no such process here
        # (`last_seen_s`, `release_exited`: one read of /proc per pid)
        self.process_start: Callable[[int], float | None] = _process_start
        # grant id -> the start time of the process it names, as this allocator first saw it run
        # (`release_exited` releases no other grants; a later start time at that pid is another process)
        self._process_seen: dict[str, float] = {}
        # cold-start grants already answered again to their process (`_held_cold_start`): logged once each
        self._reuse_logged: set[str] = set()
        self._started_s = clock()
        self._seen: dict[str, float] = {}

    # --- events ----------------------------------------------------------------------------------
    def _publish(self, kind: EventKind, *, grant: Grant | None = None, app_id: str = "", device_id: str = "",
                 detail: str = "", reason: str = "") -> None:
        if grant is not None and kind in (EventKind.GRANTED, EventKind.RESIZED, EventKind.RELEASED):
            self._note_grant_change(kind, grant, detail, reason)
        if not self._subscriptions:
            return  # no watcher: the event itself is for nobody (an apply makes one per resize)
        dev = grant.device_id if grant is not None else device_id
        event = AllocationEvent(
            kind=kind,
            at_s=self.clock(),
            app_id=grant.app_id if grant is not None else app_id,
            device_id=dev,
            grant=grant,
            detail=detail,
            mem_limit=self._event_memory_limit(grant.app_id if grant is not None else app_id, dev, grant),
        )
        for sub in list(self._subscriptions):
            if sub.wants(event):
                before = sub.dropped
                sub.push(event)
                self.counters.events_dropped += sub.dropped - before

    def _note_grant_change(self, kind: EventKind, grant: Grant, detail: str, reason: str) -> None:
        """Count a grant change by reason and mark it in the application's history; a new grant naming
        a pid is checked against that process at once (`_grant_process_runs`), so that a process that
        exits before the next sweep still counts as seen."""
        if kind == EventKind.GRANTED and grant.pid > 0:
            start_s = self.process_start(grant.pid)
            if start_s is not None:  # the request proved this process just now: it is the grant's
                self._process_seen[grant.grant_id] = start_s
        if not reason:
            reason = grant.source if kind == EventKind.GRANTED else str(kind)
        key = (str(kind), reason)
        self.counters.grant_changes[key] = self.counters.grant_changes.get(key, 0) + 1
        held = sum(g.memory_mib for g in self.ledger.grants(app_id=grant.app_id, device_id=grant.device_id))
        text = detail if kind != EventKind.GRANTED else f"{grant.memory_mib:.0f} MiB ({detail or grant.source})"
        self.history.event(grant.app_id, grant.device_id, HistoryEvent(self.clock(), str(kind), text, held))

    def _changed(self) -> None:
        """Store the ledger's changes (`on_change`), before anything else acts on them: when that
        fails the changes are undone in memory and the error propagates (the call made nothing)."""
        if self.on_change is None:
            self.ledger.commit_changes()
            return
        try:
            self.on_change(self.ledger)
        except BaseException:
            self.ledger.rollback_changes()
            raise

    @property
    def watchers(self) -> int:
        """Open `watch()` subscriptions."""
        return len(self._subscriptions)

    def watch(self, app_id: str | None = None, *, owner: str = "", uid: int | None = None) -> Subscription:
        """Subscribe to allocation events (every application's, or one's plus device-level events).
        Iterate with `async for`; `close()` it when done. Must be called on the allocator's loop.
        `owner` names the caller for the per-caller bound and `uid` the Unix user for the per-uid
        one (None: not bounded per uid), whatever token it called with: each application id a user
        claims comes with a token of its own, so tokens alone do not bound a user's watchers.
        InsufficientResources names the bound that is reached; Stopping (an Unavailable) once
        `end_watches()` was called (the daemon is stopping)."""
        if self._watches_ended:
            raise Stopping("the daemon is stopping; watch again once it is back")
        if self._max_watchers is not None and len(self._subscriptions) >= self._max_watchers:
            raise QuotaExceeded(
                f"quota: {len(self._subscriptions)} watchers are open, the limit (max_watchers = "
                f"{self._max_watchers}); close one first", quota="max_watchers"
            )
        if self._max_watchers_per_caller is not None:
            mine = sum(1 for s in self._subscriptions if s.owner == owner)
            if mine >= self._max_watchers_per_caller:
                raise QuotaExceeded(
                    f"quota: {owner or 'this caller'} has {mine} watchers open, its limit "
                    f"(max_watchers_per_caller = {self._max_watchers_per_caller}); close one first",
                    quota="max_watchers_per_caller"
                )
        if uid is not None and self._max_watchers_per_uid is not None:
            theirs = sum(1 for s in self._subscriptions if s.uid == uid)
            if theirs >= self._max_watchers_per_uid:
                raise QuotaExceeded(
                    f"quota: uid {uid} has {theirs} watchers open, its share (server.max_watchers_per_uid = "
                    f"{self._max_watchers_per_uid}); close one first", quota="max_watchers_per_uid"
                )
        sub = Subscription(app_id, self._watch_queue_size, self._subscriptions.remove, owner=owner, uid=uid,
                           drop_slow=self._drop_slow_watchers)
        self._subscriptions.append(sub)
        return sub

    # --- application API -------------------------------------------------------------------------
    @property
    def refusing_changes(self) -> bool:
        """Whether changes are refused (`refuse_changes()` or `stop()` was called)."""
        return self._refusing

    def refuse_changes(self) -> None:
        """Refuse every change from now on (Unavailable, nothing changed): the daemon has decided to
        stop. Idempotent; `stop()` implies it."""
        self._refusing = True

    def _check_open(self) -> None:
        if self._refusing:
            raise Stopping("the daemon is stopping: nothing was changed; send it again once the daemon is back")

    def request_allocation(self, request: AllocationRequest, *, caller: str | None = None) -> Grant:
        """The grant that answers the request (`allocate`)."""
        return self.allocate(request, caller=caller).grant

    def allocate(self, request: AllocationRequest, *, caller: str | None = None) -> Allocated:
        """Grant what the request asks for, or (memory 0 with a job description) what the cold-start
        sizer says; InsufficientResources when it does not fit (for a sized job, the message names
        the job and its size), InvalidRequest when the job cannot be sized, NotSupported without a
        sizer, Unavailable once stopping (nothing changes in any of these).

        A job its process already holds a cold-start grant for is answered with that grant, as it
        stands, and nothing changes (`_held_cold_start`; `Allocated.held`): a process that declares
        its job again (a retry, a call per epoch) holds one grant for it, not one per call.

        A declared job (cold start) supersedes the policy's forecast grants of the application on the
        device it is granted on (`_supersede_forecast`): they are released in the same stored change,
        the room they held counts toward the new grant, and the new grant is no smaller than they
        were nor than the application uses there now, so the application holds one managed grant
        there, the one the policy resizes. Without a device named, a job of an application that
        holds a forecast grant goes to that grant's device (where its process runs)."""
        self._check_open()
        held = self._held_cold_start(request, caller)
        if held is not None:
            return Allocated(held, held=True)
        memory_mib, sm_pct, source = self._size_request(request)
        sized_mib = memory_mib
        superseded: list[Grant] = []
        cuts: list[tuple[Grant, Grant]] = []
        try:
            if source == "cold_start":
                device_id = request.device_id or self._forecast_device(request.app_id)
                if device_id:
                    request = dataclasses.replace(request, device_id=device_id)
                    superseded, memory_mib, sm_pct = self._supersede_forecast(request, device_id, memory_mib,
                                                                              sm_pct, caller)
            try:
                grant = self._grant(request, memory_mib, sm_pct, source, request.device_id or None, caller,
                                    sized_mib)
            except InsufficientResources as refused:
                if not self.reclaim:
                    raise
                # the sizer's SM estimate is not what the application asked for: trimmed, never refused
                sm_elastic = _sm_estimated(request, source)
                grant, cuts = self._grant_reclaiming(request, memory_mib, sm_pct, source, sm_elastic, caller,
                                                     refused, sized_mib)
        except BaseException as exc:
            self.ledger.rollback_changes()  # the superseded grants stay when the new one is not made
            if source == "cold_start" and request.job is not None and type(exc) is InsufficientResources:
                # the application asked for no figure: say whose figure it is (a quota's refusal is
                # about the count of grants, not the size, and stays as it is)
                raise _sized_refusal(exc, request.job, sized_mib, memory_mib) from exc
            raise
        self._changed()  # stored before anyone hears of it (the cuts and releases with it; undone with it)
        if grant.cold_start_mib is not None:
            self._cold_start_mib[grant.app_id] = grant.cold_start_mib
        self._seen[grant.app_id] = self.clock()
        self.counters.granted += 1
        self.counters.resized += len(cuts)
        self.counters.released += len(superseded)
        if cuts:
            self.counters.reclaims += 1
        # the caps first, as the ledger is now (the cut grants' lower caps with the new one's): the
        # events say what is in force
        self._sync_cgroup_limits(grant.device_id)
        for new, old in cuts:
            self._log.info("reclaimed", app=new.app_id, device=new.device_id, grant=new.grant_id,
                           memory_mib=new.memory_mib, was_memory_mib=old.memory_mib, sm_pct=new.sm_pct,
                           was_sm_pct=old.sm_pct, for_app=grant.app_id)
            self._publish(EventKind.RESIZED, grant=new, reason="reclaim",
                          detail=f"reclaimed for {grant.app_id}'s {source}: {_resize_text(old, new)}")
        for old in superseded:
            self._log.info("released", app=old.app_id, grant=old.grant_id, reason="superseded",
                           memory_mib=old.memory_mib, by_grant=grant.grant_id)
            self._publish(EventKind.RELEASED, grant=old, reason="superseded",
                          detail=f"superseded by its {source} grant {grant.grant_id} "
                                 f"({grant.memory_mib:.0f} MiB, {grant.sm_pct:.3g} % SM)")
        self._log.info("granted", app=grant.app_id, device=grant.device_id, memory_mib=grant.memory_mib,
                       sm_pct=grant.sm_pct, source=source, grant=grant.grant_id,
                       **({"reclaimed_from": [g.app_id for g, _ in cuts]} if cuts else {}),
                       **({"superseded": [g.grant_id for g in superseded]} if superseded else {}))
        self._publish(EventKind.GRANTED, grant=grant, detail=source)
        return Allocated(grant)

    def _held_cold_start(self, request: AllocationRequest, caller: str | None) -> Grant | None:
        """The live cold-start grant the requesting process holds for the job it declares, if any:
        a request to be sized (memory 0, a job, a sizer) of the application's own (not an operator
        acting for it), naming its pid, whose grant of the same application and pid was sized for
        the same job (`job_digest`), on the device it names if it names one, taking the same uid's
        share, while that grant's process still runs (not a process that took its pid over: a new
        process with the same job gets a grant of its own). The newest such grant; None if there
        is none. Counted (`Counters.cold_start_reused`) and logged once per grant
        (`cold_start_reused`); the request is the application's sign of life."""
        if not (request.memory_mib == 0 and request.job is not None and self.sizer is not None and request.pid > 0):
            return None
        if caller is not None and caller != request.app_id:
            return None  # not the application's own call: the ledger refuses it on the usual path
        digest = job_digest(request.job)
        mine = [g for g in self.ledger.grants(app_id=request.app_id)
                if g.source == "cold_start" and g.pid == request.pid and g.job_digest == digest
                and (not request.device_id or g.device_id == request.device_id) and g.uid == request.uid]
        if not mine:
            return None
        start_s = self.process_start(request.pid)
        held = [g for g in mine if self._grant_process_runs(g, start_s)]
        if not held:
            return None
        grant = max(held, key=lambda g: g.created_at_s)
        self._seen[grant.app_id] = self.clock()
        self.counters.cold_start_reused += 1
        if grant.grant_id not in self._reuse_logged:
            live = {g.grant_id for g in self.ledger.grants()}
            self._reuse_logged = {g for g in self._reuse_logged if g in live} | {grant.grant_id}
            self._log.info("cold_start_reused", app=grant.app_id, grant=grant.grant_id, pid=grant.pid,
                           device=grant.device_id, memory_mib=grant.memory_mib, sm_pct=grant.sm_pct,
                           job=job_text(request.job),
                           detail="this process declared the job it already holds this grant for: the grant "
                                  "answers again, no second one is made")
        return grant

    def _forecast_device(self, app_id: str) -> str | None:
        """The device of the application's forecast grants, where its process runs: its latest
        recommendation's device when it holds one there, else its newest forecast grant's; None
        without a forecast grant."""
        grants = [g for g in self.ledger.grants(app_id=app_id) if g.source == "forecast"]
        if not grants:
            return None
        rec = self._latest.get(app_id)
        if rec is not None and any(g.device_id == rec.device_id for g in grants):
            return rec.device_id
        return max(grants, key=lambda g: g.created_at_s).device_id

    def _supersede_forecast(self, request: AllocationRequest, device_id: str, memory_mib: float, sm_pct: float,
                            caller: str | None) -> tuple[list[Grant], float, float]:
        """Release the application's forecast grants on the device, in the ledger only (the caller
        grants, stores and announces, or rolls back), for the cold-start grant that supersedes
        them; the grants released and the size that grant gets: the sizer's (`memory_mib`,
        `sm_pct`), at least what they held, and memory at least what the application uses there
        now (its latest recommendation's) beyond its other grants there, as far as the device has
        room for it. The room they held counts toward the new grant, so the declaration is never
        refused for room the application itself held; nothing it holds or uses is cut."""
        mine = self.ledger.grants(app_id=request.app_id, device_id=device_id)
        old = [g for g in mine if g.source == "forecast"]
        if not old:
            return [], memory_mib, sm_pct
        held_mem = sum(g.memory_mib for g in old)
        held_sm = min(100.0, sum(g.sm_pct for g in old))
        kept_mem = sum(g.memory_mib for g in mine if g.source != "forecast")
        for g in old:
            self.ledger.release(g.grant_id, caller=caller)
        rec = self._latest.get(request.app_id)
        in_use = 0.0
        if rec is not None and rec.device_id == device_id and math.isfinite(rec.mem_used_mib):
            in_use = min(max(rec.mem_used_mib - kept_mem, 0.0), self.ledger.headroom(request.app_id, device_id)[0])
        return old, max(memory_mib, held_mem, in_use), max(sm_pct, held_sm)

    def _grant(self, request: AllocationRequest, memory_mib: float, sm_pct: float, source: str,
               device_id: str | None, caller: str | None, sized_mib: float | None = None) -> Grant:
        """The grant in the ledger; a cold-start grant keeps the sizer's size (`sized_mib`, else
        `memory_mib`) as its `cold_start_mib`, and says whether its SM share is the sizer's
        estimate (`sm_estimated`: the request named no SM)."""
        return self.ledger.grant(
            request.app_id,
            memory_mib,
            sm_pct,
            device_id=device_id,
            priority=request.priority,
            source=source,
            pid=request.pid,
            uid=request.uid,
            caller=caller,
            cold_start_mib=(memory_mib if sized_mib is None else sized_mib) if source == "cold_start" else None,
            sm_estimated=_sm_estimated(request, source),
            job_digest=job_digest(request.job) if source == "cold_start" and request.job is not None else None,
        )

    def _grant_reclaiming(self, request: AllocationRequest, memory_mib: float, sm_pct: float, source: str,
                          sm_elastic: bool, caller: str | None, refused: InsufficientResources,
                          sized_mib: float | None = None) -> tuple[Grant, list[tuple[Grant, Grant]]]:
        """A request that does not fit in what is free, granted by cutting the policy's managed
        grants down toward what their applications need now (allocator/reclaim.py), on its device
        or, without one, on the device that has the most memory left after; the grant and each cut
        as (new, old), in the ledger only (the caller stores and announces). InsufficientResources,
        nothing changed, when it does not fit even so (the ledger's reason and what is committed and
        reclaimable), or when the application's quota or limits refuse it."""
        self.ledger.check_admissible(request.app_id, memory_mib, 0.0 if sm_elastic else sm_pct, uid=request.uid)
        devices = [request.device_id] if request.device_id else [c.device_id for c in self.ledger.devices()]
        best: ReclaimPlan | None = None
        for device_id in devices:
            usage = self.ledger.usage(device_id)
            # an estimate is not taken for another estimate: that would only move a guess
            plan = plan_reclaim(device_id, usage.mem_available_mib, usage.sm_available_pct, memory_mib, sm_pct,
                                self._slacks(device_id, estimates=not sm_elastic), sm_elastic=sm_elastic)
            if plan is not None and (best is None or plan.mem_left_mib > best.mem_left_mib):
                best = plan
        if best is None:
            raise InsufficientResources(f"{refused}; {self._reclaim_text(devices)}") from None
        cuts: list[tuple[Grant, Grant]] = []
        try:
            for cut in best.cuts:
                old = self.ledger.get(cut.grant_id)
                cuts.append((self.ledger.resize(cut.grant_id, cut.memory_mib, cut.sm_pct), old))
            granted_sm = best.sm_pct
            if sm_elastic:  # within the application's own SM limit too
                granted_sm = min(granted_sm, self.ledger.headroom(request.app_id, best.device_id)[1])
            grant = self._grant(request, memory_mib, granted_sm, source, best.device_id, caller, sized_mib)
        except BaseException:
            self.ledger.rollback_changes()  # the cuts go with the grant that needed them
            raise
        return grant, cuts

    def _slacks(self, device_id: str, *, estimates: bool = True) -> list[Slack]:
        """The grants on the device the policy manages, each with the least it may be cut to: per
        application, its latest grant not from a request (the one the policy resizes), down to its
        usage (the latest recommendation's) plus `reclaim_margin_frac` (at least
        `reclaim_min_mib`) less its other grants there; a cold-start grant keeps at least the
        sizer's size too. SM likewise, from its SM use. An application whose usage is not known
        here gives nothing back, but for the SM share the sizer estimated for its job
        (`Grant.sm_estimated`): that share was never asked for, no limit holds the job to it (SM
        is time-sliced), and the policy gives the job its share from its use once it is known,
        so a request may take all of it (`estimates`; off, such a share gives nothing)."""
        by_app: dict[str, list[Grant]] = {}
        for g in self.ledger.grants(device_id=device_id):
            by_app.setdefault(g.app_id, []).append(g)
        slacks = []
        for app_id, grants in by_app.items():
            managed = [g for g in grants if g.source != "request"]
            if not managed:
                continue
            own = max(managed, key=lambda g: g.created_at_s)
            rec = self._latest.get(app_id)
            if rec is None or rec.device_id != device_id:
                if estimates and own.sm_estimated and own.sm_pct > 0:
                    slacks.append(Slack(own.grant_id, app_id, own.priority, own.memory_mib, own.sm_pct,
                                        own.memory_mib, 0.0))
                continue
            other_mem = sum(g.memory_mib for g in grants if g is not own)
            other_sm = sum(g.sm_pct for g in grants if g is not own)
            mem_floor = sm_floor = math.inf
            if math.isfinite(rec.mem_used_mib) and rec.mem_used_mib >= 0:
                need = max(rec.mem_used_mib * (1.0 + self.reclaim_margin_frac), self.reclaim_min_mib)
                mem_floor = need - other_mem
                if own.source == "cold_start" and own.cold_start_mib is not None:
                    mem_floor = max(mem_floor, own.cold_start_mib)
            if math.isfinite(rec.sm_util_pct) and rec.sm_util_pct >= 0:
                sm_floor = rec.sm_util_pct * (1.0 + self.reclaim_margin_frac) - other_sm
            slacks.append(Slack(own.grant_id, app_id, own.priority, own.memory_mib, own.sm_pct,
                                min(own.memory_mib, max(mem_floor, 0.0)), min(own.sm_pct, max(sm_floor, 0.0))))
        return slacks

    def _reclaim_text(self, devices: Sequence[str]) -> str:
        """What stands on each device: committed (requests and cold-start sizes), held by the
        policy's managed grants above what their applications need now (reclaimable), free."""
        parts = []
        for device_id in devices:
            usage = self.ledger.usage(device_id)
            # memory by the managed grants whose use is known; a loading job's SM estimate counts
            # among what is reclaimable, its memory among what is committed
            slacks = self._slacks(device_id, estimates=False)
            sm_reclaimable = sum(s.sm_slack_pct for s in self._slacks(device_id))
            managed = {s.grant_id for s in slacks}
            committed = sum(g.memory_mib for g in self.ledger.grants(device_id=device_id) if g.grant_id not in managed)
            parts.append(
                f"on {device_id}: {committed:.0f} MiB committed (requests, cold-start sizes, grants whose use "
                f"is not known), {sum(s.mem_floor_mib for s in slacks):.0f} MiB needed now by forecast-managed "
                f"applications, {sum(s.mem_slack_mib for s in slacks):.0f} MiB reclaimable from their grants, "
                f"{usage.mem_available_mib:.0f} MiB free; {sm_reclaimable:.3g} % SM "
                f"reclaimable, {usage.sm_available_pct:.3g} % free"
            )
        return "; ".join(parts)

    def _size_request(self, request: AllocationRequest) -> tuple[float, float, str]:
        """(memory MiB, SM %, source) to grant: what the request asks for ("request"), or for memory
        0 with a job description, the cold-start sizer's size ("cold_start", SM the larger of the
        two). Raises before anything changes, as `request_allocation` says."""
        memory_mib, sm_pct, source = request.memory_mib, request.sm_pct, "request"
        if memory_mib == 0 and request.job is not None and self.sizer is None:
            raise NotSupported("this allocator has no cold-start sizer to size request.job: give request.memory_mib")
        if memory_mib == 0 and request.job is not None and self.sizer is not None:
            total = self._total_for(request.device_id)
            try:
                request.job.check_sizable()
                sizing = self.sizer.size(request.job, mem_total_mib=total)
            except InvalidJobConfig as exc:
                raise InvalidRequest(f"request.job cannot be sized: {exc}; fix the job or give memory_mib") from exc
            memory_mib, sm_pct, source = sizing.memory_mib, max(sm_pct, sizing.sm_pct), "cold_start"
            self._log.info("cold_start_sized", app=request.app_id, memory_mib=memory_mib, sm_pct=sm_pct,
                           reason=sizing.reason)
        return memory_mib, sm_pct, source

    def _total_for(self, device_id: str | None) -> float:
        if device_id:
            return self.ledger.capacity(device_id).mem_total_mib
        caps = self.ledger.devices()
        return max((c.mem_total_mib for c in caps), default=0.0)

    def release(self, grant_id: str, *, caller: str | None = None, reason: str = "", counted_as: str = "") -> Grant:
        """Release one grant; `reason` is the RELEASED event's detail, `counted_as` the reason it is
        counted under (`Counters.grant_changes`; "": "released")."""
        self._check_open()
        grant = self.ledger.release(grant_id, caller=caller)
        self._changed()
        if caller is not None and caller == grant.app_id:
            # the application's own call: a sign of life, as a request is (an operator's or the
            # daemon's release is not one)
            self._seen[grant.app_id] = self.clock()
        self._process_seen.pop(grant_id, None)
        self._recount(grant.device_id, grant.app_id)
        self.counters.released += 1
        self._log.info("released", app=grant.app_id, grant=grant_id, **({"reason": reason} if reason else {}))
        self._sync_cgroup_limits(grant.device_id)  # as in request_allocation
        self._publish(EventKind.RELEASED, grant=grant, detail=reason, reason=counted_as)
        return grant

    def forget_app(self, app_id: str) -> list[Grant]:
        """An application went silent: release its forecast and cold-start grants (grants it
        requested itself stay until it releases them) and drop its latest recommendation. Once
        stopping, the grants stay (stored as they are; a restarted daemon releases them if the
        application stays silent)."""
        self._latest.pop(app_id, None)
        if self._refusing:
            return []
        self._cold_start_mib.pop(app_id, None)
        self._unplan(app_id)
        gone = []
        for g in [g for g in self.ledger.grants(app_id=app_id) if g.source != "request"]:
            try:
                self.release(g.grant_id)
            except StateNotSaved as exc:  # kept (undone in memory); an operator can release it later
                self._log.error("release_not_saved", app=app_id, grant=g.grant_id, error=str(exc))
                continue
            gone.append(g)
        if not self.ledger.grants(app_id=app_id):
            self.history.depart(app_id)
        for device_id in sorted(self._device_ids()):  # a plan's word that ended with it: the caps follow now
            if device_id in self._enforced and self._enforced[device_id] != self.memory_enforcement(device_id).hard_mem:
                self._sync_cgroup_limits(device_id)
        return gone

    def _unplan(self, app_id: str) -> None:
        """`app_id` is no longer planned (its latest recommendation is gone): a plan's word for a
        device where no planned application is left ends, and every other plan's word is judged
        again with its grants in place of its need (`_recount`)."""
        for device_id in [d for d in self._plan_enforcement if not any(r.device_id == d for r in self._latest.values())]:
            del self._plan_enforcement[device_id]  # no planned application is left to plan it
        for device_id in list(self._plan_enforcement):
            self._recount(device_id, app_id)  # no longer planned: its grants count, not its need

    def _recount(self, device_id: str, app_id: str) -> None:
        """After `app_id` released a grant on the device or departed: judge the latest plan's
        decision for the device again (`Enforcement.recounted`) with what the application counts
        now: its planned need while it still holds a grant there and is still planned there, else
        its grants there (none: left out). The plan stays in force for the applications left; when
        it no longer marks the device contended with them, the caps are lifted at once (the
        caller syncs them) instead of at the next plan, which may never come if nobody there
        sends signatures."""
        planned = self._plan_enforcement.get(device_id)
        if planned is None or app_id not in {a for a, _ in planned.counted_mib}:
            return  # no plan here, or one that did not count it: the grants alone speak for it
        grants = self.ledger.grants(app_id=app_id, device_id=device_id)
        rec = self._latest.get(app_id)
        if grants and rec is not None and rec.device_id == device_id:
            return  # still planned here: its need stands until the next plan
        self._plan_enforcement[device_id] = planned.recounted(app_id, sum(g.memory_mib for g in grants))

    # --- applications that vanished --------------------------------------------------------------
    def last_seen_s(self, app_id: str, *, counting_start: bool = True) -> float | None:
        """When `app_id` last showed a sign of life: now while it has a watch of its own open or a
        grant whose process runs (a process that took the pid over after the grant was made is not
        the grant's: `_grant_process_runs`); else the latest of its last request, a change to one of its grants,
        its last signature (`signature_seen`) and, for an app with grants and `counting_start`, this
        allocator's start: the idle release's clock, which gives grants restored after a restart the
        full time to show up. What the operator is shown (`applications`) leaves the start out: it is
        the daemon's, not a sign of the application. None when there is no sign at all."""
        now = self.clock()
        grants = self.ledger.grants(app_id=app_id)
        if any(sub.app_id == app_id for sub in self._subscriptions):
            return now
        if any(g.pid > 0 and self._grant_process_runs(g, self.process_start(g.pid)) for g in grants):
            return now
        signs = [self._seen.get(app_id), self.signature_seen(app_id), *(g.updated_at_s for g in grants)]
        if grants and counting_start:
            signs.append(self._started_s)
        known = [t for t in signs if t is not None and math.isfinite(t)]
        return max(known) if known else None

    def _drop_stale_recommendations(self, now: float, idle_s: float) -> None:
        """Forget the latest recommendation of each application without grants or limits (listed
        for that recommendation only) whose last sign of life is more than `idle_s` old."""
        for app_id in sorted(set(self._latest) - set(self.ledger.apps())):
            seen = self.last_seen_s(app_id)
            if seen is None or now - seen > idle_s:
                self._latest.pop(app_id, None)

    def release_vanished(self, idle_s: float) -> list[str]:
        """Release every grant of each application with no sign of life (`last_seen_s`) for more than
        `idle_s` seconds, with a log line and a RELEASED event per grant saying why; the apps released.
        None once stopping."""
        if self._refusing:
            return []
        now = self.clock()
        gone = []
        self._drop_stale_recommendations(now, idle_s)
        for app_id in sorted(self.ledger.apps()):
            grants = self.ledger.grants(app_id=app_id)
            if not grants:
                continue
            seen = self.last_seen_s(app_id)
            if seen is not None and now - seen <= idle_s:
                continue
            idle = math.inf if seen is None else now - seen
            reason = f"idle: no signature, live process, watch or request for {idle:.0f} s (limit {idle_s:g} s)"
            self._log.warning("app_released_idle", app=app_id, last_seen_s=seen, idle_s=round(idle, 1),
                              limit_s=idle_s, grants=[g.grant_id for g in grants],
                              memory_mib=sum(g.memory_mib for g in grants))
            self.release_departed(app_id, reason=reason, seen=seen)
            if not self.ledger.grants(app_id=app_id):
                gone.append(app_id)
        return gone

    def release_departed(self, app_id: str, *, reason: str, seen: float | None) -> list[Grant]:
        """Release every grant of `app_id`, an application that has gone, with `reason` on each RELEASED
        event, and forget its latest recommendation; its last sign of life (`seen`) stays listed (LAST
        SEEN), as for an application released itself. A grant whose release cannot be stored is kept
        (undone in memory, logged) and the others go on, so one failing write never stops a sweep
        half-way; the next sweep tries it again. Its node-history series ends once no grant is left.
        The grants released (none once stopping: they stay stored for the restarted daemon)."""
        if self._refusing:
            return []
        released = []
        for g in self.ledger.grants(app_id=app_id):
            try:
                released.append(self.release(g.grant_id, reason=reason))
            except StateNotSaved as exc:
                self._log.error("release_not_saved", app=app_id, grant=g.grant_id, error=str(exc))
        self._latest.pop(app_id, None)
        if seen is not None:
            self._seen[app_id] = seen
        if not self.ledger.grants(app_id=app_id):
            self.history.depart(app_id)
        return released

    # --- processes that exited ------------------------------------------------------------------
    def _grant_process_runs(self, grant: Grant, start_s: float | None) -> bool:
        """Whether the process `grant` names runs, given when the process now holding its pid started
        (`start_s`; None: no process has that pid here). Once the grant's process has been seen, its
        start time is the one seen then: another start time at that pid is another process that took
        the pid over (pid reuse). Comparing start times read the same way, rather than with the
        grant's creation time, keeps a step of the wall clock from passing a live process for a new
        one. A grant not seen yet (restored after a restart, or whose process was not visible when it
        was made) is the grant's process when it started no later than the grant was made; it is then
        marked seen (`release_exited` releases only those)."""
        if start_s is None:
            return False
        seen = self._process_seen.get(grant.grant_id)
        if seen is not None:
            return abs(start_s - seen) <= PROCESS_START_TOLERANCE_S
        if start_s <= grant.created_at_s + PROCESS_START_TOLERANCE_S:
            self._process_seen[grant.grant_id] = start_s
            return True
        return False

    def release_exited(self, grace_s: float) -> list[str]:
        """Release the grants whose process has exited, without waiting for the idle release; the
        grants released (their ids). One look at each distinct pid the grants name
        (`process_start`). A grant is released when all of these hold:
        - it names a pid (a grant without one keeps to `release_vanished`), and this allocator has seen
          that process run, at the grant's making or at a sweep since. A pid the daemon never saw
          (a pid an operator named that does not exist here; one named over TCP, read in the daemon's
          pid namespace though the caller's may differ) may belong to a process that runs where the
          daemon cannot look, so it is left to the idle release;
        - no process has that pid now, or the one that has it started after the grant was made
          (the pid was reused: `_grant_process_runs`);
        - when no grant of its application names a running process any more: no watch of the
          application's own is open and neither a request nor a signature came from it in the last
          `grace_s` seconds (a watch, or signatures still arriving, with no process of it left in
          sight means that something of it lives where the daemon cannot see it). While another of
          its processes runs, that process explains the watch and the signatures, and the exited
          process's grants go at once: the client stub takes as its own only the grants naming its
          own pid, so nobody else uses them.
        Each is released with a RELEASED event whose detail says which process exited, logged once per
        application (`app_released_exited`). A release that cannot be stored keeps its grant (logged,
        tried again at the next sweep). Nothing once stopping, or with `grace_s` <= 0 (the rule is off)."""
        if self._refusing or not grace_s > 0:
            return []
        grants = [g for g in self.ledger.grants() if g.pid > 0]
        live = {g.grant_id for g in grants}
        self._process_seen = {g: t for g, t in self._process_seen.items() if g in live}  # released elsewhere
        starts = {pid: self.process_start(pid) for pid in sorted({g.pid for g in grants})}
        exited: dict[str, list[Grant]] = {}
        running: set[str] = set()
        for g in grants:
            if self._grant_process_runs(g, starts[g.pid]):
                running.add(g.app_id)
            elif g.grant_id in self._process_seen:
                exited.setdefault(g.app_id, []).append(g)
        now = self.clock()
        released: list[str] = []
        for app_id in sorted(exited):
            if app_id not in running:
                if self.watched(app_id):
                    continue
                heard = [t for t in (self._seen.get(app_id), self.signature_seen(app_id))
                         if t is not None and math.isfinite(t)]
                if heard and now - max(heard) < grace_s:
                    continue
            gone = exited[app_id]
            pids = sorted({g.pid for g in gone})
            self._log.warning("app_released_exited", app=app_id, pids=pids, grants=[g.grant_id for g in gone],
                              memory_mib=sum(g.memory_mib for g in gone))
            for g in gone:
                start = starts[g.pid]
                why = (f"its process {g.pid} exited" if start is None else
                       f"its process {g.pid} exited (pid {g.pid} is now another process's, started after the grant)")
                try:
                    self.release(g.grant_id, reason=why, counted_as="exited")
                except StateNotSaved as exc:  # kept (undone in memory); the next sweep tries it again
                    self._log.error("release_not_saved", app=app_id, grant=g.grant_id, error=str(exc))
                    continue
                released.append(g.grant_id)
            if not self.ledger.grants(app_id=app_id):
                self._latest.pop(app_id, None)
                self._unplan(app_id)
                self.history.depart(app_id)
        return released

    def watched(self, app_id: str) -> bool:
        """Whether a watch of `app_id`'s own grants is open (a client stub's)."""
        return any(sub.app_id == app_id for sub in self._subscriptions)

    def set_limits(self, limits: AppLimits, *, caller: str | None = None) -> AppLimits:
        """Set an application's caps. A cap covers every grant of the application, the ones it holds
        already included: grants over the new memory or SM cap are cut down to it at once (each a
        RESIZED event), largest first. Logged as `limits_set`, and `limit_below_usage` when the
        application uses more memory than its new cap. Unavailable once stopping."""
        self._check_open()
        before = self.ledger.limits(limits.app_id)
        result = self.ledger.set_limits(limits, caller=caller)
        capped = self._cap_grants(result)
        self._changed()  # stored before anyone hears of it; undone in memory (limits and cuts) if not
        rec = self._latest.get(result.app_id)
        self._log.info("limits_set", app=result.app_id, before=_limits_text(before) if before else None,
                       after=_limits_text(result), grants_capped=[g.grant_id for g, _ in capped])
        used = rec.mem_used_mib if rec is not None else math.nan
        if result.max_memory_mib is not None and math.isfinite(used) and used > result.max_memory_mib:
            self._log.warning("limit_below_usage", app=result.app_id, mem_used_mib=used,
                              max_memory_mib=result.max_memory_mib)
        for device_id in sorted({g.device_id for g, _ in capped}):
            self._sync_cgroup_limits(device_id)  # as in request_allocation
        for new, old in capped:
            self.counters.resized += 1
            self._publish(EventKind.RESIZED, grant=new,
                          detail=f"capped by limits: {_resize_text(old, new)}", reason="limits")
        self._publish(EventKind.LIMITS_CHANGED, app_id=result.app_id, detail=_limits_text(result))
        return result

    def _cap_grants(self, limits: AppLimits) -> list[tuple[Grant, Grant]]:
        """Cut the application's grants down to its caps, largest first, in the ledger only (the
        caller stores and announces them); each changed grant as (new, old)."""
        grants = sorted(self.ledger.grants(app_id=limits.app_id), key=lambda g: (-g.memory_mib, g.grant_id))
        mem_left = limits.max_memory_mib if limits.max_memory_mib is not None else math.inf
        sm_left = limits.max_sm_pct if limits.max_sm_pct is not None else math.inf
        over_mem = sum(g.memory_mib for g in grants) - mem_left
        over_sm = sum(g.sm_pct for g in grants) - sm_left
        changed = []
        for g in grants:
            mem_cut = min(g.memory_mib, max(0.0, over_mem))
            sm_cut = min(g.sm_pct, max(0.0, over_sm))
            if mem_cut <= 0 and sm_cut <= 0:
                continue
            over_mem -= mem_cut
            over_sm -= sm_cut
            new = self.ledger.resize(g.grant_id, g.memory_mib - mem_cut, g.sm_pct - sm_cut, clamp=True)
            changed.append((new, g))
        return changed

    def available(self, device_id: str | None = None) -> list[DeviceResources]:
        """Free and granted resources per device (one device when `device_id` is given; NotFound
        if unknown). Device fields that cannot be read are None / empty (reads degrade)."""
        caps = [self.ledger.capacity(device_id)] if device_id else self.ledger.devices()
        out: list[DeviceResources] = []
        for cap in caps:
            usage = self.ledger.usage(cap.device_id)
            view = self._device_state(cap.device_id)
            base = DeviceResources(
                **vars(usage),
                power_limit_mw=view.power_limit_mw,
                power_constraints=view.power_constraints,
                mig_enabled=view.mig_enabled,
                mig_instances=view.mig_instances,
                dry_run=self.dry_run,
            )
            out.append(self._live_reads(cap.device_id, base))
        return out

    def _live_reads(self, device_id: str, base: DeviceResources) -> DeviceResources:
        """`base` with what the device reports now, field by field: a read that fails leaves its
        field None."""
        dev = self._read_device(device_id)
        if dev is None:
            return base
        util = _try(dev.utilization)
        return dataclasses.replace(
            base,
            index=dev.index,
            pci_bus_id=_try(dev.pci_bus_id),
            mem_used_mib=_try(lambda: dev.memory().used_mib),
            power_draw_mw=_try(dev.power_usage_mw),
            temperature_c=_try(dev.temperature_c),
            sm_clock_mhz=_try(dev.sm_clock_mhz),
            sm_util_pct=util.sm_pct if util is not None else None,
            mem_bw_util_pct=util.mem_bw_pct if util is not None else None,
            processes=tuple(_try(dev.processes) or ()),
        )

    def list_apps(self) -> list[AppInfo]:
        """Every application with a grant, limits or a recommendation, sorted by id."""
        ids = sorted(set(self.ledger.apps()) | set(self._latest))
        out = []
        for app_id in ids:
            rec = self._latest.get(app_id)
            grants = tuple(self.ledger.grants(app_id=app_id))
            mem_limit, mem_limit_reason = self.app_memory_limit(app_id)
            out.append(
                AppInfo(
                    app_id=app_id,
                    grants=grants,
                    limits=self.ledger.limits(app_id),
                    mem_used_mib=rec.mem_used_mib if rec else math.nan,
                    sm_util_pct=rec.sm_util_pct if rec else math.nan,
                    forecast_mem_p90_mib=rec.mem_p90_peak_mib if rec else math.nan,
                    forecast_sm_p90_pct=rec.sm_p90_peak_pct if rec else math.nan,
                    source=rec.source if rec else "",
                    last_seen_s=self.last_seen_s(app_id, counting_start=False),
                    device_id=rec.device_id if rec else (grants[0].device_id if grants else ""),
                    forecast_mem_p50_mib=rec.mem_p50_peak_mib if rec else math.nan,
                    forecast_sm_p50_pct=rec.sm_p50_peak_pct if rec else math.nan,
                    pids=tuple(sorted({g.pid for g in grants if g.pid > 0})),
                    mem_limit=mem_limit,
                    mem_limit_reason=mem_limit_reason,
                    plan=self._why.get(app_id) if rec is not None else None,
                )
            )
        return out

    # --- recommendations -------------------------------------------------------------------------
    def _read_device(self, device_id: str) -> Device | None:
        try:
            return self.backend.device(device_id)
        except DeviceError as exc:
            self._warn_once(f"device:{device_id}", "device_unreadable", device=device_id, error=str(exc))
            return None

    def _warn_once(self, key: str, event: str, **kw: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._log.warning(event, **kw)

    def _device_state(self, device_id: str) -> DeviceView:
        """The policy's view of a device; fields the device cannot give are None (logged once)."""
        return self._read_view(device_id)[0]

    def _read_view(self, device_id: str) -> tuple[DeviceView, bool]:
        """(the device's view, whether it could be read). NotSupported leaves a field None; any
        other DeviceError (a lost GPU, a driver error) leaves every field None and marks the device
        unreadable, so a caller acting on it skips it; both are logged once per device."""
        cap = self.ledger.capacity(device_id)
        dev = self._read_device(device_id)
        limit = constraints = None
        mig_enabled = False
        instances: tuple[GpuInstance, ...] = ()
        readable = dev is not None
        if dev is not None:
            try:
                limit, constraints = self._read_power(dev, device_id)
                mig_enabled, instances = _read_mig(dev)
            except DeviceError as exc:
                self._warn_once(f"device:{device_id}", "device_unreadable", device=device_id, error=str(exc))
                limit = constraints = None
                mig_enabled, instances, readable = False, (), False
        view = DeviceView(
            device_id=device_id,
            name=cap.name,
            mem_total_mib=cap.mem_total_mib,
            sm_total_pct=cap.sm_total_pct,
            grants=tuple(self.ledger.grants(device_id=device_id)),
            power_limit_mw=limit,
            power_constraints=constraints,
            power_enabled=self.power.disabled_reason(device_id) is None,
            mig_enabled=mig_enabled,
            mig_instances=instances,
        )
        return view, readable

    def _read_power(self, dev: Device, device_id: str) -> tuple[int | None, PowerConstraints | None]:
        """(power limit mW, constraints); both None when the device does not support reading them
        (logged once). Any other DeviceError propagates."""
        try:
            return dev.power_limit_mw(), dev.power_constraints()
        except NotSupported as exc:
            self._warn_once(f"power:{device_id}", "power_unreadable", device=device_id, error=str(exc))
            return None, None

    def _device_ids(self) -> set[str]:
        return {c.device_id for c in self.ledger.devices()}

    def knows_device(self, device_id: str) -> bool:
        """Whether `device_id` is one of this allocator's GPUs or a MIG instance on one of them."""
        known = {c.device_id for c in self.ledger.devices()}
        return device_id in known or self._parent_gpu(device_id, known) is not None

    def device_mem_total_mib(self, device_id: str) -> float | None:
        """The memory (MiB) of `device_id`: a whole GPU's ledger capacity, or a MIG instance's own
        memory (its GPU's when the device did not report the instance's); None for a device this
        allocator does not have. What no process on that device can use more of (the manager's bound
        on a signature's memory reading)."""
        known = {c.device_id for c in self.ledger.devices()}
        if device_id in known:
            return self.ledger.capacity(device_id).mem_total_mib
        parent = self._parent_gpu(device_id, known)
        if parent is None:
            return None
        own = self._mig_mem_mib.get(device_id)
        return own if own is not None and own > 0 else self.ledger.capacity(parent).mem_total_mib

    def _parent_gpu(self, device_id: str, known: set[str]) -> str | None:
        """The whole GPU a MIG instance UUID belongs to (the ledger holds whole GPUs; a MIG
        application reports its instance's UUID), or None when no device has that instance. The
        map is rebuilt on a miss, at most once a second."""
        parent = self._mig_parent.get(device_id)
        if parent is None and self.clock() - self._mig_parent_at_s >= 1.0:
            self._mig_parent_at_s = self.clock()
            fresh: dict[str, str] = {}
            mem: dict[str, float] = {}
            for gpu in sorted(known):
                dev = self._read_device(gpu)
                if dev is None:
                    continue
                try:
                    if dev.mig_enabled():
                        for gi in dev.gpu_instances():
                            if gi.uuid:
                                fresh[gi.uuid] = gpu
                                mem[gi.uuid] = gi.mem_total_mib
                except DeviceError:
                    continue  # its instances are found at a later miss
            self._mig_parent, self._mig_mem_mib = fresh, mem
            parent = fresh.get(device_id)
        return parent if parent in known else None

    def apply_recommendations(self, recommendations: Sequence[Recommendation]) -> ApplyReport:
        """Carry out the manager's recommendations: the policy plans grant sizes, power limits and
        MIG layouts; growth is clamped to what fits; device writes go through the mechanisms. A
        recommendation for an unknown device is skipped (reported in `skipped`). The steps, in
        order, are the module docstring's list. Unavailable once stopping."""
        self._check_open()
        usable, skipped = self._admit(recommendations)
        fresh = {r.app_id for r in usable}
        devices_touched = {r.device_id for r in usable}
        usable += self._stand_ins(fresh, devices_touched)
        views, usable = self._readable_views(devices_touched, usable, skipped)
        granted_before = {r.app_id: self._granted(r.app_id, r.device_id) for r in usable if r.app_id in fresh}
        plan: Plan = self.policy.plan(usable, views, self.clock())
        self._why.update((r.app_id, r) for r in plan.reasons)
        if len(self._why) > len(self._latest):  # applications no longer planned
            self._why = {a: r for a, r in self._why.items() if a in self._latest}
        created, resized, events = self._change_grants(plan.grants, skipped, self._why)
        if created or resized:
            created, resized, events = self._store_plan(created, resized, events, skipped)
        self.counters.granted += len(created)
        self.counters.resized += len(resized)
        self._enforce_plan(plan, devices_touched, {g.device_id for g in (*created, *resized)})
        for kind, grant, detail, reason in events:  # after the caps: each says what is in force
            self._publish(kind, grant=grant, detail=detail, reason=reason)
        for rec in usable:
            if rec.app_id in granted_before:
                self._record_tick(rec, granted_before[rec.app_id])
        power_results = [self._apply_power(t.device_id, t.limit_mw, t.reason) for t in plan.power]
        mig_changes = sum(self._apply_mig(t) for t in plan.mig)
        return ApplyReport(
            created=tuple(created),
            resized=tuple(resized),
            power=tuple(r for r in power_results if r is not None),
            mig_changes=mig_changes,
            skipped=tuple(skipped),
        )

    def _admit(self, recommendations: Sequence[Recommendation]) -> tuple[list[Recommendation], list[str]]:
        """Each recommendation counted and, when its device is known (a MIG instance's stands for
        its GPU), completed with the application's cold-start size and kept as its latest; the
        usable ones, and why each other one was skipped."""
        known = {c.device_id for c in self.ledger.devices()}
        usable: list[Recommendation] = []
        skipped: list[str] = []
        for rec in recommendations:
            self.counters.recommendations += 1
            if rec.device_id not in known:
                parent = self._parent_gpu(rec.device_id, known)
                if parent is None:
                    skipped.append(f"{rec.app_id}: unknown device {rec.device_id!r}")
                    continue
                rec = dataclasses.replace(rec, device_id=parent)  # noqa: PLW2901 - a MIG app, on its GPU
            cold_mib = self._cold_start_mib.get(rec.app_id)
            if cold_mib is not None and math.isnan(rec.cold_start_mem_mib):
                rec = dataclasses.replace(rec, cold_start_mem_mib=cold_mib)  # noqa: PLW2901 - what the sizer said
            self._latest[rec.app_id] = rec
            usable.append(rec)
        return usable, skipped

    def _stand_ins(self, fresh: set[str], devices_touched: set[str]) -> list[Recommendation]:
        """The latest recommendation of every other application on the devices touched.
        Recommendations arrive per application as each becomes due, but a device's plan (SM shares
        under contention, its power limit) must weigh every application on it."""
        return [r for app, r in self._latest.items() if app not in fresh and r.device_id in devices_touched]

    def _readable_views(self, devices_touched: set[str], usable: list[Recommendation],
                        skipped: list[str]) -> tuple[list[DeviceView], list[Recommendation]]:
        """The policy's view of each device touched, and the recommendations left once those for a
        device that cannot be read are dropped (each named in `skipped`)."""
        views = []
        for device_id in sorted(devices_touched):
            view, readable = self._read_view(device_id)
            if readable:
                views.append(view)
                continue
            skipped.extend(f"{r.app_id}: device {device_id!r} cannot be read" for r in usable if r.device_id == device_id)
            usable = [r for r in usable if r.device_id != device_id]
        return views, usable

    def _change_grants(self, targets: Sequence[GrantTarget], skipped: list[str],
                       why: Mapping[str, PlanReason] | None = None) -> tuple[
            list[Grant], list[Grant], list[tuple[EventKind, Grant, str, str]]]:
        """The plan's grant targets made in the ledger only, shrinks first: new grants and growth
        clamped to what fits, a resize that changes nothing dropped, a target the ledger refuses
        named in `skipped`. The grants created, the grants resized, and the events to publish once
        they are stored as (kind, grant, detail, reason); a resize's detail names the plan's rules
        (`why`) where the policy gave them."""
        why = why or {}
        created: list[Grant] = []
        resized: list[Grant] = []
        events: list[tuple[EventKind, Grant, str, str]] = []
        for target in self._shrinks_first(targets):
            try:
                if target.grant_id is None:
                    mem_room, sm_room = self.ledger.headroom(target.app_id, target.device_id)
                    grant = self.ledger.grant(
                        target.app_id,
                        min(target.memory_mib, mem_room),
                        min(target.sm_pct, sm_room),
                        device_id=target.device_id,
                        source="forecast",
                    )
                    created.append(grant)
                    events.append((EventKind.GRANTED, grant, target.reason or "forecast", ""))
                else:
                    old = self.ledger.get(target.grant_id)
                    grant = self.ledger.resize(target.grant_id, target.memory_mib, target.sm_pct, clamp=True)
                    if (grant.memory_mib, grant.sm_pct) == (old.memory_mib, old.sm_pct):
                        continue
                    resized.append(grant)
                    events.append((EventKind.RESIZED, grant, _resize_text(old, grant) + _rules_text(why.get(grant.app_id)),
                                   "grow" if grant.memory_mib > old.memory_mib or grant.sm_pct > old.sm_pct
                                   else "shrink"))
            except (DeviceError, InvalidRequest) as exc:
                skipped.append(f"{target.app_id}: {exc}")
        return created, resized, events

    def _store_plan(self, created: list[Grant], resized: list[Grant],
                    events: list[tuple[EventKind, Grant, str, str]], skipped: list[str]) -> tuple[
            list[Grant], list[Grant], list[tuple[EventKind, Grant, str, str]]]:
        """Store the plan's grant changes at once; when that fails they are undone in memory, each
        is named in `skipped` as not saved, and nothing is left to count or announce."""
        try:
            self._changed()
        except StateNotSaved as exc:
            self._log.error("plan_not_saved", grants=len(created) + len(resized), error=str(exc))
            skipped += [f"{g.app_id}: not saved: {exc}" for g in (*created, *resized)]
            return [], [], []
        return created, resized, events

    def _enforce_plan(self, plan: Plan, devices_touched: set[str], changed: set[str]) -> None:
        """Keep the plan's hard/cooperative word for each device touched, then sync the cgroup caps
        of each device whose grants changed or whose decision is no longer the one in force."""
        for e in plan.enforcement:
            if e.device_id in devices_touched:
                self._plan_enforcement[e.device_id] = e
        for device_id in sorted(changed | devices_touched):
            if device_id in changed or self._enforced.get(device_id) != self.memory_enforcement(device_id).hard_mem:
                self._sync_cgroup_limits(device_id)

    def _granted(self, app_id: str, device_id: str) -> tuple[float, float]:
        grants = self.ledger.grants(app_id=app_id, device_id=device_id)
        return sum(g.memory_mib for g in grants), sum(g.sm_pct for g in grants)

    def _record_tick(self, rec: Recommendation, before: tuple[float, float]) -> None:
        """One history point for a recommendation just carried out: the use it reports, its
        forecast, and the grant after it; an overrun is judged against the grant `before`."""
        mem, sm = self._granted(rec.app_id, rec.device_id)
        t = rec.decided_at_s if rec.decided_at_s > 0 else self.clock()
        point = HistoryPoint(t, rec.mem_used_mib, rec.mem_p50_peak_mib, rec.mem_p90_peak_mib, mem,
                             rec.sm_util_pct, rec.sm_p90_peak_pct, sm)
        if self.history.record(rec.app_id, rec.device_id, point, granted_before_mib=before[0]):
            self._log.info("oom_event", app=rec.app_id, device=rec.device_id, mem_used_mib=rec.mem_used_mib,
                              granted_mib=before[0])

    def _shrinks_first(self, targets: Sequence[GrantTarget]) -> list[GrantTarget]:
        """Carry out shrinking resizes before growing ones and new grants, so that what one
        application gives back in a plan is there for another to take. Growing resizes go
        smallest growth first (an SM point weighs as 1,000 MiB), then new grants; the sort is
        stable, so ties keep the plan's order. Where room runs out, the later ones are clamped."""

        def growth(t: GrantTarget) -> float:
            if t.grant_id is None:
                return math.inf
            try:
                g = self.ledger.get(t.grant_id)
            except DeviceError:
                return math.inf
            return max(t.memory_mib - g.memory_mib, 0.0) + max(t.sm_pct - g.sm_pct, 0.0) * 1e3

        return sorted(targets, key=growth)

    def _apply_power(self, device_id: str, limit_mw: int, reason: str) -> PowerLimitResult | None:
        dev = self._read_device(device_id)
        if dev is None:
            self.counters.failed(device_id, "power_limit")
            return None
        try:
            result = self.power.apply(dev, limit_mw)
        except (DeviceError, VerifyFailed) as exc:
            self.counters.failed(device_id, "power_limit")
            self._log.error("power_limit_failed", device=device_id, target_mw=limit_mw, error=str(exc))
            return None
        if result.reason.startswith("refused"):
            self.counters.failed(device_id, "power_limit")
        if result.planned:
            self.counters.power_limit_changes += 1
            self._publish(EventKind.POWER_LIMIT_CHANGED, device_id=device_id,
                          detail=f"{result.before_mw} -> {result.target_mw} mW"
                          + (" (dry run)" if result.dry_run else "") + (f": {reason}" if reason else ""))
        return result

    def _apply_mig(self, target: MigTarget) -> int:
        if self.mig is None:
            self._warn_once("mig:none", "mig_mechanism_missing", device=target.device_id)
            return 0
        dev = self._read_device(target.device_id)
        if dev is None:
            self.counters.failed(target.device_id, "mig")
            return 0
        try:
            outcome = self.mig.apply(dev, target.profiles)
        except (DeviceError, VerifyFailed) as exc:
            self.counters.failed(target.device_id, "mig")
            self._log.error("mig_failed", device=target.device_id, profiles=list(target.profiles), error=str(exc))
            return 0
        if outcome.failed_steps:
            self.counters.failed(target.device_id, "mig")
            self._log.warning("mig_incomplete", device=target.device_id, profiles=list(target.profiles),
                              failed_steps=outcome.failed_steps, reason=outcome.reason)
        if outcome.changed:
            self.counters.mig_changes += 1
            self._publish(EventKind.MIG_CHANGED, device_id=target.device_id, detail=",".join(target.profiles))
        return int(outcome.changed)

    def memory_enforcement(self, device_id: str) -> Enforcement:
        """Whether the device's memory limits are hard now: by the hard-limit rule
        (`limits_are_hard`) over its grants, or else because the policy's latest plan for it said
        so (a plan counts forecast needs that may be above the grants clamped to what fits). Pure
        bookkeeping: the caps follow at `_sync_cgroup_limits`. Made once per change of the ledger
        or of the plan's decision, however many events and syncs ask in between."""
        planned = self._plan_enforcement.get(device_id)
        made = self._enforcement_made.get(device_id)
        if made is not None:
            (ledger, revision, plan_said, at_frac), enf = made
            if (ledger is self.ledger and revision == self.ledger.revision and plan_said is planned
                    and at_frac == self.hard_limit_at_frac):
                return enf
        enf = self._judge_memory(device_id, planned)
        self._enforcement_made[device_id] = ((self.ledger, self.ledger.revision, planned, self.hard_limit_at_frac), enf)
        return enf

    def _judge_memory(self, device_id: str, planned: Enforcement | None) -> Enforcement:
        total = self.ledger.capacity(device_id).mem_total_mib
        if self.hard_limit_at_frac <= 0:
            return Enforcement(device_id, True, "hard wherever a pid is known (hard_limit_at_frac 0)")
        granted = self.ledger.usage(device_id).mem_granted_mib  # the ledger's running total, not a scan
        if limits_are_hard(granted, total, self.hard_limit_at_frac * total):
            return Enforcement(device_id, True, f"contended: {granted:.0f} of {total:.0f} MiB granted")
        if planned is not None:
            return planned
        return Enforcement(device_id, False, f"uncontended: {granted:.0f} of {total:.0f} MiB granted")

    def app_memory_limit(self, app_id: str, device_id: str | None = None) -> tuple[str, str]:
        """(kind, why) of how the application's memory grants are enforced. Caps are per device
        (`_sync_cgroup_limits`: on each GPU whose limits are hard, the cgroup of a process named by
        the application's grants there is capped at what it holds there), so each GPU it holds a
        grant on is judged on its own: "hard" when its cgroup holds our cap there now, else
        "cooperative" (`_device_memory_limit`). With `device_id`, that GPU's word; without, "hard" when any of its
        GPUs caps it (beyond its grant there it runs out of memory), else "cooperative", the reason
        naming each GPU when it holds grants on more than one. ("", "") without a grant (there)."""
        grants = self.ledger.grants(app_id=app_id, device_id=device_id or None)
        devices = sorted({g.device_id for g in grants})
        if not devices:
            return "", ""
        words = {d: self._device_memory_limit(d, [g for g in grants if g.device_id == d]) for d in devices}
        if len(words) == 1:
            return words[devices[0]]
        kind = "hard" if any(k == "hard" for k, _ in words.values()) else "cooperative"
        return kind, "; ".join(f"{k} on {d}: {why}" for d, (k, why) in words.items())

    def _device_memory_limit(self, device_id: str, grants: Sequence[Grant]) -> tuple[str, str]:
        """(kind, why) for an application's `grants` on one device: "hard" when a cgroup of a process
        they name holds a cap of ours on the device now (`CgroupMemoryLimits.capped`: written and
        read back), else "cooperative", whatever the device's decision; the reason says the
        decision and, where they differ, why the cap is not (or is still) there."""
        enf = self.memory_enforcement(device_id)
        lim = self.cgroup_limits
        if lim is not None and self._holds_cap(grants, lim.capped(device_id)):
            if enf.hard_mem:
                return "hard", enf.reason
            return "hard", f"{enf.reason}; its cgroup still holds our cap (its original is not written back yet)"
        if not enf.hard_mem:
            return "cooperative", enf.reason
        if lim is None:
            return "cooperative", f"{enf.reason}; cgroup memory limits are off (server.cgroup_memory_limits)"
        off = lim.disabled_reason(device_id)
        if off is not None:
            return "cooperative", f"{enf.reason}; cgroup memory limits unavailable: {off}"
        if not any(g.pid > 0 and self._cgroup_of(g.pid) is not None for g in grants):
            return "cooperative", f"{enf.reason}; no process (pid) with a readable cgroup to cap"
        if lim.dry_run:
            return "cooperative", f"{enf.reason}; dry run: the cap it would get is logged, not written"
        return "cooperative", f"{enf.reason}; no cap in place (writing it failed: cgroup_memory_limit_failed)"

    def _holds_cap(self, grants: Iterable[Grant], capped: set[str]) -> bool:
        """Whether a process named by `grants` runs in one of the `capped` cgroups."""
        return bool(capped) and any(g.pid > 0 and self._cgroup_of(g.pid) in capped for g in grants)

    def _event_memory_limit(self, app_id: str, device_id: str, grant: Grant | None) -> str:
        """An event's `mem_limit`: the application's kind on the event's device (`_device_memory_limit`;
        a grant just released still names its process); "" for an event of no application or device."""
        if not app_id or device_id not in self._device_ids():
            return ""
        grants = list(self.ledger.grants(app_id=app_id, device_id=device_id))
        if grant is not None and all(g.grant_id != grant.grant_id for g in grants):
            grants.append(grant)
        return self._device_memory_limit(device_id, grants)[0]

    def _note_enforcement(self, device_id: str) -> bool:
        """The device's hard/cooperative decision now; a change is logged (what each application is
        told follows the caps themselves: `_tell_cap_changes`)."""
        enf = self.memory_enforcement(device_id)
        before = self._enforced.get(device_id)
        self._enforced[device_id] = enf.hard_mem
        if before is not None and before != enf.hard_mem:
            self._log.info("memory_limits_hard" if enf.hard_mem else "memory_limits_cooperative",
                           device=device_id, reason=enf.reason)
        return enf.hard_mem

    def _sync_cgroup_limits(self, device_id: str) -> None:
        """On a device whose memory limits are hard (`memory_enforcement`), cap each cgroup at the
        memory granted to the applications whose process runs in it (an application's pid: from any
        of its grants there); put back the original limits of cgroups that no longer hold a grant,
        and of every cgroup of a device whose limits are cooperative. Failures are counted
        ("cgroup_memory") and logged; they never undo the grant. Each application with a grant
        there whose processes gained or lost a cap is told (LIMITS_CHANGED)."""
        hard = self._note_enforcement(device_id)
        lim = self.cgroup_limits
        if lim is None or self._stopped or lim.disabled_reason(device_id) is not None:
            return
        wanted = self._cgroup_memory(device_id) if hard else {}
        stale = lim.limited(device_id) - {cg for cg, mib in wanted.items() if mib > 0}
        if not wanted and not stale:
            return
        dev = self._read_device(device_id)
        if dev is None:
            return
        capped_before = lim.capped(device_id)
        self._cap_cgroups(lim, dev, device_id, wanted)
        self._uncap_cgroups(lim, device_id, stale)
        self._tell_cap_changes(device_id, capped_before, lim.capped(device_id))

    def _tell_cap_changes(self, device_id: str, before: set[str], after: set[str]) -> None:
        """A LIMITS_CHANGED to each application with a grant on the device whose kind there
        (`_device_memory_limit`) the caps' change from `before` to `after` turned."""
        if before == after or not self._subscriptions:
            return
        for app_id in sorted({g.app_id for g in self.ledger.grants(device_id=device_id)}):
            grants = self.ledger.grants(app_id=app_id, device_id=device_id)
            if self._holds_cap(grants, before) != self._holds_cap(grants, after):
                kind, why = self._device_memory_limit(device_id, grants)
                self._publish(EventKind.LIMITS_CHANGED, app_id=app_id, device_id=device_id,
                              detail=f"memory limit {kind}: {why}")

    def _cap_cgroups(self, lim: CgroupMemoryLimits, dev: Device, device_id: str, wanted: dict[str, float]) -> None:
        """Cap each cgroup with a grant (MiB > 0) at that memory on the device."""
        for cg, mib in sorted(wanted.items()):
            if mib <= 0:
                continue
            try:
                lim.apply(dev, cg, mib)
            except Exception as exc:  # noqa: BLE001 - the grant is stored: a device or store error here never fails it
                self.counters.failed(device_id, "cgroup_memory")
                self._log.error("cgroup_memory_limit_failed", device=device_id, cgroup=cg, hard_mib=mib, error=str(exc))

    def _uncap_cgroups(self, lim: CgroupMemoryLimits, device_id: str, stale: set[str]) -> None:
        """Write back the original limits of cgroups the device should no longer cap."""
        for cg in sorted(stale):
            try:
                outcome = lim.restore_one(device_id, cg)
            except Exception as exc:  # noqa: BLE001 - as in _cap_cgroups (the original could not be forgotten in the store)
                outcome = f"failed: {exc}"
                self._log.error("cgroup_memory_restore_failed", device=device_id, cgroup=cg, error=str(exc))
            if outcome.startswith("failed"):
                self.counters.failed(device_id, "cgroup_memory")

    def _cgroup_memory(self, device_id: str) -> dict[str, float]:
        """cgroup -> MiB granted on the device to the applications whose process runs in it."""
        # Only applications with a grant naming a pid here count: found through the ledger's index
        # of such grants, so the cost follows them, not every grant on the device.
        pids: dict[str, int] = {}
        for g in self.ledger.grants_with_pid(device_id):
            pids.setdefault(g.app_id, g.pid)
        wanted: dict[str, float] = {}
        for app_id, pid in pids.items():
            cg = self._cgroup_of(pid)
            if cg is not None:
                mib = sum(g.memory_mib for g in self.ledger.grants(app_id=app_id, device_id=device_id))
                wanted[cg] = wanted.get(cg, 0.0) + mib
        return wanted

    def reconcile_cgroup_limits(self) -> list[tuple[str, str, str]]:
        """At start-up, over a ledger restored after a crash: the cgroup originals the store holds
        are written back where no grant's application runs in the cgroup any more, and kept (to be
        restored later) where one does (`CgroupMemoryLimits.reconcile`). (device, cgroup, outcome)
        per record; failures count as "cgroup_memory". The caps themselves follow at each device's
        next grant, resize or release, as always."""
        lim = self.cgroup_limits
        if lim is None:
            return []
        devices = [c.device_id for c in self.ledger.devices()]
        in_use = {d: {cg for cg, mib in self._cgroup_memory(d).items() if mib > 0} for d in devices}
        outcomes = lim.reconcile(self.backend, in_use)
        for device_id, _cgroup, outcome in outcomes:
            if outcome.startswith("failed"):
                self.counters.failed(device_id, "cgroup_memory")
        return outcomes

    # --- shutdown --------------------------------------------------------------------------------
    def end_watches(self) -> None:
        """End every watch subscription and refuse new ones: a stopping daemon calls this first, so
        that its graceful stop does not wait `grace_s` for streams that never end by themselves."""
        self._watches_ended = True
        for sub in list(self._subscriptions):
            sub.close()

    def stop(self) -> list[PowerLimitResult]:
        """Restore device settings (power limits, MIG layouts) and end every watch subscription.
        Safe to call twice; the second call does nothing."""
        if self._stopped:
            return []
        self._stopped = True
        self._refusing = True
        results = self.power.restore()
        if self.cgroup_limits is not None:
            for device_id, _cgroup, outcome in self.cgroup_limits.restore():
                if outcome.startswith("failed"):  # logged by the mechanism
                    self.counters.failed(device_id, "cgroup_memory")
        if self.mig is not None:
            try:
                self.mig.restore()
            except DeviceError as exc:
                self._log.error("mig_restore_failed", error=str(exc))
        for r in results:
            if r.changed:
                self._publish(EventKind.POWER_LIMIT_CHANGED, device_id=r.device_id,
                              detail=f"restored {r.before_mw} -> {r.after_mw} mW")
        for sub in list(self._subscriptions):
            sub.close()
        return results


def _rules_text(why: PlanReason | None) -> str:
    """" (memory: ramp, SM: forecast)": the plan's rules for a resize, "" without them."""
    return "" if why is None else f" (memory: {why.mem_rule}, SM: {why.sm_rule})"



def _sm_estimated(request: AllocationRequest, source: str) -> bool:
    """Whether a grant's SM share is the cold-start sizer's estimate: a declared job whose request
    named no SM share of its own."""
    return source == "cold_start" and request.sm_pct <= 0

def _resize_text(old: Grant, new: Grant) -> str:
    """What a resize changed, each resource with its unit: "memory 4096 -> 2048 MiB", "SM 40 -> 23 %",
    or both; a resize that changed neither reads as the memory it keeps."""
    parts = []
    if new.memory_mib != old.memory_mib or new.sm_pct == old.sm_pct:
        parts.append(f"memory {old.memory_mib:.0f} -> {new.memory_mib:.0f} MiB")
    if new.sm_pct != old.sm_pct:
        # a tenth of a point is all anyone reads (a plan's shares come out as 85.8079)
        parts.append(f"SM {round(old.sm_pct, 1):g} -> {round(new.sm_pct, 1):g} %")
    return ", ".join(parts)



def _try(fn: Callable[[], T]) -> T | None:
    """fn(), or None when the device cannot answer (reads degrade)."""
    try:
        return fn()
    except DeviceError:
        return None


def _read_mig(dev: Device) -> tuple[bool, tuple[GpuInstance, ...]]:
    """(MIG mode on, its GPU instances); off and none when the device does not support MIG. Any
    other DeviceError propagates."""
    try:
        mig_enabled = dev.mig_enabled()
        return mig_enabled, tuple(dev.gpu_instances()) if mig_enabled else ()
    except NotSupported:
        return False, ()


def _limits_text(limits: AppLimits) -> str:
    parts = []
    if limits.max_memory_mib is not None:
        parts.append(f"max {limits.max_memory_mib:g} MiB")
    if limits.max_sm_pct is not None:
        parts.append(f"max {limits.max_sm_pct:g} % SM")
    if limits.priority is not None:
        parts.append(f"priority {limits.priority}")
    return ", ".join(parts) or "no limits"


__all__ = [
    "Allocated",
    "AllocationEvent",
    "AllocationRequest",
    "Allocator",
    "AppInfo",
    "ApplyReport",
    "Counters",
    "DeviceResources",
    "EventKind",
    "MigMechanism",
    "MigOutcome",
    "Sizer",
    "Sizing",
    "Subscription",
    "device_capacities",
    "job_digest",
    "job_text",
]


def _sized_refusal(refused: InsufficientResources, job: JobConfig, sized_mib: float,
                   memory_mib: float) -> InsufficientResources:
    """A refusal of a cold-start grant in the application's terms: its job and the size the sizer
    gave it (the figure the ledger's refusal starts with, which the application never asked for),
    then the ledger's reason."""
    said = f"the job ({job_text(job)}) was sized at {sized_mib:,.0f} MiB (peak + margin)"
    text = str(refused)
    lead = f"{memory_mib:g} MiB does not fit"
    if memory_mib == sized_mib and text.startswith(lead):
        text = text[len(lead) - len("does not fit"):]
    return InsufficientResources(f"{said}: {text}")


def _process_start(pid: int) -> float | None:
    """When process `pid` started (Unix seconds), or None when there is no such process here."""
    import psutil  # the daemon's dependency; imported here so the pure logic does not need it

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError, OverflowError):
        return None
