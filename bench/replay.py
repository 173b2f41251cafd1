"""Replay a canonical trace through the allocation policies on simulated GPUs, side by side.

    python bench/replay.py --trace migperf.csv.gz [--gpu h100-80gb] [--split test] --json

Every application of the trace (or of one split of it, vgpu/offline/splits.py) starts at replay time 0
and follows its own 1 s grid (TRACE_FORMAT.md step 1); the replay ticks once a second. Applications
are packed first-fit (largest first) onto simulated GPUs of `--gpu` so that their peaks fit: memory
within the GPU, summed peak SM share within 100 %. At each tick t every policy decides each
application's grant (memory MiB, SM %) in force at t + 1 from what it knows at t; the grant is
compared with the usage at t + 1.

Policies (one run, the same packing):
- `static`: each application gets its peak, for its whole run; power limits stay at the default.
- `reactive`: usage-based (DeepRes style): the last usage plus the margin, through the policy's
  hysteresis (allocator/policy/forecast.py).
- `vpa`: the Kubernetes VPA recommender: P90 of a decaying histogram of the usage (half-life 60 s,
  manager/baselines.py) + 15 %; after a memory violation the memory estimate is bumped to
  max(1.2 x usage, usage + 100 MiB) (VPA's OOM bump) and never falls under that again.
- `predictive` (vgpu): the P90 forecast over 1-5 s from the forecaster (the trained checkpoint when
  present, else gradient-boosted trees trained on the trace's train split, else the VPA percentile;
  the JSON says which), through the policy with the settings the daemon plans with
  (`vgpu.allocator.policy.forecast.PREDICTIVE_CONFIG`: margin, overrun bumps, SM threshold and shrink dwell,
  the leading rules, hard limits only where contended).
  `--set NAME=VALUE` (repeatable) overrides one of those settings for a trade-off study; the JSON
  lists the overrides under `predictive_overrides`.
- `oracle`: perfect foresight: the true peak of the next 5 s, no margin, through the policy.
Every dynamic policy chooses each GPU's power limit from its planned SM share
(allocator/policy/power.py) and sets it through the power-limit mechanism on its own simulated
backend; energy is the simulator's power draw, summed over the ticks a GPU has work.

What the applications live through (the physics, per policy, per second):
- Memory, handed out in launch order as a GPU does: usage over the grant in force is an OOM event.
  Where the policy's limit is hard (`Target.hard_mem_limit`: always for static, reactive, vpa and
  oracle; for predictive only on a device whose planned memory reaches `hard_limit_at_frac` of
  it) the application ends there (`backend.kill`), and its work so far is lost; under a
  cooperative limit the allocation fails, the application survives (as PyTorch raises and a
  training loop retries) and that second's work is lost. A GPU that runs out fails the
  allocation of whoever asks last, likewise. The policies see the demand (the trace), as the
  forecasters do. `kill_on_oom=False` (tests) makes every limit cooperative.
- SM: a grant is an MPS share that caps what the application gets (for predictive only where its
  plan says the device's SM is contended and its use exceeds it, `Target.hard_sm_limit`); applications of one GPU that
  together ask for more than it serves are time-sliced in proportion
  (`vgpu.device.sim.contention_speeds`, checked against Gavel and MISO in tests/test_contention.py).
  Their progress that second is what they got over what they asked.
- Power: a limit below what the GPU's work needs slows it by the Zeus curve the policy chose the
  limit with (`allocator/policy/power.py`: speed min(1, r / u)).
The trace is not stretched: an application's demand follows its trace, its progress is counted.
Its slowdown is seconds run / work done.

Metrics, over app-ticks (an application at one second, its first second excluded: no policy has
seen anything before it):
- `mem_slack_frac` / `sm_slack_frac`: mean of max(0, allocated - used) / allocated. Slack cannot be
  negative: a tick where usage exceeds the grant has no idle resource and counts in
- `mem_violation_rate` / `sm_violation_rate`: share of app-ticks with used > allocated.
- `changes_per_hour`: grant changes (memory or SM of an application, the first grant excluded) per
  application-hour.
- `energy_j`: simulated energy; `throttle_slowdown`: the simulator's own mean throttling slowdown
  on busy GPU-ticks (cube-root clock model; this was `mean_slowdown` before the physics above).
- `apps_killed_oom`, `oom_events`, `oom_event_rate` (per app-second run), `lost_work_s` (work of
  the killed applications); `mean_slowdown` / `p95_slowdown` over the applications that finished.
- Lead time of grant increases (`vgpu.allocator.policy.lead`): for each rise of usage beyond the
  grant in force 5 s earlier, how many seconds before the rise the grant had already grown to
  cover it (negative: after). `lead_time_median_s` over all rises (`rises`),
  `lead_time_median_visible_s` over rises after >= 2 s of rising usage (`rises_visible`), and the
  share of those covered >= 1 s ahead.
- `by_priority` (when the applications have several priority classes, `--pack mean` or `gpu`): the same
  figures per class, to show which yields first.

`--cooperative` makes every limit cooperative, so the OOM events of all policies are counted under
the same rules (with hard limits an application has at most one). `--pack mean` packs on mean usage instead of peaks: a denser node where peaks meet, GPUs are
contended, and every application gets a priority class 0-2 (round robin by name). `--pack gpu`
places applications as the trace's `gpu` column says (one GPU per value, peaks meeting or not;
applications without one first-fit by peaks), with the same priority classes. The JSON prints the
packing (`pack`, `packing`), and so does the table. `--mig` adds a MIG replay (`mig_replay`) beside a static layout. `tick_series(runs)`
gives per-second series per policy, for plots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vgpu.allocator.mechanisms.power import PowerLimitMechanism, PowerLimitResult  # noqa: E402
from vgpu.allocator.policy import lead  # noqa: E402
from vgpu.allocator.policy.base import IDLE_MEM_MIB  # noqa: E402
from vgpu.allocator.policy.forecast import (  # noqa: E402
    PREDICTIVE_CONFIG,
    AppState,
    DeviceState,
    PolicyConfig,
    Target,
    burst_returned,
    plan,
)
from vgpu.allocator.policy.power import (  # noqa: E402
    DEFAULT_CURVE,
    PowerCurve,
    PowerPolicyConfig,
    choose_power_limit_mw,
)
from vgpu.device.base import Device  # noqa: E402
from vgpu.device.errors import NotSupported  # noqa: E402
from vgpu.device.sim import ManualClock, SimBackend, contention_speeds  # noqa: E402
from vgpu.device.skus import LayoutSlot, MigLayout, Sku, get_sku  # noqa: E402
from vgpu.manager.forecast import Forecaster  # noqa: E402
from vgpu.traces import AppTrace, TraceFormatError, one_second_grid, read_trace  # noqa: E402

POLICIES = ("static", "reactive", "vpa", "predictive", "oracle")
HORIZON_S = 5
VPA_MARGIN = 0.15
VPA_OOM_RATIO = 1.2
VPA_OOM_MIN_MIB = 100.0
FORECASTERS = ("auto", "model", "gbdt", "vpa_percentile", "ewma", "last_value")
PACKINGS = ("peak", "mean", "gpu")
# lead time of grant increases: a rise is a second whose usage is more than RISE_FRAC over the
# second before and over the grant in force LEAD_WINDOW_S seconds earlier; one the forecast could
# see follows at least VISIBLE_RAMP_S seconds of rising usage
LEAD_WINDOW_S = lead.LEAD_WINDOW
RISE_FRAC = lead.RISE_FRAC
VISIBLE_RAMP_S = lead.VISIBLE_RAMP
PRIORITY_CLASSES = 3
# one policy's figures, as printed in the JSON (numbers, None where a figure has no data, and the
# per-priority breakdown)
Result = dict[str, Any]

# The policy settings each dynamic policy runs with (the same hysteresis for all).
REACTIVE_CONFIG = PolicyConfig(mem_margin_frac=0.10, sm_margin_frac=0.10, confidence_multiplier=0.0)
VPA_CONFIG = PolicyConfig(mem_margin_frac=VPA_MARGIN, sm_margin_frac=VPA_MARGIN, confidence_multiplier=0.0)
# predictive runs PREDICTIVE_CONFIG (allocator/policy/forecast.py), the daemon's own settings
ORACLE_CONFIG = PolicyConfig(mem_margin_frac=0.0, sm_margin_frac=0.0, confidence_multiplier=0.0)


class PowerController:
    """The replay's power loop, per device: choose a limit from the forecast need
    (`choose_power_limit_mw`) and apply it through the allocator's own `PowerLimitMechanism`. The
    daemon does the same inside `Allocator.apply_recommendations`; the replay drives devices without a
    ledger, so it keeps this small loop of its own."""

    def __init__(
        self,
        mechanism: PowerLimitMechanism | None = None,
        *,
        curve: PowerCurve = DEFAULT_CURVE,
        config: PowerPolicyConfig | None = None,
    ) -> None:
        self.mechanism = mechanism or PowerLimitMechanism()
        self.curve = curve
        self.config = config or PowerPolicyConfig()

    def step(self, devices: Sequence[Device], need_sm_pct: Mapping[str, float],
             full_power: frozenset[str] = frozenset()) -> list[PowerLimitResult]:
        """One decision per device (keyed by UUID); devices without a need entry are left alone,
        devices in `full_power` get their maximum limit. A device whose constraints cannot be read
        is handed to the mechanism, which disables itself for that device with one log line."""
        results = []
        for dev in devices:
            if dev.uuid not in need_sm_pct:
                continue
            if self.mechanism.disabled_reason(dev.uuid) is not None:
                results.append(self.mechanism.apply(dev, 0))  # reports "disabled: ..."
                continue
            try:
                constraints = dev.power_constraints()
            except NotSupported:  # the mechanism reads again and turns itself off for the device
                results.append(self.mechanism.apply(dev, 0))
                continue
            if dev.uuid in full_power:
                results.append(self.mechanism.apply(dev, constraints.max_mw))
                continue
            choice = choose_power_limit_mw(need_sm_pct[dev.uuid], constraints, self.curve, self.config)
            results.append(self.mechanism.apply(dev, choice.limit_mw))
        return results

    def stop(self) -> list[PowerLimitResult]:
        """Restore every original limit."""
        return self.mechanism.restore()


@dataclass(frozen=True)
class ReplayApp:
    app_id: str
    raw: AppTrace
    mem: np.ndarray  # 1 s grid
    sm: np.ndarray
    prefix_end: np.ndarray  # raw samples up to and including grid second k: raw[:prefix_end[k]]
    device: int = 0
    priority: int = 0
    # seconds the memory has risen (by more than RISE_FRAC a second) in a row up to second k, and
    # the mean rate over them (MiB/s; NaN when not rising): the policy's leading signal
    ramp_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ramp_rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # the rise over the ramp's last second (MiB/s; NaN when not rising)
    ramp_last: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # the first second whose memory is above IDLE_MEM_MIB (its first real use; ticks: never)
    first_use: int = 0

    @property
    def ticks(self) -> int:
        return len(self.mem)

    def history(self, k: int) -> AppTrace:
        n = int(self.prefix_end[k])
        cols = {c: v[:n] for c, v in self.raw.columns.items()}
        return AppTrace(self.raw.app, self.raw.t_s[:n], cols, self.raw.gpu)


def prepare(apps: Sequence[AppTrace]) -> tuple[list[ReplayApp], list[str]]:
    """1 s grids of both targets; an application lacking one, or with under 2 s, is left out."""
    out, skipped = [], []
    for a in apps:
        sec_m, mem = one_second_grid(a, "mem_used_mib")
        sec_s, sm = one_second_grid(a, "sm_util_pct")
        if len(mem) == 0 or len(sm) == 0:
            skipped.append(f"{a.app}: lacks a target column")
            continue
        start = int(max(sec_m[0], sec_s[0]))
        end = int(min(sec_m[-1], sec_s[-1]))
        if end - start + 1 < 2:
            skipped.append(f"{a.app}: under 2 s of both targets")
            continue
        mem = mem[start - sec_m[0]: end - sec_m[0] + 1]
        sm = sm[start - sec_s[0]: end - sec_s[0] + 1]
        edges = start + np.arange(1, len(mem) + 1, dtype=np.float64)
        prefix_end = np.searchsorted(a.t_s, edges, side="left")
        mem = mem.astype(np.float64)
        ramp_s, ramp_rate, ramp_last = ramps(mem)
        used = np.flatnonzero(mem > IDLE_MEM_MIB)
        out.append(ReplayApp(a.app, a, mem, np.clip(sm, 0, 100).astype(np.float64), prefix_end,
                             ramp_s=ramp_s, ramp_rate=ramp_rate, ramp_last=ramp_last,
                             first_use=int(used[0]) if len(used) else len(mem)))
    return out, skipped


def ramps(mem: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per second k: how many seconds in a row the usage has risen by more than RISE_FRAC up to k,
    its mean rate over them, and its rise over the last second (both NaN where it is not rising)."""
    n = len(mem)
    ramp_s = np.zeros(n)
    rate = np.full(n, math.nan)
    last = np.full(n, math.nan)
    for k in range(1, n):
        if mem[k] > mem[k - 1] * (1 + RISE_FRAC) and mem[k] > mem[k - 1]:
            ramp_s[k] = ramp_s[k - 1] + 1
            start = k - int(ramp_s[k])
            rate[k] = (mem[k] - mem[start]) / ramp_s[k]
            last[k] = mem[k] - mem[k - 1]
    return ramp_s, rate, last


