"""The ledger of grants: who holds how much memory and SM share on which device.

Pure bookkeeping, no I/O and no device calls: the allocator consults it before acting. The daemon
stores each change's rows (`changes()`, then `commit_changes()`; the allocator calls
`rollback_changes()` when that store fails), writes the whole reconciled ledger (`to_records()`)
once at start-up, and reads a stored ledger back with `from_records()`.

Admission control: a grant or a growth that does not fit (memory beyond the device's total minus
what is already granted, SM share beyond 100 %, an application beyond its limits) raises
`InsufficientResources` and leaves the ledger exactly as it was. Every mutating method takes an
optional `caller`: None means a trusted caller (the manager, an operator); an application identity
may only act on its own grants (`PermissionDenied` otherwise).

Cost: the grants are indexed by application and by device, and each device's and application's
granted totals are kept as they change (exact sums, so a grant given back leaves a total exactly as
it was), so a request, a resize or a release costs the same with 10 grants held or 4,000. The exact
sums are integers counting units of 2**-1074 (the smallest step between two floats, so every float
is a whole number of them): the same values `Fraction` sums would hold, read back as the same
correctly rounded floats, at a fraction of the cost.

Not thread-safe: one owner (the daemon's asyncio loop) calls it.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from vgpu.allocator.errors import (
    InsufficientResources,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
)
from vgpu.ids import MAX_PID

Source = Literal["request", "forecast", "cold_start"]
SOURCES: tuple[str, ...] = ("request", "forecast", "cold_start")
RECORDS_VERSION = 1
# A priority travels as a protobuf int32: a stored one beyond it would fail every reply naming its grant.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
# The most memory one stored grant may hold (1 EiB, beyond any device): a device's exact total of
# grants stays a finite float however many are stored, where two grants of 1e308 MiB would overflow it.
MAX_STORED_GRANT_MIB = float(2**40)
# Tolerance for float sums: 1e-6 MiB and 1e-6 percentage points.
_EPS = 1e-6
# Exact totals count units of 2**-1074, the smallest positive float: every finite float is a whole
# number of them, so sums of grants are kept exactly as integers.
_ULP_DENOMINATOR = 2**1074
# A Unix uid is a 32-bit unsigned number.
_MAX_UID = 2**32 - 1


def _exact(value: float) -> int:
    """`value` (finite) as a whole number of 2**-1074 units, exactly."""
    num, den = value.as_integer_ratio()  # den is a power of two, at most 2**1074
    return num * (_ULP_DENOMINATOR // den)


def _float(units: int) -> float:
    """The float nearest to `units` x 2**-1074 (int / int rounds correctly, as `float(Fraction)` does)."""
    return units / _ULP_DENOMINATOR


@dataclass(frozen=True)
class DeviceCapacity:
    """What one device offers to grants."""

    device_id: str
    mem_total_mib: float
    sm_total_pct: float = 100.0
    name: str = ""


@dataclass(frozen=True)
class Grant:
    grant_id: str
    app_id: str
    device_id: str
    memory_mib: float
    sm_pct: float
    priority: int
    created_at_s: float
    updated_at_s: float
    source: str = "request"
    pid: int = 0
    # when memory_mib last changed (None: never since created); updated_at_s covers any change
    mem_updated_at_s: float | None = None
    # the cold-start sizer's size for the job this grant was made for (None: not sized), kept with the
    # grant so that the policy still knows it after a restart
    cold_start_mib: float | None = None
    # its SM share is the cold-start sizer's estimate for the job (or the policy's share it took
    # over), not a share the application asked for: room another request may take while the
    # application's use is not known yet
    sm_estimated: bool = False
    # the Unix uid whose share of the node's grants this grant takes (`Ledger.max_grants_per_uid`):
    # the caller's, over the Unix socket; None: counted against no uid (the operator's token, uid 0,
    # the policy's own grants, a caller whose uid is unknown)
    uid: int | None = None
    # a cold-start grant's job, as a digest of its fields (`vgpu.allocator.core.job_digest`): a
    # request of the same process declaring the same job again is answered with this grant
    # instead of a second one (None: not sized for a job, or made before this was kept)
    job_digest: str | None = None

    @property
    def mem_changed_at_s(self) -> float:
        """When the memory size was last set (creation, or the last resize that changed it)."""
        return self.created_at_s if self.mem_updated_at_s is None else self.mem_updated_at_s


@dataclass(frozen=True)
class AppLimits:
    """An application's caps over all its grants; None: no cap (priority None: unchanged / default)."""

    app_id: str
    max_memory_mib: float | None = None
    max_sm_pct: float | None = None
    priority: int | None = None


