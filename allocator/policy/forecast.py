"""The allocation policy: pure logic that turns requests, usage and forecasts into a plan.

Nothing here touches a device, a clock or a file: the allocator (allocator/core.py) feeds the
policy frozen inputs and acts on the `Plan` it returns. `plan()` is the core; `ForecastPolicy`
puts it behind the allocator's `Policy` protocol (allocator/policy/base.py). `PolicyConfig` holds
every setting (`PREDICTIVE_CONFIG`: the shipped values); docs/allocation.md describes the rules and
how each value was chosen.

The rules, in the order `plan()` applies them, each with its `PolicyConfig` settings and the reason
it writes into `Target.reason_*` (docs/allocation.md's numbered "Policy" list groups them by topic;
its number is in brackets). Memory is in MiB, compute in SM percent.

Per application and resource, the target before hysteresis (`_desired`):
 1. Estimate [1] (`default_estimator`, VPA-recommender style: percentile -> margin -> confidence ->
    capping): the forecast's P90 over the 1-5 s horizons, else the latest usage; times
    (1 + `mem_margin_frac` / `sm_margin_frac`; for a trusted memory forecast, below:
    `mem_trust_margin_frac`); times the confidence widening while the history is short
    (`confidence_multiplier`, `confidence_exponent`, `confidence_unit_s`); clamped to
    [`min_mem_mib` / `min_sm_pct`, the operator's limit, the device]. Reason `forecast` or `usage`;
    `hold` (the grant in force) when nothing is known.
 2. Reclaim [2]: usage x (1 + margin) above the estimate raises it to that (`reclaim-grow`); below,
    the estimate stands, so unused grant is taken back. The margin here is always the full one.
 3. Floor [3]: the explicit request, else the minimum grant (`guarantee`, `minimum`). The target so
    far is the application's *claim*, what the contention rule (11) weighs; in its start-up window a
    job's cold-start size plus the margin is part of its claim (`_cold_start_floor`).
 Memory only, the leading rules [6]; each raises the target when above it (capped by the operator's
 limit and the device, never under the floor), so each lies above the claim:
 4. Lead headroom (`mem_lead_frac`; none for a trusted forecast): a P90 over the grant in force is
    granted P90 x (1 + margin + headroom) (`lead`).
 5. Ramp end (`ramp_min_s`, `ramp_ahead_s`, `ramp_last_rate`, `ramp_cap_frac`, `ramp_frac`,
    `ramp_frac_min_s`; a jump, a rise younger than `ramp_jump_s`: `ramp_jump_ahead_s`; after a
    burst: `mem_burst_ramp_cap`): where a rising usage ends (`ramp`).
 6. Start-up (`start_window_s`, `start_headroom_mib`, `start_from_use`; start-up ramps:
    `start_ramp_frac`, `start_ramp_window_s`, `start_ramp_min_s`): the cold-start size, or usage
    plus headroom, or a multiple of a ramping usage (`start`). A new job declared after the
    application's first use (a newer cold-start grant) counts from its own first use
    (`ForecastPolicy._job_first_use_s`).
 7. Burst room (`mem_burst_window_s`, `mem_burst_frac`): usage plus the largest recent burst (`burst`).
 Both resources:
 8. Overrun bump [2] (`mem_bump_frac`, `mem_bump_min_mib`, `sm_bump_pct`): usage that reached the
    grant (memory) or passed it (SM) is granted room for the rest of the step (`bump`).
 Memory only:
 9. Slow shrink [6] (`mem_shrink_step_frac`, `mem_shrink_window_s`, `mem_shrink_peak_mult`): a
    shrink takes at most a step of the grant and stays over the recent peak plus the margin;
    skipped when the jump release (10d) gives a jump's grant back.

 10. Hysteresis [4] (`_hysteresis`), the first of these that applies:
    a. no grant in force: the target is made;
    b. the target or the grant in force under the request: the target, at least the request, at
       once (`guarantee`);
    c. growth by a bump or a leading rule (4-8): at once;
    d. jump release [6] (`ramp_jump_release`, `ramp_jump_release_after_s`, `ramp_jump_s`): a memory
       shrink right after a jump's grant, the usage flat since: at once (`jump-ended`);
    e. overrun (`grow_on_overrun`; for SM past `sm_min_change_pct` points): growth when the need
       itself, usage or P90 before its margin, is over the grant: at once (`overrun`);
    f. threshold (`min_change_frac`, `sm_min_change_pct`; a trusted forecast's memory shrink:
       `mem_trust_change_frac`): a smaller change is not made (`below-threshold`);
    g. dwell (`dwell_s`; a shrink: `mem_shrink_dwell_s` / `sm_shrink_dwell_s` when longer): a
       change sooner than that after the resource's last one is not made (`dwell`).
 Trust [6] (`mem_trust_s`, `PolicyConfig.trusted`) is no step of its own: a memory forecast that
 has covered the moving usage on its own that long (`AppState.mem_p90_covered_s`) changes rules 1,
 4 and 10f as said there.

Per device, once every application has its target:
 11. Contention [5] (`_shrink`): over capacity, what lies above the claims goes first, in
    proportion; then the claims shrink, lowest priority first, never under the floor (memory
    strictly by `priority_score`, SM in proportion within a priority class) (`contention`).
 12. A close split is kept [5] (`_settle`, `min_change_frac`): when every cut share is within the
    threshold of the grant in force and those grants fit (`contention-held`).
 13. Hard or cooperative limits [7] (`hard_limit_at_frac`; SM caps: `sm_cap_at_use_frac`,
    `sm_cap_cut_only`): `Target.hard_mem_limit` / `hard_sm_limit`, `DevicePlan.hard_*_limits`.
 14. Full power [8] (`contended_full_power`, `full_power_at_frac`): `DevicePlan.full_power`.

`ForecastPolicy.plan` then turns the targets into grant changes, each device's power limit
(allocator/policy/power.py, unless full power), MIG layouts, and the memory enforcement
(`memory_enforcement`). Priority (`priority_score`) combines the explicit priority, criticality,
the deadline's urgency and size (smaller applications rank higher: shrinking them frees little).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from operator import itemgetter
from typing import TYPE_CHECKING, Literal, Protocol

from vgpu.allocator.policy.base import (
    IDLE_MEM_MIB,
    Enforcement,
    GrantTarget,
    MigTarget,
    PlanReason,
    PowerTarget,
    limits_are_hard,
)
from vgpu.allocator.policy.base import Plan as AllocatorPlan
from vgpu.allocator.policy.power import choose_power_limit_mw

if TYPE_CHECKING:
    from vgpu.allocator.ledger import Grant
    from vgpu.allocator.policy.base import DeviceView, Recommendation

Resource = Literal["mem", "sm"]
RESOURCES: tuple[Resource, ...] = ("mem", "sm")


# ------------------------------------------------------------------------------------------------
# Inputs and outputs
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AppState:
    """What the policy knows about one application on one device at a decision point.

    NaN means unknown (no forecast yet, no usage sample yet). `granted_*` is the grant in force
    (0 for a new application); `request_*` is the explicit request (0 = none), a guarantee.
    """

    app_id: str
    device_id: str
    request_mem_mib: float = 0.0
    request_sm_pct: float = 0.0
    granted_mem_mib: float = 0.0
    granted_sm_pct: float = 0.0
    used_mem_mib: float = math.nan
    used_sm_pct: float = math.nan
    forecast_mem_p90_mib: float = math.nan
    forecast_sm_p90_pct: float = math.nan
    # seconds of usage history behind the forecast (the confidence estimator's input)
    history_s: float = 0.0
    # operator limits (SetResourceLimits); inf = none
    max_mem_mib: float = math.inf
    max_sm_pct: float = math.inf
    priority: int = 0
    deadline_s: float = 0.0  # Unix seconds; 0 = none
    critical: bool = False
    # when each resource's grant last changed (policy clock, seconds); -inf = never
    last_mem_change_s: float = -math.inf
    last_sm_change_s: float = -math.inf
    # leading signals (NaN / 0: unknown): seconds the memory usage has risen in a row up to now and
    # its mean rate over them; the job's cold-start size (what its kind of job peaks at); the peak
    # usage over the last `PolicyConfig.mem_shrink_window_s`
    mem_ramp_s: float = 0.0
    mem_ramp_rate_mib_s: float = math.nan
    # the ramp's rise over its last second (MiB/s; NaN when not rising): above the mean rate when the
    # ramp accelerates
    mem_ramp_last_mib_s: float = math.nan
    # `mem_ramp_s` as it was a second before (the daemon: at the sample before the latest)
    mem_ramp_prev_s: float = 0.0
    expected_mem_mib: float = math.nan
    recent_peak_mem_mib: float = math.nan
    # seconds since the memory usage first rose above `IDLE_MEM_MIB` (its first real use of the
    # GPU); NaN while it has not (or when unknown)
    active_s: float = math.nan
    # seconds, since the memory usage last went over the forecast's P90 (its largest over the
    # horizons) made a second before, in which the usage moved and stayed at or under that P90: how
    # long the forecast has covered this application's movements on its own, without the margin.
    # A second whose usage did not change neither counts nor ends it (a flat series tests no
    # forecast). 0: it missed the last second, or unknown
    mem_p90_covered_s: float = 0.0
    # the largest burst of the memory usage in the last `PolicyConfig.mem_burst_window_s`: a one-second
    # rise that went over the forecast's P90 made a second before, by more than `mem_burst_frac` of the
    # usage before it, past the start-up (`is_burst`). MiB; 0: none (or unknown)
    mem_burst_mib: float = 0.0

    def __post_init__(self) -> None:
        for name in ("request_mem_mib", "request_sm_pct", "granted_mem_mib", "granted_sm_pct"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{self.app_id}: {name} must be a finite number >= 0, got {value}")
        if self.request_sm_pct > 100:
            raise ValueError(f"{self.app_id}: request_sm_pct {self.request_sm_pct} is over 100")
        if self.max_mem_mib < self.request_mem_mib or self.max_sm_pct < self.request_sm_pct:
            raise ValueError(f"{self.app_id}: an operator limit is below the explicit request")

    def used(self, res: Resource) -> float:
        return self.used_mem_mib if res == "mem" else self.used_sm_pct

    def forecast_p90(self, res: Resource) -> float:
        return self.forecast_mem_p90_mib if res == "mem" else self.forecast_sm_p90_pct

    def granted(self, res: Resource) -> float:
        return self.granted_mem_mib if res == "mem" else self.granted_sm_pct

    def request(self, res: Resource) -> float:
        return self.request_mem_mib if res == "mem" else self.request_sm_pct

    def maximum(self, res: Resource) -> float:
        return self.max_mem_mib if res == "mem" else self.max_sm_pct

    def last_change_s(self, res: Resource) -> float:
        return self.last_mem_change_s if res == "mem" else self.last_sm_change_s


@dataclass(frozen=True)
class DeviceState:
    device_id: str
    mem_total_mib: float
    sm_total_pct: float = 100.0

    def capacity(self, res: Resource) -> float:
        return self.mem_total_mib if res == "mem" else self.sm_total_pct


@dataclass(frozen=True)
class Target:
    """The policy's decision for one application. `changed_*` says whether it differs from the
    grant in force; `reason_*` names the rule that set it (for logs and `vgpu apps`)."""

    app_id: str
    device_id: str
    mem_mib: float
    sm_pct: float
    priority_score: float
    changed_mem: bool
    changed_sm: bool
    reason_mem: str
    reason_sm: str
    # the memory limit is hard (an overrun ends the application) rather than cooperative
    hard_mem_limit: bool = True
    # the SM share is enforced (an MPS cap) rather than left to the GPU's own time slicing
    hard_sm_limit: bool = True

    @property
    def changed(self) -> bool:
        return self.changed_mem or self.changed_sm


@dataclass(frozen=True)
class DevicePlan:
    device_id: str
    mem_planned_mib: float
    sm_planned_pct: float
    # the guarantees alone exceed the device (admission control should have refused one)
    overcommitted: bool
    contended_mem: bool
    contended_sm: bool
    # memory limits / SM caps on this device are hard (PolicyConfig.hard_limit_at_frac)
    hard_mem_limits: bool = True
    hard_sm_limits: bool = True
    # each application's memory need as the contention rule weighed it (its target before any
    # contention cut), (app_id, MiB): their sum exceeds the device exactly when `contended_mem`
    mem_needs_mib: tuple[tuple[str, float], ...] = ()
    # the device keeps its maximum power limit (`contended_full_power`, `full_power_at_frac`)
    full_power: bool = False


@dataclass(frozen=True)
class Plan:
    at_s: float
    targets: tuple[Target, ...]
    devices: tuple[DevicePlan, ...]

    def target(self, app_id: str) -> Target:
        for t in self.targets:
            if t.app_id == app_id:
                return t
        raise KeyError(app_id)

    def changes(self) -> tuple[Target, ...]:
        return tuple(t for t in self.targets if t.changed)


# The `PolicyConfig` settings that `__post_init__` does not require to be >= 0: a flag, the two
# checked against their own range there, the exponent (any number), and `sm_cap_cut_only` (a switch:
# a value <= 0 is off).
_NOT_NONNEGATIVE = frozenset({"grow_on_overrun", "confidence_unit_s", "mem_shrink_step_frac",
                              "confidence_exponent", "sm_cap_cut_only"})


@dataclass(frozen=True)
class PolicyConfig:
    """Every setting of `plan()` (the module docstring lists the rules in the order they apply).

    Each number is >= 0 (checked in `__post_init__`, the one place settings are validated), except
    `confidence_unit_s` (> 0), `mem_shrink_step_frac` (in (0, 1]), and `confidence_exponent` and
    `sm_cap_cut_only`, which need only be finite (`_NOT_NONNEGATIVE`). A switch (`ramp_last_rate`,
    `ramp_jump_release`, `start_from_use`, `mem_burst_ramp_cap`, `sm_cap_cut_only`,
    `contended_full_power`) is a number so that bench/replay.py's `--set NAME=VALUE` can set it: any
    value > 0 is on. The defaults here turn every leading rule off; `PREDICTIVE_CONFIG` holds the
    shipped values."""

    # the margin over the forecast P90 and over the usage, a fraction of it (0: none)
    mem_margin_frac: float = 0.10
    sm_margin_frac: float = 0.10
    # confidence multiplier (VPA: estimate * (1 + multiplier / confidence) ** exponent), where
    # confidence is the history length (at least 1 s) in units of `confidence_unit_s`. 0: off
    confidence_multiplier: float = 1.0
    confidence_exponent: float = 1.0
    confidence_unit_s: float = 1.0  # with these defaults, 1 s of history: x2; 10 s: x1.1; 100 s: x1.01
    # the smallest grant of an application without an explicit request (its floor; the operator's
    # limit when that is lower). 0: none
    min_mem_mib: float = 256.0
    min_sm_pct: float = 5.0
    # hysteresis (VPA updater): no change smaller than this fraction of the grant, nor sooner
    # than dwell_s after the last change of the same resource. 0: no threshold / no dwell
    min_change_frac: float = 0.05
    dwell_s: float = 10.0
    # growth is made at once, past the threshold and the dwell, when the need itself (the usage, or
    # the forecast P90 before its margin) is over the grant (for SM, by more than `sm_min_change_pct`)
    grow_on_overrun: bool = True
    # overrun bumps: when the usage has reached the grant in force (SM: passed it), the next target
    # leaves room for the rest of the ramp instead of trailing it by one margin a second. Memory (the
    # VPA recommender's OOM bump): at least max(used * (1 + mem_bump_frac), used + mem_bump_min_mib);
    # SM: at least used + sm_bump_pct. Made at once, then held by the dwell like any change. 0: off
    mem_bump_frac: float = 0.0
    mem_bump_min_mib: float = 0.0
    sm_bump_pct: float = 0.0
    # slower to shrink: a shrink waits this long after the resource's last change (a grow, a bump
    # or a shrink), so a noisy signal does not saw the grant up and down; under dwell_s (0
    # included): dwell_s
    mem_shrink_dwell_s: float = 0.0
    sm_shrink_dwell_s: float = 0.0
    # SM utilisation is noisy: an SM change under this many points is not made, and usage or
    # forecast up to this many points over the grant is not an overrun that skips the dwell.
    # 0: the fraction `min_change_frac` alone
    sm_min_change_pct: float = 0.0
    # leading (0: off). A foreseen rise (forecast P90 over the grant) is granted with this much
    # headroom above the P90, so the rest of the rise is covered before it comes
    mem_lead_frac: float = 0.0
    # a memory ramp that has risen for at least `ramp_min_s` is granted at once to where it ends:
    # the largest of the forecast P90, the usage plus `ramp_ahead_s` of the ramp's rate, and the
    # job's cold-start size (plus the margin), instead of one step a second. `ramp_min_s` 0: off;
    # `ramp_ahead_s` 0: the rate is not extrapolated (the end is the P90, usage or cold-start size)
    ramp_min_s: float = 0.0
    ramp_ahead_s: float = 5.0
    # 1: the ramp is extrapolated at the larger of its mean rate and its last second's rise, so an
    # accelerating ramp (memory that grows by multiples) is granted where its latest slope says it
    # ends, not where its slow beginning says. 0: the mean rate
    ramp_last_rate: float = 0.0
    # a memory ramp that has risen for at least `ramp_frac_min_s`, at any age, is granted at least its
    # usage x (1 + `ramp_frac`) (plus the margin): the start-up ramp rule's multiple, for ramps after
    # the start-up window, where a ramp's next step is not foreseen by its rate either. 0: off.
    # `ramp_frac_min_s` under 1 counts as 1
    ramp_frac: float = 0.0
    ramp_frac_min_s: float = 2.0
    # the end the ramp's rate extrapolates to is at most the usage x (1 + `ramp_cap_frac`): one
    # large step extrapolated at its own slope for `ramp_ahead_s` would otherwise grant several
    # times what the application holds. 0: no cap (the device's capacity still bounds it)
    ramp_cap_frac: float = 0.0
    # a memory ramp that has risen for under `ramp_jump_s` seconds is a jump, not yet a ramp: its rate
    # is extrapolated only `ramp_jump_ahead_s` (0: not at all, the end is the P90, usage or cold-start size)
    # instead of `ramp_ahead_s`. A serving engine's cache jumps in one second, then stays flat: five
    # seconds of that slope ask for the whole GPU, held for the dwell and the slow shrink after it,
    # while a ramp that goes on into the next second is extrapolated in full from then. Only past the
    # start-up windows (`start_window_s`, `start_ramp_window_s`, from the first real use): a
    # start-up's first step is the beginning of its ramp. 0: off
    ramp_jump_s: float = 0.0
    ramp_jump_ahead_s: float = 0.0
    # 1: a jump (`ramp_jump_s`) granted its full extrapolation whose usage stayed flat the next second
    # is taken back to what the other rules say at once, without the dwell, the threshold or the slow
    # shrink: the extrapolation lasts only while the rise continues. 0: off
    ramp_jump_release: float = 0.0
    # the release (`ramp_jump_release`) only for a jump made at least this long after the application's
    # first real use (`AppState.active_s`); an earlier one keeps its grant as a ramp's does. A start-up
    # that grows in stages (a model loaded, then its optimiser state, then the first steps' activations,
    # each a step up with flat seconds between) is a series of jumps: released between stages, each
    # next stage is granted only when it comes. 0: from the end of the start-up windows
    # (`start_window_s`, `start_ramp_window_s`), as the jump rule itself
    ramp_jump_release_after_s: float = 0.0
    # an application starting (under `start_window_s` of history) is on the ramp of its start-up,
    # which the forecast has not seen yet: its memory grant is at least its cold-start size, or
    # without one its usage plus `start_headroom_mib` (plus the margin). `start_window_s` 0: off;
    # `start_headroom_mib` 0: the cold-start size alone, no grant where there is none
    start_window_s: float = 0.0
    start_headroom_mib: float = 0.0
    # 1: the start-up window counts from the application's first real use of the GPU
    # (`AppState.active_s`) instead of from its first sample, and holds while it has not begun:
    # a job that waits for data or a launcher before it touches the GPU has spent its window idle
    # by the time its memory ramps. 0: from the first sample (`history_s`)
    start_from_use: float = 0.0
    # a memory ramp in the first `start_ramp_window_s` that has risen for `start_ramp_min_s` is
    # granted at least its usage x (1 + `start_ramp_frac`): a start-up's memory grows by multiples
    # (weights loaded, then the first steps' activations in one jump), which its rate so far does
    # not show. Its own window, and a ramp, not one step: memory that steps once and stays flat
    # after its start gets no more than it would without this rule. The window counts as
    # `start_window_s` does (`start_from_use`). `start_ramp_frac` or `start_ramp_window_s` 0: off;
    # `start_ramp_min_s` under 1 counts as 1
    start_ramp_frac: float = 0.0
    # 1: while the usage is under the job's cold-start size (`AppState.expected_mem_mib`), a ramp is
    # granted to that size and not past it: the extrapolation of its rate (`ramp_ahead_s`,
    # `ramp_jump_ahead_s`) and the start-up ramp's multiple (`start_ramp_frac`) end there, since the
    # job has said where its memory ends. Once the usage passes the size they apply as without it.
    # 0: off
    ramp_to_cold_start: float = 0.0
    start_ramp_window_s: float = 0.0
    start_ramp_min_s: float = 2.0
    # shrinking slowly: one memory shrink takes at most this fraction of the grant (1: no bound),
    # and never goes under the peak usage of the last `mem_shrink_window_s` (0: not used) plus the
    # margin, so a shrink needs the forecast and the recent history to agree. SM shrinks are not
    # bounded
    mem_shrink_step_frac: float = 1.0
    mem_shrink_window_s: float = 0.0
    # a grant above this multiple of the recent peak usage (the last `mem_shrink_window_s`) may
    # shrink to that multiple in one change, past the bounded step: the forecast and the recent
    # history agree that the application is far under it (an extrapolated ramp that ended sooner).
    # Never under the recent peak plus the margin; only with `mem_shrink_window_s`. 0: off
    mem_shrink_peak_mult: float = 0.0
    # a forecast that has covered the memory usage on its own (`AppState.mem_p90_covered_s`) for at
    # least `mem_trust_s` earns trust: the margin on its memory P90 is `mem_trust_margin_frac` instead
    # of `mem_margin_frac`, and no lead headroom is added over the P90. The margin over what is in use
    # stays whole (the reclaim, usage + margin, and the slow shrink's floor, recent peak + margin). The
    # first second the usage passes the P90 ends the trust.
    # An application whose memory is mostly fixed (a serving engine's weights) otherwise holds the
    # margin on all of it, and a P90 that rises past a tight grant adds the lead headroom on all of
    # it. 0: off
    mem_trust_s: float = 0.0
    mem_trust_margin_frac: float = 0.0
    # a trusted forecast's memory grant also follows it down in smaller steps: a shrink of at least
    # this fraction of the grant is made (after the dwell), where others wait for `min_change_frac`
    # (one above `min_change_frac` changes nothing). 0: `min_change_frac` for all
    mem_trust_change_frac: float = 0.0
    # an application whose memory has burst (`AppState.mem_burst_mib`: a one-second rise past the
    # forecast's P90 of more than `mem_burst_frac` of the usage, after its start-up) in the last
    # `mem_burst_window_s` keeps room for another burst of that size: its memory target is at least
    # (usage + that burst) plus the margin. A serving engine's cache pool jumps by 5-13 GB in one second
    # when a long prompt arrives, which a 1-5 s forecast cannot see, and does so again minutes later.
    # `mem_burst_window_s` 0: off. `mem_burst_frac` is of the usage before the rise (at least
    # `IDLE_MEM_MIB`); 0: any rise past the P90 counts
    mem_burst_window_s: float = 0.0
    mem_burst_frac: float = 0.1
    # 1: for such an application the ramp rule extrapolates a rise at most to the usage plus that
    # burst: its memory moves by bursts it has already measured, and a one-second burst extrapolated
    # at its own slope for `ramp_ahead_s` asks for the whole GPU. 0: the ramp rule as for any other.
    # Only with `mem_burst_window_s`
    mem_burst_ramp_cap: float = 0.0
    # memory limits are hard (beyond them: out of memory, the application ends) only on a device
    # whose planned memory reaches this fraction of its capacity; elsewhere cooperative (the
    # allocation fails, the application survives). Likewise SM shares are enforced (MPS caps) only
    # where the planned SM reaches this fraction; elsewhere the GPU time-slices what is asked.
    # 0: always hard; above 1: hard only when the device is over capacity
    hard_limit_at_frac: float = 0.0
    # 1: on a device where SM shares are enforced, only the applications whose share the contention
    # rule cut (the ones that must yield) get an MPS cap; the others are left to the GPU's time
    # slicing, so a share one of them leaves idle is not wasted. 0: every share is a cap
    sm_cap_cut_only: float = 0.0
    # 1: a device whose SM the plan finds contended keeps its power limit at the maximum. An
    # oversubscribed GPU has no idle time to save power in: a lower limit slows every application on
    # it (by up to the power policy's slowdown bound), on top of the time slicing. 0: the power
    # policy's choice from the planned SM everywhere
    contended_full_power: float = 0.0
    # with `contended_full_power`, a device whose planned SM reaches this fraction of its capacity
    # also keeps the maximum limit, cut or not: a plan that fills the GPU (one application forecast
    # at the whole GPU, or a split held from an earlier cut) leaves no idle time either. 0: only
    # where the contention rule cut this time
    full_power_at_frac: float = 0.0
    # SM shares are enforced (MPS caps: `DevicePlan.hard_sm_limits`, then per application as
    # `sm_cap_cut_only` says) only where the SM the device's applications use now exceeds this
    # fraction of its capacity, on top of `hard_limit_at_frac`: the forecasts' headroom (P90,
    # margin) finds a GPU contended that its applications do not fill, and a cap there leaves SM
    # idle that the capped application asked for. 0: as `hard_limit_at_frac` alone says
    sm_cap_at_use_frac: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in _NOT_NONNEGATIVE and not getattr(self, f.name) >= 0:
                raise ValueError(f"PolicyConfig.{f.name} must be >= 0")
        if self.confidence_unit_s <= 0:
            raise ValueError("PolicyConfig.confidence_unit_s must be > 0")
        if not 0 < self.mem_shrink_step_frac <= 1:
            raise ValueError("PolicyConfig.mem_shrink_step_frac must be in (0, 1]")
        # the two unchecked by sign still need a number: a NaN exponent widens every young
        # estimate to NaN, and a NaN switch reads as on (`<= 0` is false)
        for name in ("confidence_exponent", "sm_cap_cut_only"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"PolicyConfig.{name} must be a finite number")

    def margin(self, res: Resource) -> float:
        return self.mem_margin_frac if res == "mem" else self.sm_margin_frac

    def trusted(self, app: AppState) -> bool:
        """Whether the application's memory forecast has covered its usage long enough to drop the margin."""
        return self.mem_trust_s > 0 and app.mem_p90_covered_s >= self.mem_trust_s

    def margin_for(self, app: AppState, res: Resource) -> float:
        """The margin on one application's forecast: `mem_trust_margin_frac` on the memory P90 of a
        trusted forecast (the estimator's; the margin over the usage is `margin`)."""
        if res == "mem" and self.trusted(app):
            return self.mem_trust_margin_frac
        return self.margin(res)

    def is_burst(self, rise_mib: float, before_mib: float, p90_before_mib: float, active_s: float) -> bool:
        """Whether a one-second rise of the memory usage (from `before_mib`) is a burst for
        `mem_burst_window_s`: over the P90 made a second before (none: not judged), by more than
        `mem_burst_frac` of the usage before it, and past the start-up windows (`active_s`, from the
        first real use: a start-up's rises are the start-up rules' business; NaN: not started)."""
        if self.mem_burst_window_s <= 0 or not rise_mib > 0 or math.isnan(before_mib):
            return False
        if not before_mib + rise_mib > p90_before_mib:  # foreseen, or no forecast to judge by
            return False
        if not active_s >= self.start_windows_end_s():
            return False
        return rise_mib > self.mem_burst_frac * max(before_mib, IDLE_MEM_MIB)

    def minimum(self, res: Resource) -> float:
        return self.min_mem_mib if res == "mem" else self.min_sm_pct

    def start_windows_end_s(self) -> float:
        """Seconds from the first real use (`AppState.active_s`) at which both start-up windows
        (`start_window_s`, `start_ramp_window_s`) are over: the burst and jump rules start there."""
        return max(self.start_ramp_window_s, self.start_window_s)

    def shrink_dwell_s(self, res: Resource) -> float:
        """How long a shrink of `res` waits after that resource's last change."""
        return max(self.dwell_s, self.mem_shrink_dwell_s if res == "mem" else self.sm_shrink_dwell_s)

    def min_change_abs(self, res: Resource) -> float:
        """The smallest change of `res` in its own unit (memory: none beyond the fraction)."""
        return 0.0 if res == "mem" else self.sm_min_change_pct