def _first_fit(ordered: list[ReplayApp], sku: Sku, size: Callable[[ReplayApp], tuple[float, float]]) -> dict[str, int]:
    """First fit, in the given order, on `size` (memory MiB, SM %) per device: each application's
    device index. An application whose memory peak exceeds one GPU is an error."""
    bins: list[list[float]] = []  # [mem, sm] used per device
    placed: dict[str, int] = {}
    for a in ordered:
        if float(a.mem.max()) > sku.mem_total_mib:
            raise ValueError(f"{a.app_id} peaks at {a.mem.max():.0f} MiB, more than a {sku.key} has ({sku.mem_total_mib} MiB)")
        pm, ps = size(a)
        for i, b in enumerate(bins):
            if b[0] + pm <= sku.mem_total_mib and b[1] + ps <= 100.0 + 1e-9:
                b[0] += pm
                b[1] += ps
                placed[a.app_id] = i
                break
        else:
            bins.append([pm, ps])
            placed[a.app_id] = len(bins) - 1
    return placed


def pack(apps: list[ReplayApp], sku: Sku) -> list[ReplayApp]:
    """First-fit decreasing on (peak SM, peak memory): every device's peaks fit it."""
    ordered = sorted(apps, key=lambda a: (-float(a.sm.max()), -float(a.mem.max()), a.app_id))
    placed = _first_fit(ordered, sku, lambda a: (float(a.mem.max()), float(a.sm.max())))
    return [replace(a, device=placed[a.app_id]) for a in apps]


