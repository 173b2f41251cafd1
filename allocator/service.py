"""The grpc.aio `Allocator` servicer and a server builder with health and reflection.

The servicer validates input (INVALID_ARGUMENT with a message that says what to fix), calls the
`Allocator` (allocator/core.py) directly on the server's event loop, and turns every exception into
a status through the one map in allocator/errors.py.

What the allocator does not know itself (the processes an application's signatures name, when the
manager last heard from it, the profiler streams per device) comes from an optional `NodeObserver`
the daemon plugs in; the user and command of a process from `process_info` (psutil by default).

Claims: `claims()` (the daemon: its store's) gives the application ids whose token has been issued,
with when (and `claim_uids()` which uid self-registered each); ListApplications marks those
applications and lists the ones that hold nothing yet.
ForgetApplications drops claims that hold nothing through `forget` (the daemon's access control).

Caller identity: `identify(context)` returns the application identity of the caller, or None for a
trusted caller (operator, same-user socket). The default trusts everyone; the daemon's auth
(vgpu/auth.py) plugs in here.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Protocol, TypeAlias, TypeVar

import grpc
import psutil
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vgpu.allocator.core import (
    Allocated,
    AllocationEvent,
    AllocationRequest,
    Allocator,
    AppInfo,
    DeviceResources,
    EventKind,
)
from vgpu.allocator.errors import InvalidRequest, NotSupported, QuotaExceeded, Unavailable, status_for
from vgpu.allocator.history import AppSeries
from vgpu.allocator.ledger import AppLimits, Grant
from vgpu.ids import MAX_PID, app_id_problem
from vgpu.jobs import InvalidJobConfig, JobConfig
from vgpu.log import LogBudget, get_logger
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc

# A servicer context whatever the method's messages: the handlers here only abort and send metadata.
# (A string: grpc's ServicerContext is generic in its stubs only.)
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Identify: TypeAlias = Callable[[Context], str | None]
# forget(app_ids, uid): drop the claims that hold nothing; the ids forgotten, and those kept with why
# (the daemon: vgpu.auth.AccessControl.forget).
Forget: TypeAlias = Callable[[list[str], "int | None"], Awaitable[tuple[list[str], list[tuple[str, str]]]]]
T = TypeVar("T")

_log = get_logger("vgpu.allocator.service")

_EVENT_KIND = {
    EventKind.GRANTED: pb.AllocationEvent.GRANTED,
    EventKind.RESIZED: pb.AllocationEvent.RESIZED,
    EventKind.RELEASED: pb.AllocationEvent.RELEASED,
    EventKind.LIMITS_CHANGED: pb.AllocationEvent.LIMITS_CHANGED,
    EventKind.POWER_LIMIT_CHANGED: pb.AllocationEvent.POWER_LIMIT_CHANGED,
    EventKind.MIG_CHANGED: pb.AllocationEvent.MIG_CHANGED,
}


@dataclass(frozen=True)
class ProfilerState:
    """Profiler streams now open that sent for a device, and when its newest signature arrived."""

    streams: int
    newest_signature_s: float | None  # Unix s; None: none yet


class NodeObserver(Protocol):
    """What the daemon knows beyond the allocator (the manager's view)."""

    def app_pids(self, app_id: str) -> Sequence[int]: ...

    def profiler_states(self) -> Mapping[str, ProfilerState]: ...

    def open_profiler_streams(self) -> int: ...


def process_info(pid: int) -> tuple[str, str]:
    """(user, command line) of a process; empty strings for what cannot be read (gone, no access)."""
    try:
        proc = psutil.Process(pid)
    except (psutil.Error, ValueError):
        return "", ""
    user = command = ""
    try:
        user = proc.username()
    except psutil.Error:
        pass
    try:
        command = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        pass
    return user, command


# --- conversions -----------------------------------------------------------------------------------
def grant_to_pb(g: Grant) -> pb.Grant:
    msg = pb.Grant(
        grant_id=g.grant_id,
        app_id=g.app_id,
        device_id=g.device_id,
        memory_mib=g.memory_mib,
        sm_pct=g.sm_pct,
        priority=g.priority,
        created_at_s=g.created_at_s,
        updated_at_s=g.updated_at_s,
        source=g.source,
        pid=g.pid,
    )
    if g.cold_start_mib is not None and math.isfinite(g.cold_start_mib):
        msg.cold_start_mib = g.cold_start_mib
    return msg


def limits_to_pb(lim: AppLimits) -> pb.AppLimits:
    msg = pb.AppLimits(app_id=lim.app_id)
    if lim.max_memory_mib is not None:
        msg.max_memory_mib = lim.max_memory_mib
    if lim.max_sm_pct is not None:
        msg.max_sm_pct = lim.max_sm_pct
    if lim.priority is not None:
        msg.priority = lim.priority
    return msg


def limits_from_pb(msg: pb.AppLimits) -> AppLimits:
    app_id = _app_id(msg.app_id, "limits.app_id")
    mem = _amount(msg.max_memory_mib, "limits.max_memory_mib") if msg.HasField("max_memory_mib") else None
    sm = _amount(msg.max_sm_pct, "limits.max_sm_pct", upper=100.0) if msg.HasField("max_sm_pct") else None
    prio = msg.priority if msg.HasField("priority") else None
    return AppLimits(app_id=app_id, max_memory_mib=mem, max_sm_pct=sm, priority=prio)


def device_to_pb(d: DeviceResources, profiler: ProfilerState | None = None, now_s: float = math.nan,
                 process_info: Callable[[int], tuple[str, str]] = process_info) -> pb.DeviceResources:
    """`profiler`: the device's profiler streams, when the server knows them."""
    msg = pb.DeviceResources(
        device_id=d.device_id,
        name=d.name,
        mem_total_mib=d.mem_total_mib,
        mem_granted_mib=d.mem_granted_mib,
        mem_available_mib=d.mem_available_mib,
        sm_granted_pct=d.sm_granted_pct,
        sm_available_pct=d.sm_available_pct,
        mig_enabled=d.mig_enabled,
        index=d.index,
        dry_run=d.dry_run,
    )
    if d.pci_bus_id is not None:
        msg.pci_bus_id = d.pci_bus_id
    for name in ("mem_used_mib", "sm_util_pct", "mem_bw_util_pct"):
        value = getattr(d, name)
        if value is not None and math.isfinite(value):
            setattr(msg, name, value)
    for name in ("power_draw_mw", "temperature_c", "sm_clock_mhz"):
        value = getattr(d, name)
        if value is not None and value >= 0:
            setattr(msg, name, int(value))
    for proc in d.processes:
        user, command = process_info(proc.pid)
        entry = msg.processes.add(pid=proc.pid, user=user, command=command[:512])
        if proc.used_mib is not None and math.isfinite(proc.used_mib):
            entry.used_mib = proc.used_mib
        if proc.gpu_instance_id is not None:
            entry.gpu_instance_id = proc.gpu_instance_id
    if profiler is not None:
        msg.profiler_streams = profiler.streams
        if profiler.newest_signature_s is not None and math.isfinite(now_s):
            msg.newest_signature_age_s = max(0.0, now_s - profiler.newest_signature_s)
    if d.power_limit_mw is not None:
        msg.power_limit_mw = d.power_limit_mw
    if d.power_constraints is not None:
        msg.power_min_mw = d.power_constraints.min_mw
        msg.power_max_mw = d.power_constraints.max_mw
        msg.power_default_mw = d.power_constraints.default_mw
    for inst in d.mig_instances:
        msg.mig_instances.add(
            instance_id=inst.uuid or str(inst.instance_id),
            profile=inst.profile_name,
            start=inst.placement.start,
            size=inst.placement.size,
            mem_total_mib=inst.mem_total_mib,
            gpu_instance_id=inst.instance_id,
        )
    return msg


def _finite_or_zero(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def app_to_pb(a: AppInfo, *, pids: Sequence[int] = (),
              process_info: Callable[[int], tuple[str, str]] = process_info) -> pb.ApplicationInfo:
    """`pids`: the processes the manager has seen the application's signatures name."""
    msg = pb.ApplicationInfo(
        app_id=a.app_id,
        grants=[grant_to_pb(g) for g in a.grants],
        mem_used_mib=_finite_or_zero(a.mem_used_mib),
        sm_util_pct=_finite_or_zero(a.sm_util_pct),
        forecast_mem_p90_mib=_finite_or_zero(a.forecast_mem_p90_mib),
        forecast_sm_p90_pct=_finite_or_zero(a.forecast_sm_p90_pct),
        device_id=a.device_id,
        forecast_mem_p50_mib=_finite_or_zero(a.forecast_mem_p50_mib),
        forecast_sm_p50_pct=_finite_or_zero(a.forecast_sm_p50_pct),
        mem_limit=a.mem_limit,
        mem_limit_reason=a.mem_limit_reason,
    )
    for pid in sorted({*a.pids, *(p for p in pids if p > 0)}):
        user, command = process_info(pid)
        msg.processes.add(pid=pid, user=user, command=command[:512])
    if a.limits is not None:
        msg.limits.CopyFrom(limits_to_pb(a.limits))
    if a.last_seen_s is not None:
        msg.last_seen_s = a.last_seen_s
    if a.plan is not None:
        if math.isfinite(a.plan.memory_mib):
            msg.plan_memory_mib = a.plan.memory_mib
        if math.isfinite(a.plan.sm_pct):
            msg.plan_sm_pct = a.plan.sm_pct
        msg.plan_mem_rule, msg.plan_sm_rule = a.plan.mem_rule, a.plan.sm_rule
    return msg


def history_to_pb(s: AppSeries) -> pb.AppHistory:
    col = s.column
    return pb.AppHistory(
        app_id=s.app_id,
        device_id=s.device_id,
        t_unix_s=col("t_s").tolist(),
        mem_used_mib=col("mem_used_mib").tolist(),
        mem_p50_mib=col("mem_p50_mib").tolist(),
        mem_p90_mib=col("mem_p90_mib").tolist(),
        mem_granted_mib=col("mem_granted_mib").tolist(),
        sm_used_pct=col("sm_used_pct").tolist(),
        sm_p90_pct=col("sm_p90_pct").tolist(),
        sm_granted_pct=col("sm_granted_pct").tolist(),
        events=[pb.HistoryEvent(t_unix_s=e.t_s, kind=e.kind, detail=e.detail, mem_granted_mib=e.mem_granted_mib)
                for e in s.events],
    )


def event_to_pb(e: AllocationEvent) -> pb.AllocationEvent:
    msg = pb.AllocationEvent(kind=_EVENT_KIND[e.kind], at_s=e.at_s, detail=e.detail, mem_limit=e.mem_limit)
    if e.grant is not None:
        msg.grant.CopyFrom(grant_to_pb(e.grant))
    elif e.app_id or e.device_id:
        # Device- and app-level events carry their subject in a grant-less Grant message.
        msg.grant.app_id = e.app_id
        msg.grant.device_id = e.device_id
    return msg


class EncodedEvents:
    """Each event's wire bytes, built and serialized once and shared by every watch stream that sends
    it: the allocator pushes the same `AllocationEvent` object to every subscription, so the bytes are
    found by the object's identity. The most recent `keep` events are kept (with the objects, so an
    identity is never reused while its bytes are kept); a stream further behind than that encodes
    its event again, which costs time, never correctness."""

    def __init__(self, keep: int = 1024) -> None:
        self._keep = max(1, keep)
        self._by_id: dict[int, tuple[AllocationEvent, bytes]] = {}
        self.encoded = 0  # events serialized (a stream that found its event's bytes adds nothing)

    def __call__(self, event: AllocationEvent) -> bytes:
        hit = self._by_id.get(id(event))
        if hit is not None and hit[0] is event:
            return hit[1]
        data = event_to_pb(event).SerializeToString()
        self.encoded += 1
        self._by_id[id(event)] = (event, data)
        if len(self._by_id) > self._keep:  # dicts keep insertion order: the oldest goes
            del self._by_id[next(iter(self._by_id))]
        return data


def _event_wire(message: bytes | pb.AllocationEvent) -> bytes:
    """WatchAllocations' response serializer: `AllocatorServicer` yields each event's bytes, already
    serialized (once per event, for every stream); a message is serialized here (a servicer that
    yields `pb.AllocationEvent`s, as the generated base class declares)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class _Handlers:
    """Takes the method handlers a generated `add_*Servicer_to_server` registers, instead of a server."""

    def __init__(self) -> None:
        self.by_service: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}

    def add_generic_rpc_handlers(self, _handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
        self.by_service[service] = dict(handlers)


def add_allocator_servicer(servicer: pb_grpc.AllocatorServicer, server: grpc.aio.Server) -> None:
    """`pb_grpc.add_AllocatorServicer_to_server`, with WatchAllocations' responses passed through as
    bytes (`_event_wire`): the generated handlers are kept for every other method, and clients see the
    same messages on the wire."""
    taken = _Handlers()
    pb_grpc.add_AllocatorServicer_to_server(servicer, taken)  # type: ignore[arg-type]  # only registers
    name = pb.DESCRIPTOR.services_by_name["Allocator"].full_name
    handlers = taken.by_service[name]
    handlers["WatchAllocations"] = grpc.unary_stream_rpc_method_handler(
        servicer.WatchAllocations,
        request_deserializer=pb.WatchAllocationsRequest.FromString,
        response_serializer=_event_wire,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


# --- validation ------------------------------------------------------------------------------------
def _app_id(value: str, name: str = "app_id") -> str:
    problem = app_id_problem(value, name)
    if problem is not None:
        raise InvalidRequest(problem)
    return value


# The longest device or grant id a call may name: a GPU's UUID or a MIG instance's is under 50
# characters and a grant id 32. A longer one is refused before it is looked up, since the answer
# that it is unknown repeats it, and gRPC drops an answer whose message passes 16 KiB, leaving the
# caller a RESOURCE_EXHAUSTED about metadata instead of the reason.
MAX_ID_CHARS = 256


def _bounded_id(value: str, name: str) -> str:
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequest(f"{name} is {len(value)} characters long; at most {MAX_ID_CHARS} are allowed")
    return value


def _amount(value: float, name: str, *, upper: float | None = None) -> float:
    if math.isnan(value) or math.isinf(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    if value < 0:
        raise InvalidRequest(f"{name} must be >= 0, got {value!r}")
    if upper is not None and value > upper:
        # repr, not :g, which would print 100.0000001 as 100 and contradict the bound it names
        raise InvalidRequest(f"{name} must be at most {upper:g}, got {value!r}")
    return value + 0.0  # -0.0 is 0: a grant of "-0 MiB" reads as nonsense


def request_from_pb(msg: pb.ResourceRequest) -> AllocationRequest:
    app_id = _app_id(msg.app_id, "request.app_id")
    memory = _amount(msg.memory_mib, "request.memory_mib")
    sm = _amount(msg.sm_pct, "request.sm_pct", upper=100.0)
    _bounded_id(msg.device_id, "request.device_id")
    if not math.isfinite(msg.deadline_s) or msg.deadline_s < 0:
        raise InvalidRequest(f"request.deadline_s must be a finite Unix time in seconds >= 0 (0: none), "
                             f"got {msg.deadline_s}")
    if msg.pid > MAX_PID:
        raise InvalidRequest(f"request.pid {msg.pid} is out of range: a pid is 1 to {MAX_PID} (0: none)")
    job = None
    if msg.HasField("job"):
        try:
            job = JobConfig.from_proto(msg.job)
        except InvalidJobConfig as exc:
            raise InvalidRequest(f"request.job: {exc}") from exc
    return AllocationRequest(
        app_id=app_id,
        memory_mib=memory,
        sm_pct=sm,
        device_id=msg.device_id or None,
        priority=msg.priority,
        deadline_s=msg.deadline_s,
        critical=msg.critical,
        job=job,
        pid=msg.pid,
    )


# Trailing metadata of an UNAVAILABLE the daemon gave itself (Unavailable: a model still loading, a
# state directory full): the call changed nothing, so the same call may simply be sent again. An
# UNAVAILABLE without it may come from a connection that broke after the daemon acted on the call.
NOTHING_CHANGED_KEY = "vgpu-nothing-changed"
# Trailing metadata of a RequestResourceAllocation answered with the cold-start grant the calling
# process already held for the same job (`Allocator.allocate`): its value is that grant's id, and
# nothing was granted or changed.
GRANT_HELD_KEY = "vgpu-grant-held"


async def _abort(context: Context, exc: BaseException, method: str) -> NoReturn:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        _log.error("rpc_failed", method=method, error=repr(exc), exc_info=exc)
    trailer = ((NOTHING_CHANGED_KEY, "1"),) if isinstance(exc, Unavailable) else ()
    await context.abort(code, message, trailing_metadata=trailer)
    raise AssertionError("unreachable")  # context.abort raises


class AllocatorServicer(pb_grpc.AllocatorServicer):
    """`vgpu.v1.Allocator` over an `Allocator`."""

    def __init__(self, allocator: Allocator, *, identify: Identify | None = None, observer: NodeObserver | None = None,
                 process_info: Callable[[int], tuple[str, str]] = process_info,
                 watcher_owner: Callable[[], str] | None = None,
                 bounded_uid: Callable[[], int | None] | None = None,
                 claims: Callable[[], Mapping[str, float | None]] | None = None, backend: str = "",
                 forget: Forget | None = None, claim_uids: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.allocator = allocator
        self.backend = backend  # as GetAvailableResources reports it (server.backend)
        self._claims = claims or (lambda: {})
        self._forget = forget
        self._claim_uids = claim_uids or (lambda: {})
        self._identify: Identify = identify or (lambda _ctx: None)
        self.observer = observer
        self._process_info = process_info
        # Who a watcher counts against for the per-caller bound (the daemon: the caller's token).
        self._watcher_owner = watcher_owner or (lambda: "")
        # The Unix uid whose per-uid shares (grants, watchers) the call takes (the daemon: the
        # socket peer's, whatever token it sent; None: not bounded per uid).
        self._bounded_uid = bounded_uid or (lambda: None)
        self.encoded_events = EncodedEvents()
        self._quota_log = LogBudget()

    async def _call(self, context: Context, method: str, fn: Callable[[str | None], T]) -> T:
        try:
            caller = self._identify(context)
            return fn(caller)
        except Exception as exc:  # noqa: BLE001 - every error goes through the one map
            if isinstance(exc, QuotaExceeded):
                self._quota_refused(method, exc)
            await _abort(context, exc, method)

    def _quota_refused(self, method: str, exc: QuotaExceeded) -> None:
        """A caller at one of the node's bounds: counted, and logged (with who, the call's caller
        fields) for the first ten of each caller and setting a minute, as refused calls are."""
        counts = self.allocator.counters.quota_refusals
        counts[exc.quota] = counts.get(exc.quota, 0) + 1
        who = structlog.contextvars.get_contextvars()
        since = self._quota_log.admit((who.get("caller"), who.get("caller_uid"), exc.quota))
        if since is not None:
            _log.warning("quota_refused", method=method, quota=exc.quota, reason=str(exc),
                         **({"refused_since_last_record": since} if since else {}))

    async def RequestResourceAllocation(  # noqa: N802 - gRPC method names
        self, request: pb.RequestResourceAllocationRequest, context: Context
    ) -> pb.RequestResourceAllocationResponse:
        def run(caller: str | None) -> tuple[Allocated, str]:
            if not request.HasField("request"):
                raise InvalidRequest("request is missing: set RequestResourceAllocationRequest.request")
            wanted = replace(request_from_pb(request.request), uid=self._bounded_uid())
            got = self.allocator.allocate(wanted, caller=caller)
            return got, self.allocator.app_memory_limit(got.grant.app_id, got.grant.device_id)[0]  # the grant's GPU

        got, mem_limit = await self._call(context, "RequestResourceAllocation", run)
        if got.held:
            # the grant the process already held for this job, as it stands (its created_at_s is
            # when it was made): the reply is the usual one, the trailer says nothing was granted
            context.set_trailing_metadata(((GRANT_HELD_KEY, got.grant.grant_id),))
        return pb.RequestResourceAllocationResponse(grant=grant_to_pb(got.grant), mem_limit=mem_limit)

    async def ReleaseResources(  # noqa: N802
        self, request: pb.ReleaseResourcesRequest, context: Context
    ) -> pb.ReleaseResourcesResponse:
        def run(caller: str | None) -> Grant:
            if not request.grant_id:
                raise InvalidRequest("grant_id is empty: give the id RequestResourceAllocation returned")
            return self.allocator.release(_bounded_id(request.grant_id, "grant_id"), caller=caller)

        grant = await self._call(context, "ReleaseResources", run)
        return pb.ReleaseResourcesResponse(released=grant_to_pb(grant))

    async def GetAvailableResources(  # noqa: N802
        self, request: pb.GetAvailableResourcesRequest, context: Context
    ) -> pb.GetAvailableResourcesResponse:
        devices = await self._call(
            context, "GetAvailableResources",
            lambda _c: self.allocator.available(_bounded_id(request.device_id, "device_id") or None)
        )
        info = self._process_info
        dry_run = self.allocator.dry_run
        if self.observer is None:
            return pb.GetAvailableResourcesResponse(devices=[device_to_pb(d, process_info=info) for d in devices],
                                                    dry_run=dry_run, backend=self.backend)
        states = self.observer.profiler_states()
        now = self.allocator.clock()
        return pb.GetAvailableResourcesResponse(
            devices=[device_to_pb(d, states.get(d.device_id, ProfilerState(0, None)), now, info) for d in devices],
            dry_run=dry_run,
            profiler_streams_open=self.observer.open_profiler_streams(),
            backend=self.backend,
        )

    async def SetResourceLimits(  # noqa: N802
        self, request: pb.SetResourceLimitsRequest, context: Context
    ) -> pb.SetResourceLimitsResponse:
        def run(caller: str | None) -> AppLimits:
            if not request.HasField("limits"):
                raise InvalidRequest("limits is missing: set SetResourceLimitsRequest.limits")
            return self.allocator.set_limits(limits_from_pb(request.limits), caller=caller)

        limits = await self._call(context, "SetResourceLimits", run)
        return pb.SetResourceLimitsResponse(limits=limits_to_pb(limits))

    async def ForgetApplications(  # noqa: N802
        self, request: pb.ForgetApplicationsRequest, context: Context
    ) -> pb.ForgetApplicationsResponse:
        def check(_caller: str | None) -> tuple[list[str], int | None]:
            if self._forget is None:
                raise NotSupported("this server keeps no application claims")
            ids = [_bounded_id(a, "app_ids") for a in request.app_ids]
            uid = request.claimed_by_uid if request.HasField("claimed_by_uid") else None
            if not ids and uid is None:
                raise InvalidRequest("nothing to forget: name app_ids, or claimed_by_uid")
            return ids, uid

        ids, uid = await self._call(context, "ForgetApplications", check)
        assert self._forget is not None  # checked above
        forgotten, kept = await self._forget(ids, uid)
        # a change like any other: logged with who asked (the call's caller fields), ids bounded
        _log.info("apps_forgotten", forgotten=forgotten[:100], forgotten_count=len(forgotten),
                  kept=[f"{a}: {why}" for a, why in kept[:100]], kept_count=len(kept),
                  **({"claimed_by_uid": uid} if uid is not None else {}))
        return pb.ForgetApplicationsResponse(forgotten=forgotten,
                                             kept=[pb.KeptClaim(app_id=a, reason=why) for a, why in kept])

    async def ListApplications(  # noqa: N802
        self, request: pb.ListApplicationsRequest, context: Context
    ) -> pb.ListApplicationsResponse:
        apps, claims, uids = await self._call(context, "ListApplications",
                                              lambda _c: (self.allocator.list_apps(), self._claims(), self._claim_uids()))
        obs = self.observer
        out = [app_to_pb(a, pids=obs.app_pids(a.app_id) if obs else (), process_info=self._process_info)
               for a in apps]
        listed = {a.app_id for a in apps}
        # Claimed ids that hold nothing the allocator knows of: the application has its token and no
        # grant; still with its last sign of life (one released for idleness keeps when it was seen).
        for app_id in claims:
            if app_id not in listed:
                msg = pb.ApplicationInfo(app_id=app_id)
                seen = self.allocator.last_seen_s(app_id, counting_start=False)
                if seen is not None:
                    msg.last_seen_s = seen
                out.append(msg)
        for msg in out:
            if msg.app_id in claims:
                msg.claimed = True
                at_s = claims[msg.app_id]
                if at_s is not None:  # None: the stored time is damaged; the claim stands
                    msg.claimed_at_s = at_s
                if msg.app_id in uids:
                    msg.claimed_by_uid = uids[msg.app_id]
        out.sort(key=lambda m: m.app_id)
        return pb.ListApplicationsResponse(apps=out)

    async def GetAppHistory(  # noqa: N802
        self, request: pb.GetAppHistoryRequest, context: Context
    ) -> pb.GetAppHistoryResponse:
        def run(_caller: str | None) -> list[AppSeries]:
            since = request.since_s
            if math.isnan(since) or since < 0:
                raise InvalidRequest(f"since_s must be seconds >= 0 (0: everything kept), got {since}")
            cutoff = self.allocator.clock() - since if since > 0 else -math.inf
            return self.allocator.history.series(_bounded_id(request.app_id, "app_id") or None,
                                                 _bounded_id(request.device_id, "device_id") or None, cutoff)

        series = await self._call(context, "GetAppHistory", run)
        return pb.GetAppHistoryResponse(apps=[history_to_pb(s) for s in series], now_unix_s=self.allocator.clock())

    async def WatchAllocations(  # type: ignore[override]  # noqa: N802 - yields bytes: see add_allocator_servicer
        self, request: pb.WatchAllocationsRequest, context: Context
    ) -> AsyncIterator[bytes]:
        """Each event as its serialized `AllocationEvent`, encoded once per event for every stream
        (`EncodedEvents`); registered by `add_allocator_servicer`, whose serializer passes bytes through."""
        sub = await self._call(context, "WatchAllocations",
                               lambda _c: self.allocator.watch(_bounded_id(request.app_id, "app_id") or None,
                                                               owner=self._watcher_owner(),
                                                               uid=self._bounded_uid()))
        encode = self.encoded_events
        try:
            # Initial metadata now tells the client the watch is live: every event from here on
            # reaches it (`await call.initial_metadata()` before acting, to miss nothing).
            await context.send_initial_metadata(())
            async for event in sub:
                yield encode(event)
        finally:
            sub.close()
        if sub.overflowed:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this watcher fell {sub.dropped} events behind and was dropped; watch again and read faster")


SERVICE_NAMES: tuple[str, ...] = (
    pb.DESCRIPTOR.services_by_name["Allocator"].full_name,
    ingest_pb2.DESCRIPTOR.services_by_name["Ingest"].full_name,
)


@dataclass
class Server:
    """A grpc.aio server with its health servicer. `start()` marks every service SERVING;
    `stop(grace_s)` marks them NOT_SERVING first, then lets in-flight calls finish."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    address: str

    async def start(self) -> None:
        await self.server.start()
        await self._set_serving(True)

    async def stop(self, grace_s: float | None = 1.0) -> None:
        await self._set_serving(False)
        await self.server.stop(grace_s)

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)


