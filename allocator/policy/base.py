"""What the manager recommends, what a policy plans from it, and the built-in baseline policy.

Recommend, then act: the manager turns forecasts into `Recommendation`s; a `Policy` (pure, no
I/O) turns recommendations plus a read-only view of the devices into a `Plan`; the `Allocator`
alone carries the plan out (ledger resizes, power limits, MIG layouts). `BaselinePolicy` is the
simple rule an `Allocator` uses when it is given no policy; `vgpu serve` and `vgpu demo` plug in
the predictive one (allocator/policy/forecast.py) with `Allocator(policy=...)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from vgpu.allocator.ledger import Grant
from vgpu.device.base import GpuInstance, PowerConstraints
from vgpu.jobs import JobConfig

# Memory usage at or under this is an application that has not begun to use the GPU: an idle
# device reads a few MiB, a CUDA context alone takes a few hundred. The manager (an application's
# first use) and the policy (its start-up window) share it.
IDLE_MEM_MIB = 64.0


@dataclass(frozen=True)
class Recommendation:
    """The manager's recommendation for one application on one device."""

    app_id: str
    device_id: str
    memory_mib: float
    sm_pct: float
    # "model", "baseline" or "cold_start".
    source: str = "baseline"
    mem_p90_peak_mib: float = math.nan
    sm_p90_peak_pct: float = math.nan
    # Last observed usage (NaN where unknown).
    mem_used_mib: float = math.nan
    sm_util_pct: float = math.nan
    for_seq: int = 0
    decided_at_s: float = 0.0
    # Peak P50 forecast over the horizons (NaN where unknown), for what operators see.
    mem_p50_peak_mib: float = math.nan
    sm_p50_peak_pct: float = math.nan
    # The job's cold-start size (what the cold-start sizer granted it from its configuration; NaN:
    # none): a policy grants a start-up ramp to where this says it ends, before any history.
    cold_start_mem_mib: float = math.nan
    # When the application first used the GPU (its first signature with memory above
    # `IDLE_MEM_MIB` or SM in use, Unix seconds): the start of its start-up window. NaN: not said
    # (the window counts from the first grant); inf: not used yet (still starting).
    first_use_s: float = math.nan


@dataclass(frozen=True)
class DeviceView:
    """Read-only state of one device for a policy."""

    device_id: str
    name: str
    mem_total_mib: float
    sm_total_pct: float
    grants: tuple[Grant, ...]
    power_limit_mw: int | None = None
    power_constraints: PowerConstraints | None = None
    # False when the power mechanism is disabled for the device (no permission / no support).
    power_enabled: bool = True
    mig_enabled: bool = False
    mig_instances: tuple[GpuInstance, ...] = ()


@dataclass(frozen=True)
class GrantTarget:
    """Size a grant should have; `grant_id` None: create a forecast grant for the app."""

    app_id: str
    device_id: str
    memory_mib: float
    sm_pct: float
    grant_id: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class PowerTarget:
    device_id: str
    limit_mw: int
    reason: str = ""


@dataclass(frozen=True)
class MigTarget:
    """The MIG layout a device should have: GPU-instance profile names, e.g. ("3g.40gb", "4g.40gb")."""

    device_id: str
    profiles: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class MigOutcome:
    """What a `MigMechanism.apply` did on one device (allocator/core.py counts from it, nothing else).

    `changed`: GPU instances were created or destroyed. `failed_steps`: steps of the plan left undone
    by this call (an instance in use, a create blocked or refused, or the mechanism turning itself
    off now: then at least 1); 0 when the layout is reached, already there, planned in dry-run, or
    the mechanism was already off. `reason`: why it is incomplete or off; empty when complete."""

    changed: bool
    failed_steps: int = 0
    reason: str = ""


def limits_are_hard(counted: float, capacity: float, hard_at: float, *, contended: bool | None = None) -> bool:
    """The hard-limit rule, the one place it is written: a device's limits are hard (a cgroup cap
    on memory: beyond it the application runs out of memory and ends; an MPS cap on SM) where the
    device is contended, or where what is counted on it (`counted`, in the unit of `capacity`)
    reaches `hard_at`; cooperative elsewhere. Contended: what is counted exceeds the capacity,
    unless the caller's own contention rule already said (`contended`: the policy's weighs each
    application's need before any contention cut, while what it counts is after the cut).
    `hard_at` is `hard_limit_at_frac` of the capacity: 0 (`server.hard_memory_limits = "always"`,
    `hard_limit_at_frac_for`), hard everywhere; above the capacity, hard only when contended."""
    if contended is None:
        contended = counted > capacity
    return contended or counted >= hard_at


def hard_limit_at_frac_for(hard_memory_limits: str, contended_at_frac: float) -> float:
    """The fraction of a device's memory from which its memory limits are hard, for the setting
    `server.hard_memory_limits`: "contended", `contended_at_frac` (the policy's own threshold);
    "always", 0 (hard wherever a pid is known)."""
    if hard_memory_limits == "always":
        return 0.0
    if hard_memory_limits == "contended":
        return contended_at_frac
    raise ValueError(f"hard_memory_limits: expected 'contended' or 'always', got {hard_memory_limits!r}")