def pack_mean(apps: list[ReplayApp], sku: Sku) -> list[ReplayApp]:
    """A denser node: first-fit decreasing on mean usage (memory within the GPU, mean SM within
    100 %), so peaks may meet and the GPUs are contended. Each application gets a priority class
    0..PRIORITY_CLASSES-1 (round robin by name), so contention has someone to favour."""
    ordered = sorted(apps, key=lambda a: (-float(a.mem.mean()), -float(a.sm.mean()), a.app_id))
    placed = _first_fit(ordered, sku, lambda a: (float(a.mem.mean()), float(a.sm.mean())))
    prio = {name: i % PRIORITY_CLASSES for i, name in enumerate(sorted(a.app_id for a in apps))}
    return [replace(a, device=placed[a.app_id], priority=prio[a.app_id]) for a in apps]


def pack_gpu(apps: list[ReplayApp], sku: Sku) -> list[ReplayApp]:
    """The trace's own placement: one simulated GPU per distinct `gpu` value (in sorted order), every
    application that names it on it, whether or not their peaks fit together; applications without
    one are packed first-fit by peaks (as `pack`) on GPUs after those. Each application gets a
    priority class as in `pack_mean`. A trace without any `gpu` value, or an application whose
    peak exceeds one GPU, is a ValueError."""
    named = sorted({a.raw.gpu for a in apps if a.raw.gpu})
    if not named:
        raise ValueError("--pack gpu: the trace has no gpu column (or it is empty); use --pack peak or mean")
    index = {g: i for i, g in enumerate(named)}
    for a in apps:
        if float(a.mem.max()) > sku.mem_total_mib:
            raise ValueError(f"{a.app_id} peaks at {a.mem.max():.0f} MiB, more than a {sku.key} has ({sku.mem_total_mib} MiB)")
    rest = sorted((a for a in apps if not a.raw.gpu), key=lambda a: (-float(a.sm.max()), -float(a.mem.max()), a.app_id))
    placed = {a.app_id: index[a.raw.gpu] for a in apps if a.raw.gpu}
    placed.update({app: len(named) + d for app, d in
                   _first_fit(rest, sku, lambda a: (float(a.mem.max()), float(a.sm.max()))).items()})
    prio = {name: i % PRIORITY_CLASSES for i, name in enumerate(sorted(a.app_id for a in apps))}
    return [replace(a, device=placed[a.app_id], priority=prio[a.app_id]) for a in apps]


def packing(apps: Sequence[ReplayApp]) -> dict[str, list[str]]:
    """GPU index -> the applications on it (with their priority when not 0), for the JSON."""
    out: dict[str, list[str]] = {}
    for a in sorted(apps, key=lambda a: (a.device, a.app_id)):
        out.setdefault(str(a.device), []).append(a.app_id if a.priority == 0 else f"{a.app_id} (priority {a.priority})")
    return out


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------
def slack_and_violations(alloc: np.ndarray, used: np.ndarray) -> tuple[float, float]:
    """(mean of max(0, alloc - used) / alloc, share of used > alloc) over the given app-ticks.

    A zero allocation (an idle application granted nothing, e.g. 0 % SM) holds no slack; any use
    on it is a violation. A negative allocation is an error."""
    alloc = np.asarray(alloc, dtype=np.float64)
    used = np.asarray(used, dtype=np.float64)
    if alloc.shape != used.shape or alloc.size == 0:
        raise ValueError("alloc and used must be non-empty and of one shape")
    if np.any(alloc < 0):
        raise ValueError("an allocation must be >= 0")
    positive = alloc > 0
    slack = np.zeros_like(alloc)
    slack[positive] = np.maximum(alloc[positive] - used[positive], 0.0) / alloc[positive]
    return float(slack.mean()), float(np.mean(used > alloc + 1e-9))


def lead_times(used: np.ndarray, granted: np.ndarray, window_s: int = LEAD_WINDOW_S) -> list[tuple[int, int]]:
    """(lead seconds, seconds of rising usage before it) for each rise of one application, on the
    replay's 1 s grid (vgpu.allocator.policy.lead)."""
    return lead.lead_times([float(x) for x in used], [float(x) for x in granted], window_s, RISE_FRAC)


@dataclass
class AppRecord:
    """One application under one policy."""

    app_id: str
    device: int
    priority: int
    grant_mem: list[float] = field(default_factory=list)  # in force each second it ran (NaN: none)
    used_mem: list[float] = field(default_factory=list)
    progress: float = 0.0  # seconds of work done (a second at full speed is 1)
    ticks_run: int = 0
    oom_events: int = 0
    killed_at: int | None = None

    @property
    def slowdown(self) -> float:
        return self.ticks_run / self.progress if self.progress > 0 else math.inf


@dataclass
class _TickTotals:
    mem_granted: float = 0.0
    mem_used: float = 0.0
    sm_granted: float = 0.0
    sm_used: float = 0.0
    oom: int = 0
    speed_sum: float = 0.0
    apps: int = 0

    def add(self, mem_granted: float, mem_used: float, sm_granted: float, sm_used: float) -> None:
        self.mem_granted += mem_granted
        self.mem_used += mem_used
        self.sm_granted += sm_granted
        self.sm_used += sm_used