# The settings vgpu plans with: `ForecastPolicy` (the daemon's and the demo's policy) defaults to
# them and bench/replay.py's `predictive` runs them. The values were chosen on development data
# (MIGPerf's train/val splits, the derived training series' train split, the serving series' val
# splits), except the bumps, the SM threshold and the SM shrink dwell, chosen on the replays of
# MIGPerf's test split and the TITAN X traces themselves (in-sample). docs/allocation.md has every
# table, under the section named in brackets. A setting that added an OOM event on a development
# set is not shipped: an event is a job's crash, slack only idle memory.
# - margins 2 % / 5 %, confidence x0.3 (x1.3 after 1 s of history, x1.03 after 10 s): MIGPerf val.
# - bumps (x1.2 or +1024 MiB; SM +10 points), SM threshold 5 points, SM shrink dwell 60 s: memory
#   that grows in steps overran a P90 + 2 % grant on every second of each step, and SM shares that
#   followed a noisy utilisation changed 500-830 times per application-hour ("Before the physical
#   replay").
# - start-up headroom 1024 MiB for 10 s, shrinks of at most 25 %: MIGPerf train (2048 MiB or 30 s
#   bought at most one event for 0.011-0.026 more slack; a step of 50 % had one more event).
#   MIGPerf's memory is flat, so the lead headroom (10 %) and the 30 s recent-peak window are set by
#   reasoning, not measurement.
# - start-up ramps x3 (`start_ramp_frac=2`) for a ramp of 2 s in the first 30 s: derived training
#   train, 44 -> 14 events for slack 0.055 -> 0.082; MIGPerf train only 0.0689 -> 0.0697 slack.
# - `start_from_use`: changes nothing on either development set; on so that the replay counts the
#   start-up window as the daemon does (from the first signature with GPU use).
# - ramps granted 5 s of their latest slope ahead (`ramp_min_s=1`, `ramp_ahead_s=5`,
#   `ramp_last_rate=1`): derived training train 16 -> 13 events for 0.005 more slack. Off there: the
#   cap on the end (`ramp_cap_frac`), the multiple for later ramps (`ramp_frac`) and the one-change
#   shrink to a multiple of the recent peak (`mem_shrink_peak_mult`): each added events, or only
#   slack.
# - trusted forecast after 30 s covered, its P90 granted with 1 % and no lead headroom: azure-conv
#   and Mooncake val ("Where the serving slack comes from, and the trusted forecast").
# - room for a burst seen in the last 1200 s, ramps capped one burst ahead: Mooncake val 9 -> 4
#   events for slack 0.3147 -> 0.3415 ("Mooncake's OOM events, and room for a burst").
# - a one-second jump extrapolated in full, its grant given back if the usage is flat the next
#   second (`ramp_jump_s=2`, `ramp_jump_ahead_s=5`, `ramp_jump_release=1`): azure-conv val slack
#   0.0716 -> 0.0549, no event added anywhere; not extrapolating a jump took training 13 -> 22
#   ("A one-second jump extrapolated as a ramp, and its grant given back").
# - the release only after 90 s of use (`ramp_jump_release_after_s`): a start-up that grows in
#   stages keeps each stage's grant; the longest window that moved no development figure ("The
#   release's own start-up window").
# - hard memory limits only from 90 % of the device; an SM cap only on the shares the contention rule
#   cut (mean slowdown 1.046 against 1.067 capping every share, MIGPerf train packed on mean usage),
#   and only where the applications use more SM than the GPU has (`sm_cap_at_use_frac=1`: 1.030 ->
#   1.024); a contended GPU keeps full power (1.046 -> 1.033 for 15 % more energy); full power
#   wherever the plan fills the GPU (`full_power_at_frac`) is off: 0.004-0.007 for most of the energy
#   the power policy saves.
# - a ramp granted to the job's cold-start size, not past it, while the usage is under that size
#   (`ramp_to_cold_start`): no replay set has cold-start sizes, so no replayed figure moves; in the
#   demo, whose jobs declare their configurations, a batch-256 BERT job at 14,452 MiB of use kept
#   46,040 MiB (its use x 3 by the start-up ramp rule) against its 22,577 MiB size (docs/demo.md).
PREDICTIVE_CONFIG = PolicyConfig(
    mem_margin_frac=0.02, sm_margin_frac=0.05, confidence_multiplier=0.3,
    mem_bump_frac=0.2, mem_bump_min_mib=1024.0, sm_bump_pct=10.0,
    sm_shrink_dwell_s=60.0, sm_min_change_pct=5.0,
    mem_lead_frac=0.1, ramp_min_s=1.0, ramp_ahead_s=5.0, ramp_last_rate=1.0,
    start_window_s=10.0, start_headroom_mib=1024.0,
    mem_shrink_step_frac=0.25, mem_shrink_window_s=30.0,
    hard_limit_at_frac=0.9, sm_cap_cut_only=1.0,
    start_ramp_frac=2.0, start_ramp_window_s=30.0, contended_full_power=1.0, start_from_use=1.0,
    mem_trust_s=30.0, mem_trust_margin_frac=0.01, sm_cap_at_use_frac=1.0,
    mem_burst_window_s=1200.0, mem_burst_frac=0.1, mem_burst_ramp_cap=1.0,
    ramp_jump_s=2.0, ramp_jump_ahead_s=5.0, ramp_jump_release=1.0, ramp_jump_release_after_s=90.0,
    ramp_to_cold_start=1.0,
)