@dataclass(frozen=True)
class Enforcement:
    """How the memory grants of a device are to be enforced: `hard_mem` True, by a hard limit (a
    cgroup cap; beyond it the application runs out of memory and ends), False, cooperatively (the
    application is told its limit and keeps to it itself; an allocation beyond fails and the
    application lives). `reason` says why, for logs and `vgpu apps`."""

    device_id: str
    hard_mem: bool
    reason: str = ""
    # What the decision weighed, so that it can be judged again when an application leaves before
    # the next plan (`recounted`): the memory counted per application (a planned one's need before
    # any contention cut, another one's grants), the device's memory, and the amount from which
    # the limits are hard. Empty `counted_mib`: not said; the decision then stands as made.
    counted_mib: tuple[tuple[str, float], ...] = ()
    mem_total_mib: float = math.nan
    hard_at_mib: float = math.nan

    def recounted(self, app_id: str, mib: float) -> Enforcement:
        """The decision judged again with `app_id` counted at `mib` (0: left out) instead of what
        it counted: hard while what is counted exceeds the device (contended) or reaches
        `hard_at_mib`. Itself when it does not say what it counted."""
        if not self.counted_mib or math.isnan(self.mem_total_mib) or math.isnan(self.hard_at_mib):
            return self
        counted = tuple((a, m) for a, m in self.counted_mib if a != app_id) + (((app_id, mib),) if mib > 0 else ())
        total = sum(m for _, m in counted)
        hard = limits_are_hard(total, self.mem_total_mib, self.hard_at_mib)
        left = "" if mib > 0 else f" once {app_id} left"
        reason = (f"{'contended' if hard else 'uncontended'}{left}: {total:.0f} of {self.mem_total_mib:.0f} MiB "
                  "planned")
        return Enforcement(self.device_id, hard, reason, counted, self.mem_total_mib, self.hard_at_mib)


@dataclass(frozen=True)
class PlanReason:
    """Why the plan sized an application as it did, for the operator (`vgpu apps`): its planned
    memory and SM on the device (what it holds, requests included, once the plan is carried out;
    growth may still be clamped to what fits) and the rule that set each, as the policy names it
    (allocator/policy/forecast.py lists them: e.g. `forecast`, `ramp`, `start`, `dwell`, `contention`)."""

    app_id: str
    device_id: str
    memory_mib: float
    sm_pct: float
    mem_rule: str
    sm_rule: str


@dataclass(frozen=True)
class Plan:
    grants: tuple[GrantTarget, ...] = ()
    power: tuple[PowerTarget, ...] = ()
    mig: tuple[MigTarget, ...] = ()
    # per device; a device the plan does not name keeps the allocator's own rule (allocator/core.py)
    enforcement: tuple[Enforcement, ...] = ()
    # every planned application's reasons, changed or not; a policy that gives none leaves it empty
    reasons: tuple[PlanReason, ...] = ()


@runtime_checkable
class Policy(Protocol):
    """Pure planning: no device calls, no clock reads beyond `now_s`."""

    def plan(self, recommendations: Sequence[Recommendation], devices: Sequence[DeviceView], now_s: float) -> Plan: ...