def build_server(
    address: str,
    *,
    allocator_servicer: pb_grpc.AllocatorServicer | None = None,
    ingest_servicer: ingest_pb2_grpc.IngestServicer | None = None,
    extra: Sequence[tuple[str, Callable[[grpc.aio.Server], None]]] = (),
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, int]] = (),
) -> Server:
    """A grpc.aio server on `address` ("unix:/path" or "host:port") with the given servicers, gRPC
    health and reflection. `extra`: (full service name, add-to-server callback) pairs for more
    services; `options`: gRPC channel arguments for the server. Raises RuntimeError when it cannot bind (grpc's own message names the address)."""
    server = grpc.aio.server(interceptors=list(interceptors), options=list(options))
    names: list[str] = []
    if allocator_servicer is not None:
        add_allocator_servicer(allocator_servicer, server)
        names.append(SERVICE_NAMES[0])
    if ingest_servicer is not None:
        ingest_pb2_grpc.add_IngestServicer_to_server(ingest_servicer, server)
        names.append(SERVICE_NAMES[1])
    for name, add in extra:
        add(server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    server.add_insecure_port(address)
    return Server(server, health_servicer, tuple(names), address)


__all__ = ["AllocatorServicer", "EncodedEvents", "NodeObserver", "ProfilerState", "SERVICE_NAMES", "Server", "add_allocator_servicer",
           "build_server", "process_info"]