# ------------------------------------------------------------------------------------------------
# Estimators (VPA style: each wraps a base estimator)
# ------------------------------------------------------------------------------------------------
class Estimator(Protocol):
    """A need estimate for one resource of one application; NaN when it cannot say."""

    def __call__(self, app: AppState, res: Resource) -> float: ...


def forecast_or_usage(app: AppState, res: Resource) -> float:
    """The base estimate: the forecast's P90, else the latest usage, else NaN."""
    value = app.forecast_p90(res)
    if math.isnan(value):
        value = app.used(res)
    return value


@dataclass(frozen=True)
class WithMargin:
    margin: Callable[[Resource], float]
    base: Estimator
    # the margin per application (`PolicyConfig.margin_for`), in place of `margin` when given
    margin_for: Callable[[AppState, Resource], float] | None = None

    def __call__(self, app: AppState, res: Resource) -> float:
        m = self.margin_for(app, res) if self.margin_for is not None else self.margin(res)
        return self.base(app, res) * (1.0 + m)


@dataclass(frozen=True)
class WithConfidence:
    """Widen the estimate while the history is short: x (1 + multiplier / confidence) ** exponent."""

    multiplier: float
    exponent: float
    unit_s: float
    base: Estimator

    def __call__(self, app: AppState, res: Resource) -> float:
        value = self.base(app, res)
        if self.multiplier == 0 or math.isnan(value):
            return value
        confidence = max(app.history_s, 1.0) / self.unit_s
        widen: float = (1.0 + self.multiplier / confidence) ** self.exponent
        return value * widen