@dataclass(frozen=True)
class BaselinePolicy:
    """The simple built-in rule.

    Grants: an application's most recent grant on the device follows the recommendation (minus its
    other grants there); a grant the application requested itself only grows, never shrinks below
    its size; an application without a grant gets a forecast grant. When the wanted SM shares of a
    device add up to more than 100 %, they are scaled down in proportion. Then a change smaller than
    the thresholds is ignored (VPA's "ignore small changes"). The allocator clamps growth to what fits.

    Power: the limit follows the summed recommended SM share of the device's applications, scaled
    into the device's [min, max] range with `power_headroom` on top, in `power_step_mw` steps, and
    only changes when it moves by at least `power_hysteresis_frac` of the range.
    """

    mem_threshold_mib: float = 256.0
    mem_threshold_frac: float = 0.05
    sm_threshold_pct: float = 5.0
    power_headroom: float = 1.15
    power_step_mw: int = 5000
    power_hysteresis_frac: float = 0.05
    manage_power: bool = True

    def _small(self, old_mib: float, new_mib: float, old_sm: float, new_sm: float) -> bool:
        mem_thr = max(self.mem_threshold_mib, self.mem_threshold_frac * old_mib)
        return abs(new_mib - old_mib) < mem_thr and abs(new_sm - old_sm) < self.sm_threshold_pct

    def plan(self, recommendations: Sequence[Recommendation], devices: Sequence[DeviceView], now_s: float) -> Plan:
        views = {d.device_id: d for d in devices}
        wanted: list[GrantTarget] = []
        current: dict[str, Grant] = {}
        demand_pct: dict[str, float] = {}
        # each device's grants by application, in the view's order: one pass per device instead of
        # one per recommendation (a device with hundreds of applications is planned in linear time)
        by_app: dict[str, dict[str, list[Grant]]] = {}
        for rec in recommendations:
            view = views.get(rec.device_id)
            if view is None or not (math.isfinite(rec.memory_mib) and math.isfinite(rec.sm_pct)):
                continue
            demand_pct[rec.device_id] = demand_pct.get(rec.device_id, 0.0) + max(0.0, rec.sm_pct)
            index = by_app.get(rec.device_id)
            if index is None:
                index = by_app[rec.device_id] = {}
                for g in view.grants:
                    index.setdefault(g.app_id, []).append(g)
            mine = index.get(rec.app_id, [])
            if not mine:
                wanted.append(GrantTarget(rec.app_id, rec.device_id, rec.memory_mib, min(100.0, rec.sm_pct), None, "new"))
                continue
            managed = max(mine, key=lambda g: g.created_at_s)
            other_mem = sum(g.memory_mib for g in mine if g is not managed)
            other_sm = sum(g.sm_pct for g in mine if g is not managed)
            mem = max(0.0, rec.memory_mib - other_mem)
            sm = min(100.0, max(0.0, rec.sm_pct - other_sm))
            if managed.source == "request":
                mem, sm = max(mem, managed.memory_mib), max(sm, managed.sm_pct)
            current[managed.grant_id] = managed
            wanted.append(GrantTarget(rec.app_id, rec.device_id, mem, sm, managed.grant_id, "forecast"))
        grants = [
            t
            for t in self._fair_share_sm(wanted, views)
            if t.grant_id is None
            or not self._small(current[t.grant_id].memory_mib, t.memory_mib, current[t.grant_id].sm_pct, t.sm_pct)
        ]
        power: list[PowerTarget] = []
        if self.manage_power:
            for device_id, pct in demand_pct.items():
                target = self._power_target(views[device_id], pct)
                if target is not None:
                    power.append(target)
        return Plan(grants=tuple(grants), power=tuple(power))

    @staticmethod
    def _fair_share_sm(targets: list[GrantTarget], views: dict[str, DeviceView]) -> list[GrantTarget]:
        """When a device's wanted SM shares add up to more than it has, scale them down in proportion
        (grants of applications without a recommendation keep theirs), so every application gets a
        share instead of the first ones taking everything."""
        out = list(targets)
        for device_id, view in views.items():
            idx = [i for i, t in enumerate(out) if t.device_id == device_id]
            if not idx:
                continue
            planned = {out[i].grant_id for i in idx}
            fixed = sum(g.sm_pct for g in view.grants if g.grant_id not in planned)
            want = sum(out[i].sm_pct for i in idx)
            room = max(0.0, view.sm_total_pct - fixed)
            if want > room + 1e-9 and want > 0:
                scale = room / want
                for i in idx:
                    t = out[i]
                    out[i] = GrantTarget(t.app_id, t.device_id, t.memory_mib, t.sm_pct * scale, t.grant_id,
                                         (t.reason + ", " if t.reason else "") + f"SM fair share x{scale:.2f}")
        return out

    def _power_target(self, view: DeviceView, demand_pct: float) -> PowerTarget | None:
        c = view.power_constraints
        if c is None or not view.power_enabled or view.power_limit_mw is None or c.max_mw <= c.min_mw:
            return None
        frac = min(1.0, max(0.0, demand_pct / view.sm_total_pct * self.power_headroom))
        raw = c.min_mw + (c.max_mw - c.min_mw) * frac
        step = max(1, self.power_step_mw)
        target = int(min(c.max_mw, max(c.min_mw, round(raw / step) * step)))
        if abs(target - view.power_limit_mw) < self.power_hysteresis_frac * (c.max_mw - c.min_mw):
            return None
        return PowerTarget(view.device_id, target, f"SM demand {demand_pct:.0f} %")


@dataclass(frozen=True)
class Sizing:
    memory_mib: float
    sm_pct: float
    reason: str = ""


class Sizer(Protocol):
    """Cold-start sizing (vgpu.manager.coldstart): a job with no history -> initial grant."""

    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        """Raises `InvalidJobConfig` when the job says too little to be sized."""
        ...


class SkippedReport(Protocol):
    """What the manager reads back from applying its recommendations."""

    @property
    def skipped(self) -> Sequence[str]: ...


class RecommendationSink(Protocol):
    """Where the manager sends its recommendations: the `Allocator`, or a stand-in in a benchmark.

    The manager depends on this interface, not on the allocator, so that recommending stays apart
    from acting."""

    def apply_recommendations(self, recommendations: Sequence[Recommendation]) -> SkippedReport: ...

    def forget_app(self, app_id: str) -> Sequence[Grant]: ...