@dataclass(frozen=True)
class LedgerChanges:
    """What changed since the last `commit_changes()`: the rows a store writes for it."""

    grants: tuple[Grant, ...] = ()
    grants_removed: tuple[str, ...] = ()
    limits: tuple[AppLimits, ...] = ()
    limits_removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.grants or self.grants_removed or self.limits or self.limits_removed)


@dataclass(frozen=True)
class DeviceUsage:
    device_id: str
    name: str
    mem_total_mib: float
    mem_granted_mib: float
    mem_available_mib: float
    sm_granted_pct: float
    sm_available_pct: float


def _check_app_id(app_id: str) -> None:
    if not isinstance(app_id, str) or not app_id.strip():
        raise InvalidRequest("app_id is empty: give the application's identifier")


def _finite(value: float) -> bool:
    """A finite number, where an int too large for a float (a stored 10**400) is not finite either."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_amount(name: str, value: float, *, upper: float | None = None) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    if not _finite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    if value < 0:
        raise InvalidRequest(f"{name} must be >= 0, got {value}")
    if upper is not None and value > upper:
        raise InvalidRequest(f"{name} must be <= {upper:g}, got {value}")


class Ledger:
    """Grants per application and device, with admission control."""

    def __init__(
        self,
        devices: Iterable[DeviceCapacity],
        *,
        clock: Callable[[], float] = time.time,
        id_factory: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._clock = clock
        self._new_id = id_factory
        self._devices: dict[str, DeviceCapacity] = {}
        for cap in devices:
            if cap.device_id in self._devices:
                raise ValueError(f"device {cap.device_id!r} listed twice")
            self._devices[cap.device_id] = cap
        # Every grant, in creation order, and the same grants by application, by device and (those
        # naming a process) by device again; each index keeps the order of `_grants`. Only `_put`
        # and `_drop` change them.
        self._grants: dict[str, Grant] = {}
        self._by_app: dict[str, dict[str, Grant]] = {}
        self._by_device: dict[str, dict[str, Grant]] = {d: {} for d in self._devices}
        self._with_pid: dict[str, dict[str, Grant]] = {d: {} for d in self._devices}
        # How many grants count against each uid (`Grant.uid`).
        self._by_uid: dict[int, int] = {}
        # (memory MiB, SM %) granted per device and per application, as exact sums of the grants'
        # floats (`_exact` units).
        self._device_total: dict[str, tuple[int, int]] = {}
        self._app_total_exact: dict[str, tuple[int, int]] = {}
        self._limits: dict[str, AppLimits] = {}
        # Bumped by every change to the grants (`_put`, `_drop`: undone ones too), so that what a
        # reader derives from them (the allocator's hard/cooperative decision) is known to hold
        # while it stays the same.
        self.revision = 0
        # The change journal: each grant / limits touched since the last commit_changes(), with
        # what it was before (None: it did not exist). O(changes), so persisting costs O(1) rows.
        self._grants_before: dict[str, Grant | None] = {}
        self._limits_before: dict[str, AppLimits | None] = {}
        # Per-application, per-uid and per-node caps on the number of grants (None: no cap).
        self.max_grants_per_app: int | None = None
        self.max_grants_per_uid: int | None = None
        self.max_grants: int | None = None
        # Grants from_records() could not place (their device is gone); kept for the caller to report.
        self.dropped_on_restore: tuple[Grant, ...] = ()
        # Records from_records(skip_bad=True) could not read, each with why.
        self.bad_on_restore: tuple[str, ...] = ()

    # --- the indices ----------------------------------------------------------------------------
    def _put(self, grant: Grant) -> None:
        """Add a grant, or replace the one with its id (keeping its place in every index)."""
        self.revision += 1
        old = self._grants.get(grant.grant_id)
        self._drop_totals(old)
        if old is None or old.uid != grant.uid:  # a resize (most puts, in every plan) keeps the uid
            self._count_uid(old, -1)
            self._count_uid(grant, 1)
        self._grants[grant.grant_id] = grant
        self._by_app.setdefault(grant.app_id, {})[grant.grant_id] = grant
        self._by_device.setdefault(grant.device_id, {})[grant.grant_id] = grant
        with_pid = self._with_pid.setdefault(grant.device_id, {})
        if grant.pid > 0:
            with_pid[grant.grant_id] = grant
        else:
            with_pid.pop(grant.grant_id, None)
        self._add_totals(grant, 1)

    def _drop(self, grant_id: str) -> Grant | None:
        grant = self._grants.pop(grant_id, None)
        if grant is None:
            return None
        self.revision += 1
        self._drop_totals(grant)
        self._count_uid(grant, -1)
        mine = self._by_app[grant.app_id]
        del mine[grant_id]
        if not mine:  # the application's last grant
            del self._by_app[grant.app_id]
            del self._app_total_exact[grant.app_id]
        del self._by_device[grant.device_id][grant_id]
        self._with_pid[grant.device_id].pop(grant_id, None)
        return grant

    def _drop_totals(self, grant: Grant | None) -> None:
        if grant is not None:
            self._add_totals(grant, -1)

    def _count_uid(self, grant: Grant | None, sign: int) -> None:
        if grant is None or grant.uid is None:
            return
        held = self._by_uid.get(grant.uid, 0) + sign
        if held:
            self._by_uid[grant.uid] = held
        else:
            del self._by_uid[grant.uid]

    def _add_totals(self, grant: Grant, sign: int) -> None:
        mem, sm = _exact(grant.memory_mib) * sign, _exact(grant.sm_pct) * sign
        for totals, key in ((self._device_total, grant.device_id), (self._app_total_exact, grant.app_id)):
            old_mem, old_sm = totals.get(key, (0, 0))
            totals[key] = (old_mem + mem, old_sm + sm)

    # --- the change journal ----------------------------------------------------------------------
    def _touch_grant(self, grant_id: str) -> None:
        if grant_id not in self._grants_before:
            self._grants_before[grant_id] = self._grants.get(grant_id)

    def _touch_limits(self, app_id: str) -> None:
        if app_id not in self._limits_before:
            self._limits_before[app_id] = self._limits.get(app_id)

    def changes(self) -> LedgerChanges:
        """What changed since the last `commit_changes()` (or since this ledger was built)."""
        grants = tuple(self._grants[g] for g in self._grants_before if g in self._grants)
        gone = tuple(g for g in self._grants_before if g not in self._grants)
        limits = tuple(self._limits[a] for a in self._limits_before if a in self._limits)
        limits_gone = tuple(a for a in self._limits_before if a not in self._limits)
        return LedgerChanges(grants, gone, limits, limits_gone)

    def commit_changes(self) -> None:
        """The changes so far are stored: forget them."""
        self._grants_before.clear()
        self._limits_before.clear()

    def rollback_changes(self) -> None:
        """Put back every grant and limit as it was at the last `commit_changes()` (a change that
        could not be stored must not stay in memory)."""
        for grant_id, before in self._grants_before.items():
            if before is None:
                self._drop(grant_id)
            else:
                self._put(before)
        for app_id, lim in self._limits_before.items():
            if lim is None:
                self._limits.pop(app_id, None)
            else:
                self._limits[app_id] = lim
        self.commit_changes()

    # --- reads ---------------------------------------------------------------------------------
    def devices(self) -> list[DeviceCapacity]:
        return list(self._devices.values())

    def capacity(self, device_id: str) -> DeviceCapacity:
        try:
            return self._devices[device_id]
        except KeyError:
            raise NotFound(f"no device {device_id!r} in the ledger (known: {sorted(self._devices)})") from None

    def get(self, grant_id: str) -> Grant:
        try:
            return self._grants[grant_id]
        except KeyError:
            raise NotFound(f"no grant {grant_id!r}") from None

    def grants(self, *, app_id: str | None = None, device_id: str | None = None) -> list[Grant]:
        """Grants in creation order, optionally only one application's or one device's."""
        if app_id is not None:
            mine = self._by_app.get(app_id, {})
            return [g for g in mine.values() if device_id is None or g.device_id == device_id]
        if device_id is not None:
            return list(self._by_device.get(device_id, {}).values())
        return list(self._grants.values())

    def grants_with_pid(self, device_id: str) -> list[Grant]:
        """The device's grants that name a process (pid > 0), in creation order."""
        return list(self._with_pid.get(device_id, {}).values())

    def grant_count(self, app_id: str | None = None) -> int:
        """Grants held on the node, or by one application."""
        return len(self._grants) if app_id is None else len(self._by_app.get(app_id, {}))

    def uid_grant_count(self, uid: int) -> int:
        """Grants that count against a uid's share (`Grant.uid`)."""
        return self._by_uid.get(uid, 0)

    def apps(self) -> list[str]:
        """Applications with a grant or limits, sorted."""
        return sorted(set(self._by_app) | set(self._limits))

    def limits(self, app_id: str) -> AppLimits | None:
        return self._limits.get(app_id)

    def usage(self, device_id: str) -> DeviceUsage:
        cap = self.capacity(device_id)
        mem, sm = self._granted(device_id)
        return DeviceUsage(
            device_id=device_id,
            name=cap.name,
            mem_total_mib=cap.mem_total_mib,
            mem_granted_mib=mem,
            mem_available_mib=max(0.0, cap.mem_total_mib - mem),
            sm_granted_pct=sm,
            sm_available_pct=max(0.0, cap.sm_total_pct - sm),
        )

    def headroom(self, app_id: str, device_id: str, *, excluding: str | None = None) -> tuple[float, float]:
        """(memory MiB, SM %) this application could hold in one more grant on the device, counting
        the grant `excluding` as already given back (for a resize)."""
        cap = self.capacity(device_id)
        mem_dev, sm_dev = self._granted(device_id, excluding=excluding)
        mem = cap.mem_total_mib - mem_dev
        sm = cap.sm_total_pct - sm_dev
        lim = self._limits.get(app_id)
        if lim is not None:
            mem_app, sm_app = self._app_total(app_id, excluding=excluding)
            if lim.max_memory_mib is not None:
                mem = min(mem, lim.max_memory_mib - mem_app)
            if lim.max_sm_pct is not None:
                sm = min(sm, lim.max_sm_pct - sm_app)
        return max(0.0, mem), max(0.0, sm)

    def _granted(self, device_id: str, *, excluding: str | None = None) -> tuple[float, float]:
        mem, sm = self._device_total.get(device_id, (0, 0))
        return self._less(mem, sm, excluding, lambda g: g.device_id == device_id)

    def _app_total(self, app_id: str, *, excluding: str | None = None) -> tuple[float, float]:
        mem, sm = self._app_total_exact.get(app_id, (0, 0))
        return self._less(mem, sm, excluding, lambda g: g.app_id == app_id)

    def _less(self, mem: int, sm: int, excluding: str | None,
              counted: Callable[[Grant], bool]) -> tuple[float, float]:
        """An exact total as floats, less the grant `excluding` when that grant is part of it."""
        ex = self._grants.get(excluding) if excluding is not None else None
        if ex is not None and counted(ex):
            mem, sm = mem - _exact(ex.memory_mib), sm - _exact(ex.sm_pct)
        return _float(mem), _float(sm)

    def _check_fits(
        self, app_id: str, device_id: str, memory_mib: float, sm_pct: float, *, excluding: str | None = None
    ) -> None:
        cap = self.capacity(device_id)
        mem_dev, sm_dev = self._granted(device_id, excluding=excluding)
        if memory_mib > cap.mem_total_mib - mem_dev + _EPS:
            raise InsufficientResources(
                f"{memory_mib:g} MiB does not fit on {device_id}: {cap.mem_total_mib - mem_dev:g} of "
                f"{cap.mem_total_mib:g} MiB are free (not granted to any application)"
            )
        if sm_pct > cap.sm_total_pct - sm_dev + _EPS:
            raise InsufficientResources(
                f"{sm_pct:g} % SM does not fit on {device_id}: {cap.sm_total_pct - sm_dev:g} % SM is free "
                "(not granted to any application)"
            )
        self._check_limits(app_id, memory_mib, sm_pct, excluding=excluding)

    def check_admissible(self, app_id: str, memory_mib: float, sm_pct: float, *, uid: int | None = None) -> None:
        """Whether one more grant of this size is within the node's, the uid's and the
        application's grant quotas and the application's limits, whatever the devices hold
        (InsufficientResources if not): what no room made on a device can change."""
        self._check_quota(app_id, uid)
        self._check_limits(app_id, memory_mib, sm_pct)

    def _check_limits(self, app_id: str, memory_mib: float, sm_pct: float, *, excluding: str | None = None) -> None:
        lim = self._limits.get(app_id)
        if lim is not None:
            mem_app, sm_app = self._app_total(app_id, excluding=excluding)
            if lim.max_memory_mib is not None and mem_app + memory_mib > lim.max_memory_mib + _EPS:
                raise InsufficientResources(
                    f"{app_id} would hold {mem_app + memory_mib:g} MiB, over its limit of {lim.max_memory_mib:g} MiB"
                )
            if lim.max_sm_pct is not None and sm_app + sm_pct > lim.max_sm_pct + _EPS:
                raise InsufficientResources(
                    f"{app_id} would hold {sm_app + sm_pct:g} % SM, over its limit of {lim.max_sm_pct:g} %"
                )

    @staticmethod
    def _check_caller(caller: str | None, app_id: str, what: str) -> None:
        if caller is not None and caller != app_id:
            raise PermissionDenied(f"{caller!r} may not {what} of application {app_id!r}")

    # --- writes --------------------------------------------------------------------------------
    def place(self, memory_mib: float, sm_pct: float, app_id: str) -> str:
        """The device a request without a device should go to: the one with the most memory left
        among those where it fits; InsufficientResources if it fits nowhere."""
        best: tuple[float, str] | None = None
        for device_id in self._devices:
            mem, sm = self.headroom(app_id, device_id)
            if memory_mib <= mem + _EPS and sm_pct <= sm + _EPS and (best is None or mem > best[0]):
                best = (mem, device_id)
        if best is None:
            if not self._devices:
                raise InsufficientResources("no device is known to the allocator")
            self._check_fits(app_id, next(iter(self._devices)), memory_mib, sm_pct)  # raises with detail
            raise InsufficientResources(f"{memory_mib:g} MiB / {sm_pct:g} % SM fits on no device")
        return best[1]

    def grant(
        self,
        app_id: str,
        memory_mib: float,
        sm_pct: float = 0.0,
        *,
        device_id: str | None = None,
        priority: int | None = None,
        source: str = "request",
        pid: int = 0,
        caller: str | None = None,
        cold_start_mib: float | None = None,
        sm_estimated: bool = False,
        uid: int | None = None,
        job_digest: str | None = None,
    ) -> Grant:
        """A new grant, or InsufficientResources (and nothing changes). `cold_start_mib`: the
        sizer's size for the job, kept with the grant; `sm_estimated`: its SM share is an estimate,
        not asked for (`Grant.sm_estimated`); `uid`: the uid whose share it takes (`Grant.uid`);
        `job_digest`: the job it was sized for (`Grant.job_digest`).
        `priority` is the application's own; an operator's priority for the application
        (`set_limits`) overrides it."""
        _check_app_id(app_id)
        _check_amount("memory_mib", memory_mib)
        _check_amount("sm_pct", sm_pct, upper=100.0)
        if source not in SOURCES:
            raise InvalidRequest(f"source must be one of {SOURCES}, got {source!r}")
        if cold_start_mib is not None:
            _check_cold_start(cold_start_mib)
        if job_digest is not None:
            _check_job_digest(job_digest)
        self._check_caller(caller, app_id, "request resources on behalf")
        self._check_quota(app_id, uid)
        if device_id is None or device_id == "":
            device_id = self.place(memory_mib, sm_pct, app_id)
        self._check_fits(app_id, device_id, memory_mib, sm_pct)
        lim = self._limits.get(app_id)
        if lim is not None and lim.priority is not None:
            # The operator's priority (set-limit) says which application yields first: it overrides
            # whatever the application asks for itself.
            priority = lim.priority
        elif priority is None:
            priority = 0
        now = self._clock()
        grant = Grant(
            grant_id=self._new_id(),
            app_id=app_id,
            device_id=device_id,
            memory_mib=float(memory_mib),
            sm_pct=float(sm_pct),
            priority=int(priority),
            created_at_s=now,
            updated_at_s=now,
            source=source,
            pid=int(pid),
            cold_start_mib=None if cold_start_mib is None else float(cold_start_mib),
            sm_estimated=bool(sm_estimated),
            uid=uid,
            job_digest=job_digest,
        )
        self._touch_grant(grant.grant_id)
        self._put(grant)
        return grant

    def _check_quota(self, app_id: str, uid: int | None = None) -> None:
        # Every grant counts, one of 0 MiB too: it costs a stored row, a watch event and an entry in
        # every listing as any other does.
        if self.max_grants is not None and len(self._grants) >= self.max_grants:
            raise QuotaExceeded(
                f"quota: this node holds {len(self._grants)} grants, its limit (max_grants_per_node = "
                f"{self.max_grants}); release some first", quota="max_grants_per_node"
            )
        if uid is not None and self.max_grants_per_uid is not None:
            held = self.uid_grant_count(uid)
            if held >= self.max_grants_per_uid:
                raise QuotaExceeded(
                    f"quota: uid {uid} holds {held} grants on this node, its share (server.max_grants_per_uid = "
                    f"{self.max_grants_per_uid}); release some first", quota="max_grants_per_uid"
                )
        if self.max_grants_per_app is not None:
            held = self.grant_count(app_id)
            if held >= self.max_grants_per_app:
                raise QuotaExceeded(
                    f"quota: application {app_id!r} holds {held} grants, its limit (max_grants_per_app = "
                    f"{self.max_grants_per_app}); release some first", quota="max_grants_per_app"
                )

    def release(self, grant_id: str, *, caller: str | None = None) -> Grant:
        """Remove a grant and return it; NotFound for an unknown id (nothing changes)."""
        grant = self.get(grant_id)
        self._check_caller(caller, grant.app_id, "release the grants")
        self._touch_grant(grant_id)
        self._drop(grant_id)
        return grant

    def resize(
        self,
        grant_id: str,
        memory_mib: float,
        sm_pct: float,
        *,
        source: str | None = None,
        clamp: bool = False,
        caller: str | None = None,
    ) -> Grant:
        """Change a grant's size. Without `clamp`, a size that does not fit raises
        InsufficientResources and nothing changes; with `clamp`, growth is cut to what fits."""
        grant = self.get(grant_id)
        _check_amount("memory_mib", memory_mib)
        _check_amount("sm_pct", sm_pct, upper=100.0)
        if source is not None and source not in SOURCES:
            raise InvalidRequest(f"source must be one of {SOURCES}, got {source!r}")
        self._check_caller(caller, grant.app_id, "resize the grants")
        if clamp:
            mem_room, sm_room = self.headroom(grant.app_id, grant.device_id, excluding=grant_id)
            # Never cut below what the grant already holds: clamping only limits growth.
            memory_mib = min(memory_mib, max(mem_room, grant.memory_mib))
            sm_pct = min(sm_pct, max(sm_room, grant.sm_pct))
        else:
            self._check_fits(grant.app_id, grant.device_id, memory_mib, sm_pct, excluding=grant_id)
        now = self._clock()
        memory_mib, sm_pct = float(memory_mib), float(sm_pct)
        # every field named (not `dataclasses.replace`, which finds them by introspection on each
        # call): an apply resizes most of a device's grants
        new = Grant(
            grant_id=grant.grant_id,
            app_id=grant.app_id,
            device_id=grant.device_id,
            memory_mib=memory_mib,
            sm_pct=sm_pct,
            priority=grant.priority,
            created_at_s=grant.created_at_s,
            updated_at_s=now,
            source=source if source is not None else grant.source,
            pid=grant.pid,
            mem_updated_at_s=now if memory_mib != grant.memory_mib else grant.mem_updated_at_s,
            cold_start_mib=grant.cold_start_mib,
            sm_estimated=grant.sm_estimated,
            uid=grant.uid,
            job_digest=grant.job_digest,
        )
        self._touch_grant(grant_id)
        self._put(new)
        return new

    def set_limits(self, limits: AppLimits, *, caller: str | None = None) -> AppLimits:
        """Set an application's caps (operators only: an application identity is refused).

        Limits below what the application already holds are accepted and stop further growth; the
        grants over them stay as they are here (`Allocator.set_limits` cuts them down at once). A
        priority is given to the grants the application holds as well as to those to come (over the
        priority the application asks for)."""
        _check_app_id(limits.app_id)
        if caller is not None:
            raise PermissionDenied(f"{caller!r} may not set limits; only an operator may")
        if limits.max_memory_mib is not None:
            _check_amount("max_memory_mib", limits.max_memory_mib)
        if limits.max_sm_pct is not None:
            _check_amount("max_sm_pct", limits.max_sm_pct, upper=100.0)
        old = self._limits.get(limits.app_id)
        if limits.priority is None and old is not None and old.priority is not None:
            limits = replace(limits, priority=old.priority)
        self._touch_limits(limits.app_id)
        self._limits[limits.app_id] = limits
        if limits.priority is not None:
            # the grants held already take the operator's priority too: the policy reads it there
            for g in list(self._by_app.get(limits.app_id, {}).values()):
                if g.priority != limits.priority:
                    self._touch_grant(g.grant_id)
                    self._put(replace(g, priority=limits.priority))
        return limits

    # --- persistence -----------------------------------------------------------------------------
    def to_records(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot of devices, grants and limits."""
        return {
            "version": RECORDS_VERSION,
            "devices": [asdict(d) for d in self._devices.values()],
            "grants": [asdict(g) for g in self._grants.values()],
            "limits": [asdict(lim) for lim in self._limits.values()],
        }

    @classmethod
    def from_records(
        cls,
        records: Mapping[str, Any],
        *,
        devices: Sequence[DeviceCapacity] | None = None,
        clock: Callable[[], float] = time.time,
        id_factory: Callable[[], str] = lambda: uuid.uuid4().hex,
        skip_bad: bool = False,
    ) -> Ledger:
        """Rebuild a ledger from `to_records()`. With `devices` (what the backend has now), grants on
        devices that are gone are dropped and listed in `dropped_on_restore`. A malformed snapshot
        raises ValueError naming the bad entry; with `skip_bad`, a malformed grant or limits entry
        is left out instead and described in `bad_on_restore` (one bad record never stops a start)."""
        if records.get("version") != RECORDS_VERSION:
            raise ValueError(f"ledger records version {records.get('version')!r}, expected {RECORDS_VERSION}")
        bad: list[str] = []
        try:
            caps = list(devices) if devices is not None else [DeviceCapacity(**d) for d in records["devices"]]
            raw_grants = list(records["grants"])
            raw_limits = list(records.get("limits", []))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed ledger records: {exc}") from exc
        grants = _grants_from_records(raw_grants, skip_bad, bad)
        limits = _limits_from_records(raw_limits, skip_bad, bad)
        ledger = cls(caps, clock=clock, id_factory=id_factory)
        dropped: list[Grant] = []
        for g in grants:
            if g.device_id not in ledger._devices:
                dropped.append(g)
                continue
            if g.grant_id in ledger._grants:
                if not skip_bad:
                    raise ValueError(f"grant {g.grant_id!r} appears twice in the records")
                bad.append(f"grant {g.grant_id}: appears twice")
                continue
            ledger._put(g)
        for lim in limits:
            ledger._limits[lim.app_id] = lim
        ledger.dropped_on_restore = tuple(dropped)
        ledger.bad_on_restore = tuple(bad)
        return ledger


def _grants_from_records(raw_grants: Iterable[Any], skip_bad: bool, bad: list[str]) -> list[Grant]:
    """The stored grants, each checked (`_grant_from_record`). A malformed one raises ValueError, or
    with `skip_bad` is left out and described in `bad`; a bad cold-start size or job digest alone is
    dropped and its grant kept, as is a grant whose `sm_estimated` is not a boolean (kept as not
    estimated)."""
    grants: list[Grant] = []
    for g in raw_grants:
        try:
            grant = _grant_from_record(g)
        except (KeyError, TypeError, ValueError, InvalidRequest) as exc:
            if not skip_bad:
                raise ValueError(f"malformed ledger records: {exc}") from exc
            bad.append(f"grant {_record_id(g, 'grant_id')}: {_said(exc)}")
            continue
        try:
            if grant.cold_start_mib is not None:
                _check_cold_start(grant.cold_start_mib)
        except InvalidRequest as exc:  # the grant stands; only the size it was sized at is lost
            if not skip_bad:
                raise ValueError(f"malformed ledger records: {exc}") from exc
            bad.append(f"grant {_record_id(g, 'grant_id')}: {_said(exc)}; kept without it")
            grant = replace(grant, cold_start_mib=None)
        if not isinstance(grant.sm_estimated, bool):  # the grant stands, its whole SM share a commitment
            why = _said(ValueError(f"sm_estimated is {grant.sm_estimated!r}, not true or false"))
            if not skip_bad:
                raise ValueError(f"malformed ledger records: {why}")
            bad.append(f"grant {_record_id(g, 'grant_id')}: {why}; kept as not estimated")
            grant = replace(grant, sm_estimated=False)
        try:
            if grant.job_digest is not None:
                _check_job_digest(grant.job_digest)
        except InvalidRequest as exc:  # the grant stands; a later declaration of its job gets a new one
            if not skip_bad:
                raise ValueError(f"malformed ledger records: {exc}") from exc
            bad.append(f"grant {_record_id(g, 'grant_id')}: {_said(exc)}; kept without it")
            grant = replace(grant, job_digest=None)
        grants.append(grant)
    return grants


def _limits_from_records(raw_limits: Iterable[Any], skip_bad: bool, bad: list[str]) -> list[AppLimits]:
    """The stored limits entries, each checked as `set_limits` checks a new one (`_limits_from_record`).
    A malformed one raises ValueError, or with `skip_bad` is left out and described in `bad`: the
    application is then uncapped, as before its operator set the limits, and the operator is told."""
    limits: list[AppLimits] = []
    for lim in raw_limits:
        try:
            limits.append(_limits_from_record(lim))
        except (TypeError, ValueError, InvalidRequest) as exc:
            if not skip_bad:
                raise ValueError(f"malformed ledger records: {exc}") from exc
            bad.append(f"limits {_record_id(lim, 'app_id')}: {_said(exc)}")
    return limits


def _limits_from_record(lim: Mapping[str, Any]) -> AppLimits:
    """A stored limits entry, its fields checked: a non-empty app id, caps that are finite numbers
    >= 0 (SM at most 100 %) or none, a priority that is an integer or none. A cap that is not a
    number would stop every later request of the application with a TypeError; a priority beyond
    int32 fails every reply that carries it."""
    limits = AppLimits(**lim)
    if not isinstance(limits.app_id, str) or not limits.app_id.strip():
        raise ValueError(f"app_id is {limits.app_id!r}, not a non-empty string")
    if limits.max_memory_mib is not None:
        _check_amount("max_memory_mib", limits.max_memory_mib)
    if limits.max_sm_pct is not None:
        _check_amount("max_sm_pct", limits.max_sm_pct, upper=100.0)
    if limits.priority is not None:
        _check_priority(limits.priority)
    return limits


def _check_cold_start(mib: object) -> None:
    """A cold-start size: a finite number of MiB above 0."""
    if not isinstance(mib, int | float) or isinstance(mib, bool) or not _finite(mib) or mib <= 0:
        raise InvalidRequest(f"cold_start_mib must be a finite number of MiB > 0, got {mib!r}")


def _check_job_digest(digest: object) -> None:
    """A job digest: SHA-256 as 64 lowercase hex digits."""
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise InvalidRequest(f"job_digest must be 64 lowercase hex digits (SHA-256), got {str(digest)[:80]!r}")


def _said(exc: Exception) -> str:
    """An error about a stored value, at most 300 characters: the value may be megabytes."""
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + f"... ({len(text)} characters)"


def _record_id(record: object, key: str) -> str:
    value = record.get(key) if isinstance(record, Mapping) else None
    return repr(value)[:80]


def _grant_from_record(g: Mapping[str, Any]) -> Grant:
    """A stored grant, its fields checked (types, finite sizes and times, a priority and a pid in
    range). Its app id is checked as the ledger checks a new grant's (a non-empty string), so what
    the ledger holds always reads back; the id rule (`vgpu/ids.py`) is the RPC edge's."""
    grant = Grant(**g)
    for name in ("grant_id", "app_id", "device_id", "source"):
        if not isinstance(getattr(grant, name), str) or not getattr(grant, name):
            raise ValueError(f"{name} is {getattr(grant, name)!r}, not a non-empty string")
    _check_amount("memory_mib", grant.memory_mib)
    _check_amount("sm_pct", grant.sm_pct, upper=100.0)
    if grant.memory_mib > MAX_STORED_GRANT_MIB:
        raise ValueError(f"memory_mib {grant.memory_mib:g} is beyond any device ({MAX_STORED_GRANT_MIB:g} MiB)")
    _check_priority(grant.priority)
    if not isinstance(grant.pid, int) or isinstance(grant.pid, bool):
        raise ValueError(f"pid is {grant.pid!r}, not an integer")
    if not 0 <= grant.pid <= MAX_PID:
        raise ValueError(f"pid {grant.pid} is out of range (0 to {MAX_PID})")
    if grant.uid is not None and (not isinstance(grant.uid, int) or isinstance(grant.uid, bool)
                                  or not 0 <= grant.uid <= _MAX_UID):
        raise ValueError(f"uid is {grant.uid!r}, not a Unix uid")
    for name in ("created_at_s", "updated_at_s", "mem_updated_at_s"):
        value = getattr(grant, name)
        if value is None and name == "mem_updated_at_s":
            continue
        # the policy subtracts these from the clock: a string or a NaN would fail or never age
        if not isinstance(value, int | float) or isinstance(value, bool) or not _finite(value):
            raise ValueError(f"{name} is {value!r}, not a finite number of seconds")
    return grant


def _check_priority(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"priority is {value!r}, not an integer")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"priority {value} is out of range ({PRIORITY_MIN} to {PRIORITY_MAX})")