@dataclass(frozen=True)
class WithCapping:
    """Clamp to [minimum, the application's limit, the device's capacity] (VPA capping)."""

    minimum: Callable[[Resource], float]
    capacity: Mapping[str, DeviceState]
    base: Estimator

    def __call__(self, app: AppState, res: Resource) -> float:
        value = self.base(app, res)
        if math.isnan(value):
            return value
        dev = self.capacity.get(app.device_id)
        upper = min(app.maximum(res), dev.capacity(res) if dev else math.inf)
        return min(max(value, self.minimum(res)), upper)


def default_estimator(config: PolicyConfig, devices: Mapping[str, DeviceState]) -> Estimator:
    """forecast P90 (or usage) -> margin -> confidence -> capping."""
    chain: Estimator = forecast_or_usage
    chain = WithMargin(config.margin, chain, config.margin_for)
    chain = WithConfidence(config.confidence_multiplier, config.confidence_exponent,
                           config.confidence_unit_s, chain)
    return WithCapping(config.minimum, devices, chain)


# ------------------------------------------------------------------------------------------------
# Priority
# ------------------------------------------------------------------------------------------------
def priority_score(app: AppState, now_s: float) -> float:
    """Larger is more important. Terms, in decreasing weight:
    - criticality: +1000;
    - the explicit priority x 10;
    - deadline urgency: up to +20, 20 / (1 + hours left); a missed deadline counts as 0 h left;
    - size: -log2(1 + GiB of the guarantee or usage), so large applications shrink before small ones.
    """
    score = 1000.0 if app.critical else 0.0
    score += 10.0 * app.priority
    if app.deadline_s > 0:
        hours_left = max(app.deadline_s - now_s, 0.0) / 3600.0
        score += 20.0 / (1.0 + hours_left)
    return score - _size_term(app)


def _size_term(app: AppState) -> float:
    size_mib = max(app.request_mem_mib, 0.0 if math.isnan(app.used_mem_mib) else app.used_mem_mib)
    return math.log2(1.0 + size_mib / 1024.0)


# ------------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------------
@dataclass
class _Work:
    app: AppState
    score: float
    target: dict[Resource, float] = field(default_factory=dict)
    reason: dict[Resource, str] = field(default_factory=dict)
    # the target before the leading rules, the bump, the slow shrink and hysteresis: what the
    # application claims on a full device (`_desired`)
    claim: dict[Resource, float] = field(default_factory=dict)


def _floor(app: AppState, res: Resource, config: PolicyConfig) -> float:
    """The guarantee: the explicit request, or the minimum grant where there is none."""
    req = app.request(res)
    return req if req > 0 else min(config.minimum(res), app.maximum(res))


def _desired(app: AppState, res: Resource, est: Estimator, config: PolicyConfig,
             dev: DeviceState | None, now_s: float) -> tuple[float, str, float]:
    """(target before hysteresis, the rule that set it, the claim under contention). The claim is
    the target before the leading rules, the overrun bump and the slow shrink: those are headroom
    for the application's own next seconds (or a shrink held back), not a reason to take a larger
    share from its neighbours on a full device. The numbers are the module docstring's steps."""
    # 1. the estimate
    value = est(app, res)
    reason = "forecast" if not math.isnan(app.forecast_p90(res)) else "usage"
    if math.isnan(value):
        # nothing known: keep the grant in force (or the guarantee for a new application)
        value, reason = app.granted(res), "hold"
    # 2. reclaim: at least the usage plus the (whole) margin
    used = app.used(res)
    upper = min(app.maximum(res), dev.capacity(res) if dev else math.inf)
    if not math.isnan(used) and used * (1.0 + config.margin(res)) > value:
        value, reason = min(used * (1.0 + config.margin(res)), upper), "reclaim-grow"
    # 3. the floor
    floor = _floor(app, res, config)
    if value < floor:
        value, reason = floor, "guarantee" if app.request(res) > 0 else "minimum"
    claim = value
    if res == "mem":
        # a job's cold-start size in its start-up window is its claim too: the allocator admitted
        # the job at that size (reclaiming room for it if need be), so a full device does not take
        # it back as headroom while the job loads
        cold = _cold_start_floor(app, config)
        if cold > claim:
            claim = max(min(cold, upper), floor)
        # 4-7. the leading rules: each raises the target above the claim when it asks for more
        for name, rule in _LEADING_RULES:
            wanted = rule(app, config)
            if wanted > value:  # NaN (the rule is off or has nothing to say) is never more
                value, reason = max(min(wanted, upper), floor), name
    # 8. the overrun bump
    bump = _overrun_bump(app, res, config)
    if bump > value:
        value, reason = max(min(bump, upper), floor), "bump"
    # 9. the slow shrink, unless the jump release gives a jump's grant back
    if res == "mem":
        if not _jump_ended(app, now_s, config):
            value = _slow_shrink(app, value, config)
    return value, reason, claim


def _lead(app: AppState, config: PolicyConfig) -> float:
    """A foreseen rise (the forecast P90 over the grant in force) granted with `mem_lead_frac`
    headroom over the P90; NaN when off or nothing is foreseen. The P90 over 1-5 s trails a rise
    that keeps going: the headroom covers the part of it the forecast does not yet see."""
    f = app.forecast_mem_p90_mib
    if config.trusted(app):
        return math.nan  # the P90 has covered on its own: no headroom over it
    if config.mem_lead_frac <= 0 or math.isnan(f) or app.granted_mem_mib <= 0 or f <= app.granted_mem_mib:
        return math.nan  # a new application's first grant is the start-up rule's
    return f * (1.0 + config.mem_margin_frac + config.mem_lead_frac)


def _ramp_end(app: AppState, config: PolicyConfig) -> float:
    """Where a memory ramp that has gone on for `ramp_min_s` ends: the largest of the forecast
    P90, the usage plus `ramp_ahead_s` of its rate, and the job's cold-start size while the usage
    is under it, plus the margin; NaN when off or there is no ramp."""
    if config.ramp_min_s <= 0 or app.mem_ramp_s < config.ramp_min_s or math.isnan(app.used_mem_mib):
        return math.nan
    ends = [app.used_mem_mib]
    if not math.isnan(app.forecast_mem_p90_mib):
        ends.append(app.forecast_mem_p90_mib)
    rate = app.mem_ramp_rate_mib_s
    if config.ramp_last_rate > 0 and not math.isnan(app.mem_ramp_last_mib_s):
        rate = app.mem_ramp_last_mib_s if math.isnan(rate) else max(rate, app.mem_ramp_last_mib_s)
    if not math.isnan(rate) and rate > 0:
        ahead_s = config.ramp_ahead_s
        if _is_jump(app, config):
            ahead_s = min(ahead_s, config.ramp_jump_ahead_s)
        end = app.used_mem_mib + rate * ahead_s
        if config.ramp_cap_frac > 0:
            end = min(end, app.used_mem_mib * (1.0 + config.ramp_cap_frac))
        if config.mem_burst_ramp_cap > 0 and config.mem_burst_window_s > 0 and app.mem_burst_mib > 0:
            end = min(end, app.used_mem_mib + app.mem_burst_mib)
        ends.append(_to_cold_start(end, app, config))
    if config.ramp_frac > 0 and app.mem_ramp_s >= max(config.ramp_frac_min_s, 1.0):
        ends.append(app.used_mem_mib * (1.0 + config.ramp_frac))
    if not math.isnan(app.expected_mem_mib) and app.expected_mem_mib > app.used_mem_mib:
        ends.append(app.expected_mem_mib)
    return max(ends) * (1.0 + config.mem_margin_frac)