def _user_figures(recs: Sequence[AppRecord]) -> Result:
    """What users feel, over a set of applications: kills, OOM events, slowdown, lead times."""
    done = [r.slowdown for r in recs if r.killed_at is None and r.ticks_run > 0]
    leads = [lt for r in recs for lt in lead_times(np.array(r.used_mem), np.array(r.grant_mem))]
    summary = lead.summarize(leads, VISIBLE_RAMP_S)
    ticks = sum(r.ticks_run for r in recs)
    return {
        "apps": len(recs),
        "apps_killed_oom": sum(r.killed_at is not None for r in recs),
        "oom_events": sum(r.oom_events for r in recs),
        "oom_event_rate": round(sum(r.oom_events for r in recs) / ticks, 5) if ticks else 0.0,
        "mean_slowdown": round(float(np.mean(done)), 4) if done else None,
        "p95_slowdown": round(float(np.percentile(done, 95)), 4) if done else None,
        "lost_work_s": round(sum(r.progress for r in recs if r.killed_at is not None), 1),
        "rises": summary.rises,
        "lead_time_median_s": summary.median,
        "rises_visible": summary.rises_visible,
        "lead_time_median_visible_s": summary.median_visible,
        "lead_time_ahead_frac_visible": summary.ahead_frac_visible,
    }


@dataclass
class PolicyRun:
    name: str
    config: PolicyConfig | None
    mem_alloc: list[float] = field(default_factory=list)
    mem_used: list[float] = field(default_factory=list)
    sm_alloc: list[float] = field(default_factory=list)
    sm_used: list[float] = field(default_factory=list)
    changes: int = 0
    energy_j: float = 0.0
    slowdowns: list[float] = field(default_factory=list)  # the simulator's power throttling, per busy GPU-second
    apps: dict[str, AppRecord] = field(default_factory=dict)
    ticks: list[_TickTotals] = field(default_factory=list)

    def result(self, app_hours: float) -> Result:
        ms, mv = slack_and_violations(np.array(self.mem_alloc), np.array(self.mem_used))
        ss, sv = slack_and_violations(np.array(self.sm_alloc), np.array(self.sm_used))
        recs = list(self.apps.values())
        out: Result = {
            "policy": self.name,
            "mem_slack_frac": round(ms, 4),
            "mem_violation_rate": round(mv, 4),
            "sm_slack_frac": round(ss, 4),
            "sm_violation_rate": round(sv, 4),
            "changes_per_hour": round(self.changes / app_hours, 2) if app_hours > 0 else 0.0,
            "energy_j": round(self.energy_j, 1),
            "throttle_slowdown": round(float(np.mean(self.slowdowns)), 4) if self.slowdowns else 1.0,
        }
        out.update(_user_figures(recs))
        del out["apps"]
        if out["mean_slowdown"] is None:
            out["mean_slowdown"] = 1.0
        classes = sorted({r.priority for r in recs})
        if len(classes) > 1:
            out["by_priority"] = {str(c): _user_figures([r for r in recs if r.priority == c]) for c in classes}
        return out


# ------------------------------------------------------------------------------------------------
# forecasters
# ------------------------------------------------------------------------------------------------
def default_checkpoint() -> Path | None:
    """The shipped forecaster checkpoint under manager/models/, if any."""
    try:
        from vgpu.manager import predictor
    except ImportError:
        return None
    for attr in ("DEFAULT_MODEL_PATH", "DEFAULT_CHECKPOINT"):
        value = getattr(predictor, attr, None)
        if value and Path(value).is_file():
            return Path(value)
    models = ROOT / "manager" / "models"
    found = sorted(p for p in models.glob("*.pt") if "coldstart" not in p.name) if models.is_dir() else []
    return found[0] if found else None


def config_overrides(base: PolicyConfig, assignments: Sequence[str]) -> tuple[PolicyConfig, dict[str, float]]:
    """`base` with each NAME=VALUE applied to one of its numeric settings. An unknown name, a value
    that is not a number, or one the config refuses (PolicyConfig validates) is a ValueError."""
    numeric = sorted(f.name for f in fields(base) if isinstance(getattr(base, f.name), float))
    changes: dict[str, float] = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in numeric:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE, NAME one of {', '.join(numeric)}")
        try:
            changes[name] = float(text)
        except ValueError:
            raise ValueError(f"--set {item!r}: {text.strip()!r} is not a number") from None
    return PolicyConfig(**{**asdict(base), **changes}), changes


def make_forecaster(kind: str, train: Sequence[AppTrace], checkpoint: Path | None) -> tuple[Forecaster, str]:
    """(forecaster, description). `auto`: the checkpoint, else gbdt on `train`, else vpa_percentile."""
    from vgpu.manager import baselines

    if kind in ("auto", "model"):
        path = checkpoint or default_checkpoint()
        if path is not None:
            from vgpu.manager.checkpoint import CheckpointError
            from vgpu.manager.predictor import load_forecaster

            try:
                return load_forecaster(path, "cpu"), f"model ({path.name})"
            except CheckpointError as exc:
                raise ValueError(f"cannot use the forecaster checkpoint: {exc}") from exc
        if kind == "model":
            raise FileNotFoundError("no forecaster checkpoint: pass --checkpoint or train one (vgpu train)")
        kind = "gbdt" if train else "vpa_percentile"
    if kind == "gbdt":
        if not train:
            raise ValueError("gbdt needs training applications (the trace's train split is empty)")
        return baselines.GbdtForecaster().fit(train), f"gbdt (no model checkpoint; trained on {len(train)} train-split apps)"
    if kind == "vpa_percentile":
        return baselines.VpaPercentileForecaster(), "vpa_percentile (no model checkpoint, no train split)"
    if kind == "ewma":
        return baselines.EwmaForecaster(), "ewma"
    if kind == "last_value":
        return baselines.LastValueForecaster(), "last_value"
    raise ValueError(f"unknown forecaster {kind!r}; one of {FORECASTERS}")