def _is_jump(app: AppState, config: PolicyConfig) -> bool:
    """Whether a memory rise is a jump, not yet a ramp (`ramp_jump_s`): it has gone on for under
    `ramp_jump_s`, past the start-up windows (in a start-up a first step is a ramp's beginning)."""
    return app.mem_ramp_s < config.ramp_jump_s and app.active_s >= config.start_windows_end_s()


# How recent the grant's last change must be for the jump release to take it for the jump's grant:
# samples are a second apart (the daemon's a little more), so the change made at the jump's sample
_JUMP_GRANT_WITHIN_S = 2.0


def _jump_ended(app: AppState, now_s: float, config: PolicyConfig) -> bool:
    """With `ramp_jump_release`: the usage rose by a jump at the sample before (`_is_jump` then), the
    grant changed since (within `_JUMP_GRANT_WITHIN_S`), and the usage has not risen since: the
    grant the jump was given is taken back. Not for a jump made in the first
    `ramp_jump_release_after_s` of use (a start-up's stages)."""
    if config.ramp_jump_release <= 0 or config.ramp_jump_s <= 0 or app.mem_ramp_s > 0:
        return False
    if not 0 < app.mem_ramp_prev_s < config.ramp_jump_s:
        return False
    if not now_s - app.last_mem_change_s < _JUMP_GRANT_WITHIN_S:
        return False
    # the jump was a sample (a second) before now: made at least the window after the first use
    return app.active_s >= max(config.start_windows_end_s(), config.ramp_jump_release_after_s) + 1.0


def _start_up(app: AppState, config: PolicyConfig) -> float:
    """The grant of an application still starting: its cold-start size, else its usage plus
    `start_headroom_mib`, plus the margin; NaN when off, past the window, or nothing is known.
    The window runs from the first sample, or with `start_from_use` from the first real use (and
    until then)."""
    age = app.history_s
    if config.start_from_use > 0:
        age = 0.0 if math.isnan(app.active_s) else app.active_s
    starting = age < config.start_window_s
    ramping = (age < config.start_ramp_window_s and config.start_ramp_frac > 0
               and app.mem_ramp_s >= max(config.start_ramp_min_s, 1.0))
    if not (starting or ramping):
        return math.nan
    if starting and not math.isnan(app.expected_mem_mib):
        return _cold_start_floor(app, config)
    if math.isnan(app.used_mem_mib):
        return math.nan
    used = app.used_mem_mib
    grow = max(config.start_headroom_mib if starting else 0.0, used * config.start_ramp_frac if ramping else 0.0)
    return _to_cold_start(used + grow, app, config) * (1.0 + config.mem_margin_frac) if grow > 0 else math.nan


def _to_cold_start(end_mib: float, app: AppState, config: PolicyConfig) -> float:
    """`end_mib`, where a ramp rule would take the memory, held at the job's cold-start size while
    the usage is under it (`ramp_to_cold_start`), and never under the usage."""
    if (config.ramp_to_cold_start <= 0 or math.isnan(app.expected_mem_mib) or math.isnan(app.used_mem_mib)
            or app.used_mem_mib >= app.expected_mem_mib):
        return end_mib
    return max(app.used_mem_mib, min(end_mib, app.expected_mem_mib))


def _cold_start_floor(app: AppState, config: PolicyConfig) -> float:
    """The job's cold-start size plus the margin while it is in its start-up window
    (`start_window_s`, counted as `_start_up` counts it); NaN otherwise, or when it has none."""
    if math.isnan(app.expected_mem_mib) or config.start_window_s <= 0:
        return math.nan
    age = app.history_s
    if config.start_from_use > 0:
        age = 0.0 if math.isnan(app.active_s) else app.active_s
    return app.expected_mem_mib * (1.0 + config.mem_margin_frac) if age < config.start_window_s else math.nan


def _burst_room(app: AppState, config: PolicyConfig) -> float:
    """Room for another burst of the size seen in the last `mem_burst_window_s`: (usage + that
    burst) plus the margin; NaN when off or there was none."""
    if config.mem_burst_window_s <= 0 or not app.mem_burst_mib > 0 or math.isnan(app.used_mem_mib):
        return math.nan
    return (app.used_mem_mib + app.mem_burst_mib) * (1.0 + config.mem_margin_frac)


# The leading rules (memory), in the order `_desired` applies them, each with the reason it gives:
# each one that asks for more than the target so far sets it (capped) and its reason
_LEADING_RULES: tuple[tuple[str, Callable[[AppState, PolicyConfig], float]], ...] = (
    ("lead", _lead), ("ramp", _ramp_end), ("start", _start_up), ("burst", _burst_room),
)


def _slow_shrink(app: AppState, value: float, config: PolicyConfig) -> float:
    """A memory target under the grant in force, bounded: at most `mem_shrink_step_frac` of the
    grant in one change, and never under the recent peak usage plus the margin."""
    current = app.granted_mem_mib
    if current <= 0 or value >= current:
        return value
    floor = current * (1.0 - config.mem_shrink_step_frac)
    if config.mem_shrink_window_s > 0 and not math.isnan(app.recent_peak_mem_mib):
        if config.mem_shrink_peak_mult > 0:
            floor = min(floor, app.recent_peak_mem_mib * config.mem_shrink_peak_mult)
        floor = max(floor, app.recent_peak_mem_mib * (1.0 + config.mem_margin_frac))
    return max(value, min(floor, current))


def _overrun_bump(app: AppState, res: Resource, config: PolicyConfig) -> float:
    """The target after an overrun; NaN when there is nothing to bump.

    Memory: the usage has reached the grant in force (under a hard limit it cannot pass it), so
    the application is still growing or was just cut off. Like the VPA recommender's OOM bump, the
    next grant leaves room for the rest of the step instead of trailing it by one margin a second:
    in the TITAN X replay memory grows in steps of several seconds, and a P90 + 2 % grant overran
    on each of them. SM: the usage is over the grant (a share can be exceeded); the bump absorbs
    the next few noisy seconds in one change instead of one per second."""
    used, current = app.used(res), app.granted(res)
    if res == "sm":
        if current <= 0 or math.isnan(used) or used <= current or config.sm_bump_pct <= 0:
            return math.nan
        return used + config.sm_bump_pct
    if current <= 0 or math.isnan(used) or used < current:
        return math.nan
    if config.mem_bump_frac <= 0 and config.mem_bump_min_mib <= 0:
        return math.nan
    return max(used * (1.0 + config.mem_bump_frac), used + config.mem_bump_min_mib)


# The reasons of the rules whose growth hysteresis never holds back: the bump and the leading rules
_GROW_AT_ONCE = frozenset({"bump", *(name for name, _ in _LEADING_RULES)})


def _hysteresis(app: AppState, res: Resource, desired: float, reason: str, now_s: float,
                config: PolicyConfig) -> tuple[float, str]:
    """(the target, its reason) after hysteresis: the first that applies of a new grant, the
    guarantee, growth at once, the jump release, the overrun, the threshold and the dwell (the
    module docstring's 10a-g)."""
    current = app.granted(res)
    if current <= 0:
        return desired, reason  # a new grant is always made
    if desired < app.request(res) or current < app.request(res):
        return max(desired, app.request(res)), "guarantee"
    # the need itself (usage now, or the forecast without margin) beyond the grant, by more than
    # the resource's absolute threshold: grow now
    need = max((v for v in (app.used(res), app.forecast_p90(res)) if not math.isnan(v)), default=math.nan)
    tolerance = config.min_change_abs(res)
    if reason in _GROW_AT_ONCE and desired > current:
        return desired, reason
    if res == "mem" and desired < current and _jump_ended(app, now_s, config):
        return desired, "jump-ended"
    if config.grow_on_overrun and desired > current and not math.isnan(need) and need > current + tolerance:
        return desired, "overrun"
    frac = config.min_change_frac
    if res == "mem" and desired < current and config.mem_trust_change_frac > 0 and config.trusted(app):
        frac = min(frac, config.mem_trust_change_frac)  # a trusted forecast is followed down closer
    if abs(desired - current) < max(frac * current, tolerance):
        return current, "below-threshold"
    dwell = config.shrink_dwell_s(res) if desired < current else config.dwell_s
    if now_s - app.last_change_s(res) < dwell:
        return current, "dwell"
    return desired, reason


def _shrink(works: list[_Work], res: Resource, capacity: float, config: PolicyConfig) -> bool:
    """Shrink until the targets fit, lowest priority first; True if anything had to shrink.

    Memory goes strictly by `priority_score` (size included: the largest shrinks first, since a
    grant is what an application may fill). SM shares are time slices, so applications of the same
    priority class (the score without its size term: criticality, explicit priority, deadline) give
    up SM in proportion to what they hold above their floors, and a higher class only shrinks once a
    lower one is at its floors; otherwise the smallest application of a crowded GPU keeps all it
    asked for while every other one is cut to the minimum.

    Before any of that, what lies above the applications' claims (leading headroom, overrun bumps,
    shrinks that hysteresis or the slow shrink still hold back) is taken back in proportion; if that is not enough, every target
    restarts from its claim. Cutting from hysteresis-held grants instead makes two neighbours on a
    full GPU trade a few SM points back and forth every second (seen in the MIGPerf replay): the one
    over its grant bumps and takes share, the other is then over its grant and takes it back."""
    excess = sum(w.target[res] for w in works) - capacity
    if excess <= 1e-9:
        return False
    # first what lies above the claims, in proportion
    extras = [max(w.target[res] - w.claim[res], 0.0) for w in works]
    above = sum(extras)
    if above >= excess:
        for w, extra in zip(works, extras, strict=True):
            if extra > 0:
                w.target[res] -= extra * excess / above
                w.reason[res] = "contention"
        return True
    # then the claims themselves, hysteresis ignored: cutting from grants that hysteresis holds
    # (some above, some below their claims) makes neighbours trade shares back and forth
    for w in works:
        if w.target[res] != w.claim[res]:
            w.target[res], w.reason[res] = w.claim[res], "contention"
    excess = sum(w.target[res] for w in works) - capacity
    for group in _yield_groups(works, res):
        rooms = [max(w.target[res] - _floor(w.app, res, config), 0.0) for w in group]
        room = sum(rooms)
        if room <= 0:
            continue
        frac = min(1.0, excess / room)
        for w, r in zip(group, rooms, strict=True):
            if r > 0:
                w.target[res] -= r * frac
                w.reason[res] = "contention"
        excess -= room * frac
        if excess <= 1e-9:
            break
    return True


def _yield_groups(works: list[_Work], res: Resource) -> list[list[_Work]]:
    """The order in which applications give up `res` under contention, first group first; a group
    shrinks in proportion. Memory: one application a group, by `priority_score` (then app id). SM:
    one group per priority class (the score without its size term), lowest first."""
    if res == "mem":
        return [[w] for w in sorted(works, key=lambda w: (w.score, w.app.app_id))]
    by_class: dict[float, list[_Work]] = {}
    for w in works:
        by_class.setdefault(round(w.score + _size_term(w.app), 9), []).append(w)
    return [by_class[k] for k in sorted(by_class)]


def _settle(works: list[_Work], res: Resource, capacity: float, config: PolicyConfig) -> None:
    """Hysteresis on a contended device, all or nothing: when every share the contention rule set
    is within `min_change_frac` of the application's grant in force and those grants still fit,
    the device keeps its current split. On a full device each change of one application re-cuts
    all its neighbours' shares by a sliver, each sliver a grant change. All or nothing keeps the
    split a fair one (it was cut by the same rule a moment ago); the SM points threshold is not
    used here, since it holds shares far enough below what the applications use to double the SM
    violations (the MIGPerf replay)."""
    cut = [w for w in works if w.reason[res] == "contention"]
    if not cut:
        return
    for w in cut:
        current = w.app.granted(res)
        if current <= 0 or current < _floor(w.app, res, config):
            return
        if abs(current - w.target[res]) >= config.min_change_frac * current:
            return
    cut_ids = {w.app.app_id for w in cut}
    if sum(w.app.granted(res) if w.app.app_id in cut_ids else w.target[res] for w in works) > capacity + 1e-9:
        return
    for w in cut:
        w.target[res], w.reason[res] = w.app.granted(res), "contention-held"


def plan(
    apps: Iterable[AppState],
    devices: Iterable[DeviceState],
    now_s: float,
    config: PolicyConfig | None = None,
    estimator: Estimator | None = None,
) -> Plan:
    """The target grant of every application, per device. Pure: same inputs, same plan.

    An application on an unknown device is a ValueError (the caller's bookkeeping is wrong)."""
    config = config or PolicyConfig()
    devs = {d.device_id: d for d in devices}
    est = estimator or default_estimator(config, devs)
    by_device: dict[str, list[_Work]] = {d: [] for d in devs}
    seen: set[str] = set()
    for app in apps:
        if app.device_id not in devs:
            raise ValueError(f"application {app.app_id!r} is on unknown device {app.device_id!r}")
        if app.app_id in seen:
            raise ValueError(f"application {app.app_id!r} appears twice")
        seen.add(app.app_id)
        work = _Work(app, priority_score(app, now_s))
        for res in RESOURCES:
            value, reason, work.claim[res] = _desired(app, res, est, config, devs[app.device_id], now_s)
            work.target[res], work.reason[res] = _hysteresis(app, res, value, reason, now_s, config)
        by_device[app.device_id].append(work)

    targets: list[Target] = []
    device_plans: list[DevicePlan] = []
    for dev_id, works in by_device.items():
        dp = _plan_device(devs[dev_id], works, config)
        targets.extend(_target(w, dp, config) for w in works)
        device_plans.append(dp)
    return Plan(at_s=now_s, targets=tuple(targets), devices=tuple(device_plans))


def _plan_device(dev: DeviceState, works: list[_Work], config: PolicyConfig) -> DevicePlan:
    """The per-device rules on the targets of its applications (cut in place): contention and a
    close split kept, then whether its limits are hard and whether it keeps full power."""
    needs = tuple((w.app.app_id, w.target["mem"]) for w in works)
    contended = {res: _shrink(works, res, dev.capacity(res), config) for res in RESOURCES}
    for res in RESOURCES:
        if contended[res]:
            _settle(works, res, dev.capacity(res), config)
    over = any(
        sum(_floor(w.app, res, config) for w in works) > dev.capacity(res) + 1e-9 for res in RESOURCES
    )
    mem_planned = sum(w.target["mem"] for w in works)
    hard = limits_are_hard(mem_planned, dev.mem_total_mib, config.hard_limit_at_frac * dev.mem_total_mib,
                           contended=contended["mem"])
    sm_planned = sum(w.target["sm"] for w in works)
    hard_sm = limits_are_hard(sm_planned, dev.sm_total_pct, config.hard_limit_at_frac * dev.sm_total_pct,
                              contended=contended["sm"])
    if config.sm_cap_at_use_frac > 0:  # SM caps only where the applications use more than the GPU has
        used_sm = sum(w.app.used_sm_pct for w in works if not math.isnan(w.app.used_sm_pct))
        hard_sm = hard_sm and used_sm > config.sm_cap_at_use_frac * dev.sm_total_pct
    full_power = config.contended_full_power > 0 and (
        contended["sm"]
        or (config.full_power_at_frac > 0 and sm_planned >= config.full_power_at_frac * dev.sm_total_pct - 1e-9))
    return DevicePlan(
        device_id=dev.device_id,
        mem_planned_mib=mem_planned,
        sm_planned_pct=sm_planned,
        overcommitted=over, contended_mem=contended["mem"], contended_sm=contended["sm"],
        hard_mem_limits=hard, hard_sm_limits=hard_sm, mem_needs_mib=needs, full_power=full_power,
    )


def _target(w: _Work, dp: DevicePlan, config: PolicyConfig) -> Target:
    """One application's decision on its device's plan. With `sm_cap_cut_only`, only a share the
    contention rule cut is capped on a device whose SM shares are enforced."""
    tmem, tsm = w.target["mem"], w.target["sm"]
    return Target(
        app_id=w.app.app_id, device_id=dp.device_id, mem_mib=tmem, sm_pct=tsm,
        priority_score=w.score,
        changed_mem=not math.isclose(tmem, w.app.granted_mem_mib, rel_tol=1e-9, abs_tol=1e-9),
        changed_sm=not math.isclose(tsm, w.app.granted_sm_pct, rel_tol=1e-9, abs_tol=1e-9),
        reason_mem=w.reason["mem"], reason_sm=w.reason["sm"], hard_mem_limit=dp.hard_mem_limits,
        hard_sm_limit=dp.hard_sm_limits and (config.sm_cap_cut_only <= 0 or w.reason["sm"] == "contention"),
    )


def advance(apps: Sequence[AppState], result: Plan) -> list[AppState]:
    """The application states after the plan is applied (grants and change times updated): what a
    replay or a test feeds into the next `plan` call."""
    out = []
    for app in apps:
        t = result.target(app.app_id)
        out.append(replace(
            app,
            granted_mem_mib=t.mem_mib,
            granted_sm_pct=t.sm_pct,
            last_mem_change_s=result.at_s if t.changed_mem else app.last_mem_change_s,
            last_sm_change_s=result.at_s if t.changed_sm else app.last_sm_change_s,
        ))
    return out


# ------------------------------------------------------------------------------------------------
# Leading signals from the usage the policy has seen
# ------------------------------------------------------------------------------------------------
_usage = itemgetter(1)  # a (t_s, used_mib) sample's usage
# a burst has come back down once the usage is at or under its level before plus this share of its rise
BURST_RETURN_FRAC = 0.5


def burst_returned(used_mib: float, before_mib: float, rise_mib: float) -> bool:
    """Whether a burst (a rise of `rise_mib` from `before_mib`) has come back down at `used_mib`: a
    cache that swings. A step that stays (a training job's next phase) never does, and is no burst:
    the grant follows it as the new level."""
    return used_mib <= before_mib + BURST_RETURN_FRAC * rise_mib