# ------------------------------------------------------------------------------------------------
# the replay
# ------------------------------------------------------------------------------------------------
def _nanmax(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


def replay(
    apps: list[ReplayApp],
    sku: Sku,
    forecaster: Forecaster,
    *,
    vpa_forecaster: Forecaster | None = None,
    policies: Sequence[str] = POLICIES,
    configs: dict[str, PolicyConfig] | None = None,
    progress: Callable[[int, int], None] | None = None,
    runs_out: dict[str, PolicyRun] | None = None,
    kill_on_oom: bool = True,
    curve: PowerCurve = DEFAULT_CURVE,
    timeline_out: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] | None = None,
    decisions_out: dict[tuple[str, str], list[tuple[int, AppState, Target]]] | None = None,
) -> list[Result]:
    """Run every policy over the packed applications; one result dict per policy. `runs_out`, when
    given, receives each policy's per-app-tick record (for tests and plots: `tick_series`).
    `kill_on_oom=False` makes every memory limit cooperative (an overrun is never fatal).
    `timeline_out`, per (policy, app), receives (t, used MiB, P50 MiB, P90 MiB, grant MiB in force
    at t) at each tick a policy decides (bench/replay_plot.py draws it). `decisions_out`, per (policy, app),
    receives (t, the state the policy planned with at t, its target) for each dynamic policy's plan
    (bench/replay_events.py reads it)."""
    from vgpu.manager.baselines import VpaPercentileForecaster

    vpa_fc = vpa_forecaster or VpaPercentileForecaster()
    cfgs = {"reactive": REACTIVE_CONFIG, "vpa": VPA_CONFIG, "predictive": PREDICTIVE_CONFIG,
            "oracle": ORACLE_CONFIG, **(configs or {})}
    n_dev = max(a.device for a in apps) + 1
    horizon = max(a.ticks for a in apps)
    devices = [DeviceState(str(i), float(sku.mem_total_mib)) for i in range(n_dev)]
    runs = {p: PolicyRun(p, cfgs.get(p)) for p in policies}
    for run in runs.values():
        run.apps = {a.app_id: AppRecord(a.app_id, a.device, a.priority) for a in apps}
    if runs_out is not None:
        runs_out.update(runs)
    clock = ManualClock()
    backends = {p: SimBackend([sku] * n_dev, clock=clock) for p in policies}
    controllers = {p: PowerController(PowerLimitMechanism(logger=_QuietLog())) for p in policies if p != "static"}
    pids: dict[str, int] = {}
    for p in policies:
        for i, a in enumerate(apps):
            pids[a.app_id] = 1001 + i
            backends[p].launch(a.app_id, pids[a.app_id], a.raw, a.device)
    states: dict[str, dict[str, AppState]] = {p: {} for p in policies}
    hard: dict[str, dict[str, bool]] = {p: {} for p in policies}
    hard_sm: dict[str, dict[str, bool]] = {p: {} for p in policies}
    oom_floor: dict[str, float] = {}
    # per policy and application: the memory P90 it planned with a second before, and the seconds since
    # the usage last went over it in which the usage moved and stayed under it (AppState.mem_p90_covered_s)
    last_p90: dict[str, dict[str, float]] = {p: {} for p in policies}
    covered: dict[str, dict[str, float]] = {p: {} for p in policies}
    # per policy and application: its memory bursts (second, usage before, rise MiB, come back down
    # since), for AppState.mem_burst_mib
    bursts: dict[str, dict[str, list[tuple[int, float, float, bool]]]] = {p: {} for p in policies}
    mem_cap = float(sku.mem_total_mib)

    for k in range(horizon):
        clock.set(float(k) + 0.5)  # the middle of second k
        active = [a for a in apps if k < a.ticks]
        observed: dict[str, dict[str, float]] = {p: {} for p in policies}
        for p in policies:
            run = runs[p]
            alive = [a for a in active if run.apps[a.app_id].killed_at is None]
            tick = _TickTotals()
            # 1. memory in launch order, as a GPU hands it out: an overrun of the grant is an OOM
            #    event (hard limit: the application ends; cooperative: the allocation fails and the
            #    application survives, held at its grant, its second of work lost); a device that
            #    runs out fails the allocations of whoever asks last
            dev_used: dict[int, float] = {}
            failed: set[str] = set()
            running: list[ReplayApp] = []
            for a in alive:
                rec = run.apps[a.app_id]
                st = states[p].get(a.app_id)
                demand = float(a.mem[k])
                grant = st.granted_mem_mib if (st is not None and k > 0) else math.inf
                if k > 0 and st is not None:  # 2. score the grants in force during second k
                    run.mem_alloc.append(st.granted_mem_mib)
                    run.mem_used.append(demand)
                    run.sm_alloc.append(st.granted_sm_pct)
                    run.sm_used.append(float(a.sm[k]))
                    tick.add(st.granted_mem_mib, demand, st.granted_sm_pct, float(a.sm[k]))
                    if p == "vpa" and demand > grant + 1e-9:
                        bump = max(demand * VPA_OOM_RATIO, demand + VPA_OOM_MIN_MIB)
                        oom_floor[a.app_id] = max(oom_floor.get(a.app_id, 0.0), bump)
                rec.grant_mem.append(grant if math.isfinite(grant) else math.nan)
                rec.used_mem.append(demand)
                got = demand
                if demand > grant + 1e-9:
                    rec.oom_events += 1
                    tick.oom += 1
                    if kill_on_oom and hard[p].get(a.app_id, True):
                        rec.killed_at = k
                        backends[p].kill(pids[a.app_id])
                        continue
                    got = grant
                    failed.add(a.app_id)
                room = mem_cap - dev_used.get(a.device, 0.0)
                if got > room + 1e-9:
                    rec.oom_events += 1
                    tick.oom += 1
                    got = max(room, 0.0)
                    failed.add(a.app_id)
                dev_used[a.device] = dev_used.get(a.device, 0.0) + got
                observed[p][a.app_id] = got
                running.append(a)
            # 3. SM: the grant is an MPS share; a device asked for more than it serves time-slices
            #    (vgpu.device.sim.contention_speeds); a power limit slows the device's work by the
            #    Zeus curve (allocator/policy/power.py)
            devs = backends[p].devices()
            by_dev: dict[int, list[ReplayApp]] = {}
            for a in running:
                by_dev.setdefault(a.device, []).append(a)
            for d, group in by_dev.items():
                demand_sm = [float(a.sm[k]) for a in group]
                shares = [states[p][a.app_id].granted_sm_pct
                          if (k > 0 and a.app_id in states[p] and hard_sm[p].get(a.app_id, True)) else math.inf
                          for a in group]
                speeds = contention_speeds(demand_sm, 100.0, shares)
                dev = devs[d]
                c = dev.power_constraints()
                r = max(curve.throughput_at(dev.power_limit_mw() / c.max_mw), 1e-6)
                u = sum(v * s for v, s in zip(speeds, demand_sm, strict=True)) / 100.0
                power_speed = min(1.0, r / u) if u > 0 else 1.0
                for a, v in zip(group, speeds, strict=True):
                    rec = run.apps[a.app_id]
                    speed = 0.0 if a.app_id in failed else v * power_speed
                    rec.progress += speed
                    rec.ticks_run += 1
                    tick.speed_sum += speed
                    tick.apps += 1
            # energy of second k under the limits in force
            for dev in devs:
                if dev.index in by_dev:
                    run.energy_j += dev.power_usage_mw() / 1000.0
                    run.slowdowns.append(dev.throttle().slowdown)
            run.ticks.append(tick)
        # 4. forecasts at origin k (one batch per forecaster)
        deciding = [a for a in active if k + 1 < a.ticks]
        if not deciding:
            continue
        forecasts = forecaster.forecast_batch([a.history(k) for a in deciding]) if "predictive" in policies else []
        vpa_fcs = vpa_fc.forecast_batch([a.history(k) for a in deciding]) if "vpa" in policies else []
        # 5. each policy plans the grants for second k + 1
        for p in policies:
            run = runs[p]
            cfg = run.config
            new_states = []
            for i, a in enumerate(deciding):
                if a.app_id not in observed[p]:
                    continue  # ended by an OOM
                old = states[p].get(a.app_id) or AppState(a.app_id, str(a.device), priority=a.priority)
                # the policy sees the demand, as the forecasters do (their histories are the trace);
                # in a second whose allocation failed, what the application asked for
                used_m, used_s = float(a.mem[k]), float(a.sm[k])
                f_m = f_s = math.nan
                if timeline_out is not None:
                    fc = forecasts[i] if p == "predictive" else vpa_fcs[i] if p == "vpa" else None
                    timeline_out.setdefault((p, a.app_id), []).append((
                        float(k), used_m, _nanmax(fc.mem_p50_mib) if fc else math.nan,
                        _nanmax(fc.mem_p90_mib) if fc else math.nan,
                        old.granted_mem_mib if a.app_id in states[p] else math.nan))
                if p == "static":
                    new_states.append(replace(old, granted_mem_mib=float(a.mem.max()), granted_sm_pct=float(a.sm.max())))
                    continue
                if p == "predictive":
                    f_m, f_s = _nanmax(forecasts[i].mem_p90_mib), _nanmax(forecasts[i].sm_p90_pct)
                elif p == "vpa":
                    f_m, f_s = _nanmax(vpa_fcs[i].mem_p90_mib), _nanmax(vpa_fcs[i].sm_p90_pct)
                    if a.app_id in oom_floor:
                        f_m = max(f_m if not math.isnan(f_m) else 0.0, oom_floor[a.app_id] / (1 + VPA_MARGIN))
                elif p == "oracle":
                    f_m = float(a.mem[k + 1: k + 1 + HORIZON_S].max())
                    f_s = float(a.sm[k + 1: k + 1 + HORIZON_S].max())
                window = int(cfg.mem_shrink_window_s) if cfg is not None else 0
                before = last_p90[p].get(a.app_id, math.nan)
                if not used_m <= before + 1e-9:  # over the P90 (or none to judge by): start again
                    covered[p][a.app_id] = 0.0
                elif k > 0 and used_m != float(a.mem[k - 1]):  # moved, and covered
                    covered[p][a.app_id] = covered[p].get(a.app_id, 0.0) + 1.0
                last_p90[p][a.app_id] = f_m
                active_s = float(k - a.first_use + 1) if k >= a.first_use else math.nan
                burst_mib = 0.0
                if cfg is not None and cfg.mem_burst_window_s > 0:
                    # bursts (second, usage before, rise, come back down since), as UsageHistory keeps them
                    seen = bursts[p].setdefault(a.app_id, [])
                    seen[:] = [(t, b, r, back or burst_returned(used_m, b, r)) for t, b, r, back in seen
                               if k - t < cfg.mem_burst_window_s]
                    prev = float(a.mem[k - 1]) if k > 0 else math.nan
                    if cfg.is_burst(used_m - prev, prev, before, active_s):
                        seen.append((k, prev, used_m - prev, False))
                    burst_mib = max((r for _, _, r, back in seen if back), default=0.0)
                new_states.append(replace(
                    old, used_mem_mib=used_m, used_sm_pct=used_s,
                    forecast_mem_p90_mib=f_m, forecast_sm_p90_pct=f_s, history_s=float(k + 1),
                    mem_ramp_s=float(a.ramp_s[k]), mem_ramp_rate_mib_s=float(a.ramp_rate[k]),
                    mem_ramp_last_mib_s=float(a.ramp_last[k]), mem_ramp_prev_s=float(a.ramp_s[k - 1]) if k > 0 else 0.0,
                    recent_peak_mem_mib=float(a.mem[max(0, k - window + 1): k + 1].max()) if window > 0 else math.nan,
                    active_s=active_s,
                    mem_p90_covered_s=covered[p].get(a.app_id, 0.0), mem_burst_mib=burst_mib,
                ))
            if p == "static":
                for st in new_states:
                    states[p][st.app_id] = st
                continue
            result = plan(new_states, devices, float(k), cfg)
            need_by_dev: dict[str, float] = {}
            for st in new_states:
                t = result.target(st.app_id)
                if decisions_out is not None:
                    decisions_out.setdefault((p, st.app_id), []).append((k, st, t))
                if st.app_id in states[p] and t.changed:
                    run.changes += 1
                hard[p][st.app_id] = t.hard_mem_limit
                hard_sm[p][st.app_id] = t.hard_sm_limit
                states[p][st.app_id] = replace(
                    st, granted_mem_mib=t.mem_mib, granted_sm_pct=t.sm_pct,
                    last_mem_change_s=float(k) if t.changed_mem else st.last_mem_change_s,
                    last_sm_change_s=float(k) if t.changed_sm else st.last_sm_change_s,
                )
                need_by_dev[t.device_id] = min(100.0, need_by_dev.get(t.device_id, 0.0) + t.sm_pct)
            # 6. power limits for second k + 1, from the planned SM share
            devs = backends[p].devices()
            clock_dev = {str(d.index): d for d in devs}
            full = frozenset(clock_dev[dp.device_id].uuid for dp in result.devices if dp.full_power)
            controllers[p].step(devs, {clock_dev[d].uuid: v for d, v in need_by_dev.items()}, full)
        if progress:
            progress(k, horizon)
    app_hours = sum(max(a.ticks - 1, 0) for a in apps) / 3600.0
    return [runs[p].result(app_hours) for p in policies]


def tick_series(runs: Mapping[str, PolicyRun]) -> dict[str, dict[str, list[float]]]:
    """Per policy, one value per replay second: memory and SM granted and used (sums over the
    applications scored that second), OOM events, and the mean progress rate of the applications
    that ran. For plots of a replay (`replay(..., runs_out=runs)`)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, run in runs.items():
        out[name] = {
            "mem_granted_mib": [t.mem_granted for t in run.ticks],
            "mem_used_mib": [t.mem_used for t in run.ticks],
            "sm_granted_pct": [t.sm_granted for t in run.ticks],
            "sm_used_pct": [t.sm_used for t in run.ticks],
            "oom_events": [float(t.oom) for t in run.ticks],
            "mean_speed": [t.speed_sum / t.apps if t.apps else 1.0 for t in run.ticks],
        }
    return out


# ------------------------------------------------------------------------------------------------
# MIG: slices used, reconfigurations and their lead time, beside a static layout (--mig)
# ------------------------------------------------------------------------------------------------
def pack_mig(apps: list[ReplayApp], sku: Sku) -> list[ReplayApp]:
    """First-fit decreasing on peak memory: an application joins a GPU while one valid MIG layout
    still gives every application there its own instance holding its peak."""
    from vgpu.allocator.mechanisms.mig import MigNeed, choose_layout

    groups: list[list[ReplayApp]] = []
    placed: dict[str, int] = {}
    for a in sorted(apps, key=lambda a: (-float(a.mem.max()), a.app_id)):
        for i, g in enumerate(groups):
            if choose_layout(sku, [MigNeed(x.app_id, float(x.mem.max())) for x in (*g, a)]) is not None:
                g.append(a)
                placed[a.app_id] = i
                break
        else:
            if choose_layout(sku, [MigNeed(a.app_id, float(a.mem.max()))]) is None:
                raise ValueError(f"{a.app_id} peaks at {a.mem.max():.0f} MiB, more than any MIG instance of {sku.key}")
            groups.append([a])
            placed[a.app_id] = len(groups) - 1
    return [replace(a, device=placed[a.app_id]) for a in apps]


@dataclass
class _MigGpu:
    layout: MigLayout  # in force
    assignment: dict[str, tuple[int, int]]  # app -> (memory MiB, compute slices) of its instance, in force
    # (ready tick, layout, assignment) of a reconfiguration under way
    pending: tuple[int, MigLayout, dict[str, tuple[int, int]]] | None = None


def mig_replay(apps: list[ReplayApp], sku: Sku, forecaster: Forecaster, *, reconfig_s: float = 6.0,
               config: PolicyConfig = PREDICTIVE_CONFIG) -> list[Result]:
    """Each GPU in MIG mode, one instance per application (memory only: the traces' SM is measured
    on the slice each run had, not on a whole GPU, so an instance is sized by memory and gets at
    least one compute slice).

    - `static`: the layout that holds every application's peak, from the start, never changed.
    - `predictive`: at each second the layout (mechanisms/mig.py: `MigScheduler`) for the larger of
      the usage now and the need `reconfig_s` ahead: the forecast's P90 extended to that lead
      (`needs_ahead`) plus the policy's margin and lead headroom. A change takes `reconfig_s`; until
      then the old layout is in force. The replay assumes an application can move to its new
      instance when it is ready (a checkpoint/restore at a step boundary); the daemon itself never
      destroys a busy instance (tests/test_mig_managed.py).

    Per policy: `slices_used` (mean compute slices of the instances of running applications per
    busy GPU-second), `slice_seconds` (their sum), `slices_held` (every instance of the layout:
    the planner keeps an instance it no longer needs rather than destroy it), `instance_mem_mib` (mean
    memory of the instances of running applications per busy GPU-second),
    `reconfigurations`, `oom_events` (usage over the memory of the instance in force), and the lead
    time of each reconfiguration: the first second at or after the decision whose usage the old
    layout no longer holds, minus the second the new one is ready (positive: ready ahead of the
    need; `unneeded`: the old layout held to the end)."""
    from vgpu.allocator.mechanisms.mig import MigNeed, MigScheduler, _assign, choose_layout, needs_ahead

    def size_of(slot: LayoutSlot) -> tuple[int, int]:
        prof = sku.profile(slot.profile_id)
        assert prof is not None
        return int(prof.mem_mib), prof.slice_count

    def slices_of(layout: MigLayout) -> int:
        total = 0
        for slot in layout:
            prof = sku.profile(slot.profile_id)
            assert prof is not None
            total += prof.slice_count
        return total

    def fits(layout: MigLayout, needs: list[MigNeed]) -> bool:
        return _assign(sku, layout, needs) is not None

    sched = MigScheduler(sku, reconfig_s)
    lead_ticks = int(math.ceil(max(reconfig_s, 0.0)))
    by_gpu: dict[int, list[ReplayApp]] = {}
    for a in apps:
        by_gpu.setdefault(a.device, []).append(a)
    horizon = max(a.ticks for a in apps)
    out: list[Result] = []
    for policy in ("static", "predictive"):
        gpus: dict[int, _MigGpu] = {}
        slice_s = held_s = busy_s = ooms = reconfigs = 0
        mem_s = 0.0
        leads: list[int] = []
        unneeded = 0
        watching: list[tuple[int, int, MigLayout, int]] = []  # (gpu, decided, old layout, ready)
        for k in range(horizon):
            active = [a for a in apps if k < a.ticks]
            fcs = (forecaster.forecast_batch([a.history(k) for a in active])
                   if policy == "predictive" and active else [])
            fc_of = {a.app_id: f for a, f in zip(active, fcs, strict=True)} if fcs else {}
            for gi, group in by_gpu.items():
                live = [a for a in group if k < a.ticks]
                if not live:
                    continue
                now = [MigNeed(a.app_id, float(a.mem[k])) for a in live]
                gpu = gpus.get(gi)
                if gpu is not None and gpu.pending is not None and gpu.pending[0] <= k:
                    gpu.layout, gpu.assignment, gpu.pending = gpu.pending[1], gpu.pending[2], None
                # the need of second k against the layout in force
                for w in list(watching):
                    if w[0] == gi and not fits(w[2], now):
                        leads.append(k - w[3])
                        watching.remove(w)
                if gpu is not None:
                    for a in live:
                        if float(a.mem[k]) > gpu.assignment.get(a.app_id, (0, 0))[0] + 1e-9:
                            ooms += 1
                    slice_s += sum(gpu.assignment.get(a.app_id, (0, 0))[1] for a in live)
                    mem_s += sum(gpu.assignment.get(a.app_id, (0, 0))[0] for a in live)
                    held_s += slices_of(gpu.layout)
                    busy_s += 1
                # decide the layout
                if policy == "static":
                    if gpu is None:
                        choice = choose_layout(sku, [MigNeed(a.app_id, float(a.mem.max())) for a in group])
                        assert choice is not None
                        gpus[gi] = _MigGpu(choice.layout, {app: size_of(slot) for app, slot in choice.assignment})
                    continue
                ahead = []
                for a in live:
                    f = fc_of[a.app_id]
                    need = needs_ahead(f.horizons_s, f.mem_p90_mib, reconfig_s)
                    need = float(a.mem[k]) if math.isnan(need) else max(need, float(a.mem[k]))
                    ahead.append(MigNeed(a.app_id, need * (1.0 + config.mem_margin_frac + config.mem_lead_frac)))
                if gpu is None:  # the first layout, made before the applications start
                    choice = choose_layout(sku, ahead) or choose_layout(sku, now)
                    assert choice is not None
                    gpus[gi] = _MigGpu(choice.layout, {app: size_of(slot) for app, slot in choice.assignment})
                    continue
                if gpu.pending is not None:
                    continue  # a reconfiguration is under way
                current = gpu.layout
                try:
                    choice = sched.decide(current, now, ahead)
                except ValueError:
                    choice = None
                if choice is None and not fits(current, now):
                    choice = choose_layout(sku, now, current)
                if choice is None or choice.layout == current:
                    continue
                reconfigs += 1
                ready = k + lead_ticks
                gpu.pending = (ready, choice.layout, {app: size_of(slot) for app, slot in choice.assignment})
                if fits(current, now):
                    watching.append((gi, k, current, ready))
                else:  # the need is already here: the change comes reconfig_s after it
                    leads.append(k - ready)
        unneeded = len(watching)
        out.append({
            "policy": f"mig-{policy}",
            "gpus": len(by_gpu),
            "slices_used": round(slice_s / busy_s, 3) if busy_s else 0.0,
            "slice_seconds": slice_s,
            "slices_held": round(held_s / busy_s, 3) if busy_s else 0.0,
            "instance_mem_mib": round(mem_s / busy_s, 1) if busy_s else 0.0,
            "reconfigurations": reconfigs,
            "oom_events": ooms,
            "lead_time_median_s": float(np.median(leads)) if leads else None,
            "lead_times_s": sorted(leads),
            "unneeded_reconfigurations": unneeded,
        })
    return out


class _QuietLog:
    """The replay changes power limits every few seconds on dozens of GPUs; it does not log them."""

    def info(self, *a: object, **k: object) -> None:
        pass

    warning = error = debug = info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/replay.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="canonical trace (.csv or .csv.gz)")
    ap.add_argument("--gpu", default=None, help="simulated GPU SKU (default h100-80gb; with --mig a100-80gb)")
    ap.add_argument("--mig", action="store_true",
                    help="also replay MIG layouts (slices used, reconfigurations, lead time) beside a static layout")
    ap.add_argument("--mig-reconfig-s", type=float, default=6.0, help="seconds a MIG reconfiguration takes (default 6)")
    ap.add_argument("--split", default="test", choices=("train", "val", "test", "all"),
                    help="applications to replay (vgpu/offline/splits.py; default test)")
    ap.add_argument("--forecaster", default="auto", choices=FORECASTERS,
                    help="predictive policy's forecaster (auto: the checkpoint, else gbdt on the train split)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="forecaster checkpoint (default: manager/models/)")
    ap.add_argument("--max-apps", type=int, default=0, help="replay only the first N applications (0: all)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override one PREDICTIVE_CONFIG setting of the predictive policy (repeatable)")
    ap.add_argument("--pack", default="peak", choices=PACKINGS,
                    help="peak: first-fit so every GPU holds its applications' peaks (no contention); mean: "
                         "first-fit on mean usage, a denser node where peaks meet, with priority classes; gpu: "
                         "the trace's gpu column (one GPU per value; the rest first-fit by peaks), with priority "
                         "classes")
    ap.add_argument("--cooperative", action="store_true",
                    help="every memory limit cooperative (no policy's overrun ends an application), to compare "
                         "OOM events under the same rules")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--plot", type=Path, metavar="DIR",
                    help="also draw use, forecast and grant per application, policy beside policy, into DIR")
    ap.add_argument("--plot-apps", type=int, default=6, help="with --plot: draw the first N applications (default 6)")
    args = ap.parse_args(argv)

    from vgpu.offline.splits import select

    try:
        predictive_config, overrides = config_overrides(PREDICTIVE_CONFIG, args.set)
        sku = get_sku(args.gpu or ("a100-80gb" if args.mig else "h100-80gb"))
        if args.mig and not sku.supports_mig:
            raise ValueError(f"--mig needs a GPU with MIG; {sku.key} has none")
        trace = read_trace(args.trace)
    except (ValueError, TraceFormatError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    chosen = select(trace.apps, args.split)
    if not chosen:
        print(f"replay: no application of {args.trace} falls in the {args.split!r} split", file=sys.stderr)
        return 2
    names = sorted(chosen)
    if args.max_apps > 0:
        names = names[: args.max_apps]
    apps, skipped = prepare([chosen[n] for n in names])
    if not apps:
        print(f"replay: no usable application ({'; '.join(skipped)})", file=sys.stderr)
        return 2
    try:
        apps = {"peak": pack, "mean": pack_mean, "gpu": pack_gpu}[args.pack](apps, sku)
        t0 = time.perf_counter()
        train = [] if args.split in ("train", "all") else list(select(trace.apps, "train").values())
        forecaster, described = make_forecaster(args.forecaster, train, args.checkpoint)
        fit_s = time.perf_counter() - t0
    except (ValueError, FileNotFoundError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    timeline: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] | None = \
        {} if args.plot is not None else None
    results = replay(apps, sku, forecaster, configs={"predictive": predictive_config},
                     kill_on_oom=not args.cooperative, timeline_out=timeline)
    replay_s = time.perf_counter() - t1
    if args.plot is not None and timeline is not None:
        if str(Path(__file__).resolve().parent) not in sys.path:  # imported as bench.replay (tests)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
        from replay_plot import plot_replay

        args.plot.mkdir(parents=True, exist_ok=True)  # DIR is this bench's output directory
        drawn = plot_replay(timeline, args.plot, max_apps=args.plot_apps,
                            title=f"{Path(args.trace).name} on {sku.key}, forecaster: {described}")
        print("\n".join(str(p) for p in drawn), file=sys.stderr)
    mig_results: list[Result] = []
    if args.mig:
        try:
            mig_apps = pack_mig(apps, sku)
        except ValueError as exc:
            print(f"replay: {exc}", file=sys.stderr)
            return 2
        mig_results = mig_replay(mig_apps, sku, forecaster, reconfig_s=args.mig_reconfig_s, config=predictive_config)
    app_ticks = sum(a.ticks - 1 for a in apps)
    out = {
        "policies": results,
        "trace": str(args.trace),
        "split": args.split,
        "gpu": sku.key,
        "apps": len(apps),
        "gpus": max(a.device for a in apps) + 1,
        "app_ticks": app_ticks,
        "tick_s": 1.0,
        "forecaster": described,
        "predictive_overrides": overrides,
        "pack": args.pack,
        "cooperative": args.cooperative,
        **({"mig": mig_results, "mig_reconfig_s": args.mig_reconfig_s} if args.mig else {}),
        "packing": packing(apps),
        "skipped": skipped,
        "fit_s": round(fit_s, 1),
        "replay_s": round(replay_s, 1),
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        cols = ("mem_slack_frac", "mem_violation_rate", "sm_slack_frac", "sm_violation_rate", "changes_per_hour",
                "energy_j", "mean_slowdown", "p95_slowdown", "apps_killed_oom", "oom_events",
                "lead_time_median_visible_s", "lead_time_median_s")
        print(f"{len(apps)} apps, {app_ticks} app-ticks on {out['gpus']} x {sku.key}; forecaster: {described}")
        print(f"packing ({args.pack}): " + "; ".join(f"GPU {g}: {', '.join(names)}" for g, names in out["packing"].items()))
        print(f"{'policy':<11}" + "".join(f"{c:>20}" for c in cols))
        for r in results:
            print(f"{r['policy']:<11}" + "".join(f"{r[c]!s:>20}" for c in cols))
        for m in mig_results:
            print(f"{m['policy']:<15} slices used {m['slices_used']}, reconfigurations {m['reconfigurations']}, "
                  f"OOM events {m['oom_events']}, lead time median {m['lead_time_median_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