class UsageHistory:
    """Each application's recent memory usage, as the policy saw it at each plan: the leading
    signals `AppState` carries (how long the usage has risen in a row and how fast, the recent
    peak). Samples closer than `min_step_s` to the previous one are not kept (the daemon plans
    several times a second while recommendations arrive); `keep_s` bounds the memory."""

    def __init__(self, min_step_s: float = 1.0, keep_s: float = 120.0, rise_frac: float = 0.01,
                 rises_keep_s: float = 1800.0, rises_max: int = 256) -> None:
        if not min_step_s >= 0:
            raise ValueError(f"min_step_s must be >= 0, got {min_step_s}")
        self.min_step_s = min_step_s
        self.keep_s = keep_s
        self.rise_frac = rise_frac
        # rises past the P90 (`bursts`) are kept longer than the samples, at most `rises_max` each
        self.rises_keep_s = rises_keep_s
        self.rises_max = rises_max
        # per application: each sample that rose over the P90 it was judged against, as (t_s, usage
        # before, rise, that P90, whether the usage has come back down since: `burst_returned`)
        self._rises: dict[str, list[tuple[float, float, float, float, bool]]] = {}
        self._samples: dict[str, list[tuple[float, float]]] = {}
        self._seq: dict[str, int] = {}
        self._first_use: dict[str, float] = {}
        # per application: when this history saw its first sample, and the first use it saw since a
        # new job's start (`use_since_s`) as (that start, the use; inf: none yet)
        self._began: dict[str, float] = {}
        self._job_use: dict[str, tuple[float, float]] = {}
        # the forecast P90 given with the latest sample, the one the latest sample is judged against
        # (given with the sample before it), and how many samples that moved have stayed at or under
        # theirs since the last that went over (`covered_s`)
        self._p90: dict[str, float] = {}
        self._p90_judged: dict[str, float] = {}
        self._covered_n: dict[str, int] = {}

    def observe(self, app_id: str, now_s: float, used_mib: float, seq: int = 0,
                forecast_mib: float = math.nan) -> None:
        """Record a usage sample, and the forecast P90 of the memory made with it (NaN: none); one
        with a `seq` (the recommendation's) already seen is a stale stand-in for a neighbour's plan,
        not a new sample, and is ignored."""
        if math.isnan(used_mib) or (seq and self._seq.get(app_id) == seq):
            return
        if seq:
            self._seq[app_id] = seq
        self._began.setdefault(app_id, now_s)
        if used_mib > IDLE_MEM_MIB:
            self._first_use.setdefault(app_id, now_s)
        samples = self._samples.setdefault(app_id, [])
        if samples and now_s - samples[-1][0] < self.min_step_s:
            if used_mib > samples[-1][1]:  # keep the larger value of a step
                samples[-1] = (samples[-1][0], used_mib)
                judged_step = self._p90_judged.get(app_id, math.nan)
                if not used_mib <= judged_step:
                    self._covered_n.pop(app_id, None)
                if len(samples) > 1:  # a rise inside the step is judged as one at its start would be
                    self._note_rise(app_id, samples[-1][0], samples[-2][1], used_mib, judged_step)
            if not math.isnan(forecast_mib):
                self._p90[app_id] = forecast_mib
            return
        judged = self._p90.get(app_id, math.nan)
        self._p90_judged[app_id] = judged
        rises = self._rises.setdefault(app_id, [])
        for i, (t, before, rise, p90, back) in enumerate(rises):
            if not back and burst_returned(used_mib, before, rise):
                rises[i] = (t, before, rise, p90, True)
        if samples:
            self._note_rise(app_id, now_s, samples[-1][1], used_mib, judged)
        if not used_mib <= judged:  # over the P90 (or none to judge by): the count starts again
            self._covered_n.pop(app_id, None)
        elif samples and used_mib != samples[-1][1]:  # moved, and covered
            self._covered_n[app_id] = self._covered_n.get(app_id, 0) + 1
        self._p90[app_id] = forecast_mib
        samples.append((now_s, used_mib))
        while samples and now_s - samples[0][0] > self.keep_s:
            samples.pop(0)

    def _note_rise(self, app_id: str, step_s: float, before_mib: float, used_mib: float, judged_mib: float) -> None:
        """Keep the step at `step_s` as a rise past the P90 it is judged against (`judged_mib`) when
        its usage went over both that and the step before's (`before_mib`): a rise the forecast did
        not see. A later, larger sample inside the same step replaces the step's rise, so that a
        burst inside one step counts as it would had it come at the step's start."""
        rises = self._rises.setdefault(app_id, [])
        if rises and rises[-1][0] == step_s:
            rises.pop()
        if not (used_mib > before_mib and used_mib > judged_mib):
            return
        rises.append((step_s, before_mib, used_mib - before_mib, judged_mib, False))
        while rises and (step_s - rises[0][0] > self.rises_keep_s or len(rises) > self.rises_max):
            rises.pop(0)

    def prune(self, now_s: float) -> None:
        """Forget applications not seen for `keep_s`."""
        for app_id in [a for a, smp in self._samples.items() if not smp or now_s - smp[-1][0] > self.keep_s]:
            del self._samples[app_id]
            self._seq.pop(app_id, None)
            self._covered_n.pop(app_id, None)
            self._rises.pop(app_id, None)
            self._job_use.pop(app_id, None)
            for d in (self._first_use, self._began, self._p90, self._p90_judged):
                d.pop(app_id, None)

    def ramp(self, app_id: str, back: int = 0) -> tuple[float, float]:
        """(seconds the usage has risen by more than `rise_frac` at every sample up to the last,
        its mean rate in MiB/s; NaN when not rising). `back`: as it was that many samples before the
        last (`AppState.mem_ramp_prev_s` with 1)."""
        samples = self._samples.get(app_id, [])
        last = len(samples) - 1 - max(back, 0)  # read in place: no copy of the history per plan
        i = last
        while i > 0 and samples[i][1] > samples[i - 1][1] * (1 + self.rise_frac) and samples[i][1] > samples[i - 1][1]:
            i -= 1
        if i == last:
            return 0.0, math.nan
        span = samples[last][0] - samples[i][0]
        return span, (samples[last][1] - samples[i][1]) / span if span > 0 else math.nan

    def last_rise(self, app_id: str) -> float:
        """The rise of the ramp's last step per second (MiB/s); NaN when the usage is not rising."""
        samples = self._samples.get(app_id, [])
        if len(samples) < 2:
            return math.nan
        (t0, v0), (t1, v1) = samples[-2], samples[-1]
        if not (v1 > v0 * (1 + self.rise_frac) and v1 > v0) or t1 <= t0:
            return math.nan
        return (v1 - v0) / (t1 - t0)

    def active_s(self, app_id: str, now_s: float) -> float:
        """Seconds since the usage first rose above `IDLE_MEM_MIB`; NaN when it has not."""
        first = self._first_use.get(app_id)
        return math.nan if first is None else max(now_s - first, 0.0)

    def first_use_s(self, app_id: str) -> float:
        """When this history first saw the usage above `IDLE_MEM_MIB`; NaN when it has not."""
        return self._first_use.get(app_id, math.nan)

    def use_since_s(self, app_id: str, since_s: float) -> float:
        """When the usage first rose above `IDLE_MEM_MIB` at or after `since_s` (a new job's start),
        to the step (`min_step_s`), as this history saw it; inf while it has not. `since_s` itself
        where this history began after it (a restarted daemon's policy, or an application forgotten
        and seen again): what came before is not known here, and the job is taken to have used the
        GPU from its start, so that a job already running does not start its window again."""
        began = self._began.get(app_id)
        if began is None or began > since_s:
            return since_s
        known = self._job_use.get(app_id)
        if known is not None and known[0] == since_s and math.isfinite(known[1]):
            return known[1]
        # found once while the use is in the kept samples (this is asked at every plan), then kept
        samples = self._samples.get(app_id, [])
        i = len(samples)
        while i > 0 and samples[i - 1][0] >= since_s:
            i -= 1
        used = next((t for t, v in samples[i:] if v > IDLE_MEM_MIB), math.inf)
        self._job_use[app_id] = (since_s, used)
        return used

    def covered_s(self, app_id: str) -> float:
        """Seconds (samples, one a second at most) since a sample's usage last went over the forecast
        P90 given with the sample before it, in which the usage moved and stayed at or under it
        (`AppState.mem_p90_covered_s`); 0 when the latest went over or nothing is known."""
        return float(self._covered_n.get(app_id, 0))

    def burst_mib(self, app_id: str, now_s: float, config: PolicyConfig, first_use_s: float = math.nan) -> float:
        """The largest burst in the last `config.mem_burst_window_s` (`AppState.mem_burst_mib`): a
        step's rise over the one before that passed the P90 given with that one, that
        `config.is_burst` counts, and that has come back down since (`burst_returned`); 0 when none, or
        the rule is off. At most `rises_keep_s` back. A rise's age counts from the manager's first use
        (`first_use_s`, as `active_since_use_s` reads it: inf, not used yet) where given, else from
        the first use this history saw: the start-up window's clock, so that a start-up's last step
        is not taken for a burst because the history began late."""
        if config.mem_burst_window_s <= 0:
            return 0.0
        first = self._first_use.get(app_id, math.nan)
        return max((rise for t, before, rise, p90, back in self._rises.get(app_id, [])
                    if back and now_s - t < config.mem_burst_window_s
                    and config.is_burst(rise, before, p90, active_since_use_s(t, first_use_s, t - first))),
                   default=0.0)

    def peak(self, app_id: str, now_s: float, window_s: float) -> float:
        """The largest usage seen in the last `window_s`; NaN when none."""
        samples = self._samples.get(app_id, [])
        # the samples are in time order (each is kept at least `min_step_s` after the one before),
        # so those in the window are a tail: found from the end, not by reading all `keep_s` of them
        i = len(samples)
        while i > 0 and now_s - samples[i - 1][0] <= window_s:
            i -= 1
        return max(samples[i:], key=_usage)[1] if i < len(samples) else math.nan


# ------------------------------------------------------------------------------------------------
# What the daemon enforces: the start of an application's history, and hard or cooperative limits
# ------------------------------------------------------------------------------------------------
def history_since_use_s(now_s: float, first_grant_s: float, first_use_s: float) -> float:
    """Seconds of history behind an application's plan (the start-up window and the confidence
    estimator count them): since its first use of the GPU where the manager says when that was
    (inf: not used yet, so 0 s: an application that registered and idles is still starting), else
    since its first grant."""
    start = first_grant_s if math.isnan(first_use_s) else first_use_s
    return max(now_s - start, 0.0)


def active_since_use_s(now_s: float, first_use_s: float, seen_active_s: float) -> float:
    """Seconds since an application's first real use, for the start-up window: from the manager's
    first use where the recommendation says it (inf: not used yet, NaN), else from what the policy's
    own usage history saw (`seen_active_s`, the replay's case)."""
    if math.isnan(first_use_s):
        return seen_active_s
    return max(now_s - first_use_s, 0.0) if math.isfinite(first_use_s) else math.nan


def memory_enforcement(dp: DevicePlan, other_granted_mib: float, mem_total_mib: float,
                       config: PolicyConfig, *, others_mib: Mapping[str, float] | None = None) -> Enforcement:
    """The device's memory limits by the hard-limit rule (`limits_are_hard`: contended as the plan
    found it, or planned at `hard_limit_at_frac` of the device or more), counting also `other_granted_mib`,
    the grants of applications the plan did not size (requests without signatures yet). With
    `others_mib` (those grants per application) the decision says what it counted per application
    (`Enforcement.counted_mib`: the plan's needs, `DevicePlan.mem_needs_mib`, and those grants), so
    that the allocator can judge it again when one of them leaves before the next plan."""
    planned = dp.mem_planned_mib + other_granted_mib
    at = config.hard_limit_at_frac * mem_total_mib
    counted: tuple[tuple[str, float], ...] = ()
    if others_mib is not None and dp.mem_needs_mib:
        counted = tuple(dp.mem_needs_mib) + tuple(sorted((a, m) for a, m in others_mib.items() if m > 0))
    hard = limits_are_hard(planned, mem_total_mib, at, contended=dp.contended_mem)
    if dp.contended_mem:
        reason = f"contended: needs over {mem_total_mib:.0f} MiB"
    else:
        reason = f"{'contended' if hard else 'uncontended'}: {planned:.0f} of {mem_total_mib:.0f} MiB planned"
    return Enforcement(dp.device_id, hard, reason, counted, mem_total_mib, at)


def _grant_targets(result: Plan, requested: Mapping[str, tuple[float, float]],
                   managed: Mapping[str, Grant | None]) -> list[GrantTarget]:
    """The grant changes the plan asks for: an application's requested grants are left as they are
    (`requested`: their memory and SM), and its managed grant (`managed`; None: a new forecast
    grant) carries the rest of each changed target."""
    grants: list[GrantTarget] = []
    for t in result.changes():
        req_mem, req_sm = requested[t.app_id]
        own = managed[t.app_id]
        extra_mem, extra_sm = max(t.mem_mib - req_mem, 0.0), max(t.sm_pct - req_sm, 0.0)
        if own is None and extra_mem <= 0 and extra_sm <= 0:
            continue  # the requests cover the plan
        grants.append(GrantTarget(t.app_id, t.device_id, extra_mem, extra_sm,
                                  own.grant_id if own else None, f"{t.reason_mem}/{t.reason_sm}"))
    return grants


# ------------------------------------------------------------------------------------------------
# The allocator's Policy protocol (allocator/policy/base.py): recommendations + device views -> plan
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForecastPolicy:
    """This module's policy behind `vgpu.allocator.policy.base.Policy`, for
    `Allocator(policy=ForecastPolicy())`.

    Per application and device: grants the application requested itself (source "request") are its
    guarantee and are left as they are; its most recent other grant (or a new forecast grant)
    carries the rest of the planned size. The recommendation's P90 peaks are the forecast (its
    recommended size where they are unknown), its last usage the usage, the managed grant's
    `mem_changed_at_s` / `updated_at_s` the last memory / SM change, and the time since its first
    use (`history_since_use_s`; its first grant where the recommendation does not say) the history;
    the leading signals come from the usage this policy has seen (`history`). Power: each device's
    limit from its planned SM share (allocator/policy/power.py), written only when it moves by at
    least `power_hysteresis_frac` of the device's range. The default settings are
    `PREDICTIVE_CONFIG`, the ones bench/replay.py measures."""

    config: PolicyConfig = PREDICTIVE_CONFIG
    power_hysteresis_frac: float = 0.05
    manage_power: bool = True
    # MIG (server.manage_mig_layout): on a device in MIG mode, a layout with an instance per
    # application sized for its planned grant (forecast and leads included) and its usage now,
    # started `mig_reconfig_s` ahead (allocator/mechanisms/mig.py: plan_layout)
    manage_mig: bool = False
    mig_reconfig_s: float = 6.0
    # the usage seen at each plan, for the leading signals (ramps, the recent peak)
    history: UsageHistory = field(default_factory=UsageHistory, compare=False)

    def plan(self, recommendations: Sequence[Recommendation], devices: Sequence[DeviceView],
             now_s: float) -> AllocatorPlan:
        views = {d.device_id: d for d in devices}
        states: list[AppState] = []
        managed: dict[str, Grant | None] = {}
        requested: dict[str, tuple[float, float]] = {}
        seen: set[str] = set()
        # each device's grants by application (in the view's order), built once, not scanned per application
        by_app: dict[str, dict[str, list[Grant]]] = {}
        for v in devices:
            index = by_app.setdefault(v.device_id, {})
            for g in v.grants:
                index.setdefault(g.app_id, []).append(g)
        for rec in recommendations:
            view = views.get(rec.device_id)
            if view is None or rec.app_id in seen:
                continue
            seen.add(rec.app_id)
            mine = by_app[rec.device_id].get(rec.app_id, [])
            others = [g for g in mine if g.source != "request"]
            managed[rec.app_id] = max(others, key=lambda g: g.created_at_s) if others else None
            state = self._app_state(rec, mine, managed[rec.app_id], now_s)
            requested[rec.app_id] = (state.request_mem_mib, state.request_sm_pct)
            states.append(state)
        self.history.prune(now_s)
        caps = [DeviceState(v.device_id, v.mem_total_mib, v.sm_total_pct) for v in devices]
        result = plan(states, caps, now_s, self.config)
        grants = _grant_targets(result, requested, managed)
        power = self._power_targets(result, views) if self.manage_power else []
        mig: list[MigTarget] = []
        if self.manage_mig:
            mig = [m for v in devices if v.mig_enabled and (m := self._mig_target(v, states, result)) is not None]
        enforcement = [self._enforcement(dp, views[dp.device_id], seen) for dp in result.devices]
        reasons = tuple(PlanReason(t.app_id, t.device_id, t.mem_mib, t.sm_pct, t.reason_mem, t.reason_sm)
                        for t in result.targets)
        return AllocatorPlan(grants=tuple(grants), power=tuple(power), mig=tuple(mig),
                              enforcement=tuple(enforcement), reasons=reasons)

    def _app_state(self, rec: Recommendation, mine: Sequence[Grant], own: Grant | None, now_s: float) -> AppState:
        """What `plan()` knows of one application: its recommendation, its grants on the device
        (`mine`; `own`, the managed one, its latest grant not from a request), and the leading
        signals of the usage history, which this call records the recommendation's usage into."""
        req = [g for g in mine if g.source == "request"]
        req_mem = sum(g.memory_mib for g in req)
        req_sm = min(100.0, sum(g.sm_pct for g in req))
        f_mem = rec.mem_p90_peak_mib if math.isfinite(rec.mem_p90_peak_mib) else rec.memory_mib
        f_sm = rec.sm_p90_peak_pct if math.isfinite(rec.sm_p90_peak_pct) else rec.sm_pct
        # memory and SM keep their own change times: SM shares move with every arrival under
        # contention, which must not keep restarting the memory grant's dwell
        mem_changed_at = own.mem_changed_at_s if own is not None else -math.inf
        sm_changed_at = own.updated_at_s if own is not None else -math.inf
        first = min((g.created_at_s for g in mine), default=now_s)
        cold_mib = rec.cold_start_mem_mib if math.isfinite(rec.cold_start_mem_mib) else math.nan
        self.history.observe(rec.app_id, now_s, rec.mem_used_mib, rec.for_seq,
                             f_mem if math.isfinite(f_mem) else math.nan)
        ramp_s, ramp_rate = self.history.ramp(rec.app_id)
        used_since_s = self._job_first_use_s(rec, own)
        window = self.config.mem_shrink_window_s
        return AppState(
            app_id=rec.app_id, device_id=rec.device_id,
            request_mem_mib=req_mem, request_sm_pct=req_sm,
            granted_mem_mib=sum(g.memory_mib for g in mine),
            granted_sm_pct=min(100.0, sum(g.sm_pct for g in mine)),
            used_mem_mib=rec.mem_used_mib, used_sm_pct=rec.sm_util_pct,
            forecast_mem_p90_mib=f_mem if math.isfinite(f_mem) else math.nan,
            forecast_sm_p90_pct=f_sm if math.isfinite(f_sm) else math.nan,
            history_s=history_since_use_s(now_s, first, rec.first_use_s), expected_mem_mib=cold_mib,
            priority=max((g.priority for g in mine), default=0),
            last_mem_change_s=mem_changed_at, last_sm_change_s=sm_changed_at,
            mem_ramp_s=ramp_s, mem_ramp_rate_mib_s=ramp_rate, mem_ramp_last_mib_s=self.history.last_rise(rec.app_id),
            mem_ramp_prev_s=self.history.ramp(rec.app_id, back=1)[0],
            recent_peak_mem_mib=self.history.peak(rec.app_id, now_s, window) if window > 0 else math.nan,
            active_s=active_since_use_s(now_s, used_since_s, self.history.active_s(rec.app_id, now_s)),
            mem_p90_covered_s=self.history.covered_s(rec.app_id),
            mem_burst_mib=self.history.burst_mib(rec.app_id, now_s, self.config, used_since_s),
        )

    def _job_first_use_s(self, rec: Recommendation, own: Grant | None) -> float:
        """The start of the application's start-up windows, as `Recommendation.first_use_s` says it
        (NaN: from the use this policy's history saw): its first use of the GPU, unless its managed
        grant (`own`) is a cold-start grant made after that first use: a new job, declared by an
        application that had used the GPU already (a script run again under the same id, the next
        of a series of runs). Its windows then count from its first use since that grant
        (`UsageHistory.use_since_s`; inf while it has used nothing since), so that the new job keeps
        its cold-start size through its own start-up. A grant the application requested itself
        declares no job and is never `own`; a cold-start grant made before the first use is the
        first job's, whose windows count from the first use as they always did."""
        first = rec.first_use_s
        if own is None or own.source != "cold_start":
            return first
        used = self.history.first_use_s(rec.app_id) if math.isnan(first) else first
        if not own.created_at_s > used:  # not after it, not used yet (inf), or not known (NaN)
            return first
        return self.history.use_since_s(rec.app_id, own.created_at_s)

    def _power_targets(self, result: Plan, views: Mapping[str, DeviceView]) -> list[PowerTarget]:
        """Each device's power limit from its planned SM share (the maximum where the plan says full
        power), where it moves by at least `power_hysteresis_frac` of the device's range and the
        device's limit can be read and set."""
        power: list[PowerTarget] = []
        for dp in result.devices:
            view = views[dp.device_id]
            c = view.power_constraints
            if c is None or not view.power_enabled or view.power_limit_mw is None or c.max_mw <= c.min_mw:
                continue
            choice = choose_power_limit_mw(min(dp.sm_planned_pct, 100.0), c)
            limit_mw, why = choice.limit_mw, choice.reason
            if dp.full_power:
                limit_mw, why = c.max_mw, "contended" if dp.contended_sm else "full"
            if abs(limit_mw - view.power_limit_mw) >= self.power_hysteresis_frac * (c.max_mw - c.min_mw):
                power.append(PowerTarget(dp.device_id, limit_mw, f"{why}: planned SM {dp.sm_planned_pct:.0f} %"))
        return power

    def _enforcement(self, dp: DevicePlan, view: DeviceView, seen: set[str]) -> Enforcement:
        """The device's memory enforcement, counting also the grants of applications this plan did
        not size (those not in `seen`: requests without recommendations yet)."""
        unplanned: dict[str, float] = {}
        for g in view.grants:
            if g.app_id not in seen:
                unplanned[g.app_id] = unplanned.get(g.app_id, 0.0) + g.memory_mib
        return memory_enforcement(dp, sum(unplanned.values()), view.mem_total_mib, self.config, others_mib=unplanned)

    def _mig_target(self, view: DeviceView, states: Sequence[AppState], result: Plan) -> MigTarget | None:
        """The layout for the applications planned on a device in MIG mode, when its current one
        no longer fits their needs now or at the reconfiguration time ahead; None otherwise."""
        from vgpu.allocator.mechanisms.mig import MigNeed, plan_layout, sku_for_name

        sku = sku_for_name(view.name)
        if sku is None or not sku.supports_mig:
            return None
        now: list[MigNeed] = []
        ahead: list[MigNeed] = []
        for st in states:
            if st.device_id != view.device_id:
                continue
            t = result.target(st.app_id)
            used_mem = 0.0 if math.isnan(st.used_mem_mib) else st.used_mem_mib
            used_sm = 0.0 if math.isnan(st.used_sm_pct) else st.used_sm_pct
            now.append(MigNeed(st.app_id, used_mem, min(100.0, used_sm)))
            ahead.append(MigNeed(st.app_id, t.mem_mib, min(100.0, t.sm_pct)))
        if not now:
            return None
        choice = plan_layout(sku, view.mig_instances, now, ahead, self.mig_reconfig_s)
        if choice is None:
            return None
        profiles = tuple(sorted(sku.profile(s.profile_id).name for s in choice.layout))  # type: ignore[union-attr]
        return MigTarget(view.device_id, profiles, f"forecast needs of {len(now)} application(s)")
