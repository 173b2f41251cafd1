"""Replay a canonical trace through the allocation policies on simulated GPUs, side by side.

    python bench/replay.py --trace migperf.csv.gz [--gpu h100-80gb] [--split test] --json

Every application of the trace (or of one split of it, manager/splits.py) starts at replay time 0
and follows its own 1 s grid (TRACE_FORMAT.md step 1); the replay ticks once a second. Applications
are packed first-fit (largest first) onto simulated GPUs of `--gpu` so that their peaks fit: memory
within the GPU, summed peak SM share within 100 %. At each tick t every policy decides each
application's grant (memory MiB, SM %) in force at t + 1 from what it knows at t; the grant is
compared with the usage at t + 1.

Policies (one run, the same packing):
- `static`: each application gets its peak, for its whole run; power limits stay at the default.
- `reactive`: usage-based (DeepRes style): the last usage plus the margin, through the policy's
  hysteresis (allocator/policy.py).
- `vpa`: the Kubernetes VPA recommender: P90 of a decaying histogram of the usage (half-life 60 s,
  manager/baselines.py) + 15 %; after a memory violation the memory estimate is bumped to
  max(1.2 x usage, usage + 100 MiB) (VPA's OOM bump) and never falls under that again.
- `predictive` (vgpu): the P90 forecast over 1-5 s from the forecaster (the trained checkpoint when
  present, else gradient-boosted trees trained on the trace's train split, else the VPA percentile;
  the JSON says which), through the policy with the settings the daemon plans with
  (`vgpu.allocator.policy.forecast.PREDICTIVE_CONFIG`: margin, overrun bumps, SM threshold and shrink dwell).
  `--set NAME=VALUE` (repeatable) overrides one of those settings for a trade-off study; the JSON
  lists the overrides under `predictive_overrides`.
- `oracle`: perfect foresight: the true peak of the next 5 s, no margin, through the policy.
Every dynamic policy chooses each GPU's power limit from its planned SM share
(allocator/power_policy.py) and sets it through the power-limit mechanism on its own simulated
backend; energy is the simulator's power draw, summed over the ticks a GPU has work.

Metrics, over app-ticks (an application at one second, its first second excluded: no policy has
seen anything before it):
- `mem_slack_frac` / `sm_slack_frac`: mean of max(0, allocated - used) / allocated. Slack cannot be
  negative: a tick where usage exceeds the grant has no idle resource and counts in
- `mem_violation_rate` / `sm_violation_rate`: share of app-ticks with used > allocated.
- `changes_per_hour`: grant changes (memory or SM of an application, the first grant excluded) per
  application-hour.
- `energy_j`: simulated energy; `mean_slowdown`: the simulator's mean throttling slowdown on busy
  GPU-ticks (1.0 = none), since a lower power limit is not free.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vgpu.allocator.mechanisms.power import PowerLimitMechanism  # noqa: E402
from vgpu.allocator.policy.forecast import PREDICTIVE_CONFIG, AppState, DeviceState, PolicyConfig, plan  # noqa: E402
from vgpu.allocator.policy.power import PowerController  # noqa: E402
from vgpu.device.sim import ManualClock, SimBackend  # noqa: E402
from vgpu.device.skus import Sku, get_sku  # noqa: E402
from vgpu.manager.forecast import Forecaster  # noqa: E402
from vgpu.traces import AppTrace, TraceFormatError, one_second_grid, read_trace  # noqa: E402

POLICIES = ("static", "reactive", "vpa", "predictive", "oracle")
HORIZON_S = 5
VPA_MARGIN = 0.15
VPA_OOM_RATIO = 1.2
VPA_OOM_MIN_MIB = 100.0
FORECASTERS = ("auto", "model", "gbdt", "vpa_percentile", "ewma", "last_value")

# The policy settings each dynamic policy runs with (the same hysteresis for all).
REACTIVE_CONFIG = PolicyConfig(mem_margin_frac=0.10, sm_margin_frac=0.10, confidence_multiplier=0.0)
VPA_CONFIG = PolicyConfig(mem_margin_frac=VPA_MARGIN, sm_margin_frac=VPA_MARGIN, confidence_multiplier=0.0)
# predictive runs PREDICTIVE_CONFIG (allocator/policy.py), the daemon's own settings
ORACLE_CONFIG = PolicyConfig(mem_margin_frac=0.0, sm_margin_frac=0.0, confidence_multiplier=0.0)


@dataclass(frozen=True)
class ReplayApp:
    app_id: str
    raw: AppTrace
    mem: np.ndarray  # 1 s grid
    sm: np.ndarray
    prefix_end: np.ndarray  # raw samples up to and including grid second k: raw[:prefix_end[k]]
    device: int = 0

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
        out.append(ReplayApp(a.app, a, mem.astype(np.float64), np.clip(sm, 0, 100).astype(np.float64), prefix_end))
    return out, skipped


def pack(apps: list[ReplayApp], sku: Sku) -> list[ReplayApp]:
    """First-fit decreasing on (peak SM, peak memory): every device's peaks fit it."""
    bins: list[list[float]] = []  # [mem, sm] used per device
    placed: dict[str, int] = {}
    for a in sorted(apps, key=lambda a: (-float(a.sm.max()), -float(a.mem.max()), a.app_id)):
        pm, ps = float(a.mem.max()), float(a.sm.max())
        if pm > sku.mem_total_mib:
            raise ValueError(f"{a.app_id} peaks at {pm:.0f} MiB, more than a {sku.key} has ({sku.mem_total_mib} MiB)")
        for i, b in enumerate(bins):
            if b[0] + pm <= sku.mem_total_mib and b[1] + ps <= 100.0 + 1e-9:
                b[0] += pm
                b[1] += ps
                placed[a.app_id] = i
                break
        else:
            bins.append([pm, ps])
            placed[a.app_id] = len(bins) - 1
    return [replace(a, device=placed[a.app_id]) for a in apps]


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
    slowdowns: list[float] = field(default_factory=list)

    def result(self, app_hours: float) -> dict[str, float | str]:
        ms, mv = slack_and_violations(np.array(self.mem_alloc), np.array(self.mem_used))
        ss, sv = slack_and_violations(np.array(self.sm_alloc), np.array(self.sm_used))
        return {
            "policy": self.name,
            "mem_slack_frac": round(ms, 4),
            "mem_violation_rate": round(mv, 4),
            "sm_slack_frac": round(ss, 4),
            "sm_violation_rate": round(sv, 4),
            "changes_per_hour": round(self.changes / app_hours, 2) if app_hours > 0 else 0.0,
            "energy_j": round(self.energy_j, 1),
            "mean_slowdown": round(float(np.mean(self.slowdowns)), 4) if self.slowdowns else 1.0,
        }


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
    timeline_out: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] | None = None,
) -> list[dict[str, float | str]]:
    """Run every policy over the packed applications; one result dict per policy. `runs_out`, when
    given, receives each policy's per-app-tick record (for tests and plots); `timeline_out`, per
    (policy, app), (t, used MiB, P50 MiB, P90 MiB, grant MiB in force at t) at each tick a policy
    decides (bench/replay_plot.py draws it)."""
    from vgpu.manager.baselines import VpaPercentileForecaster

    vpa_fc = vpa_forecaster or VpaPercentileForecaster()
    cfgs = {"reactive": REACTIVE_CONFIG, "vpa": VPA_CONFIG, "predictive": PREDICTIVE_CONFIG,
            "oracle": ORACLE_CONFIG, **(configs or {})}
    n_dev = max(a.device for a in apps) + 1
    horizon = max(a.ticks for a in apps)
    devices = [DeviceState(str(i), float(sku.mem_total_mib)) for i in range(n_dev)]
    runs = {p: PolicyRun(p, cfgs.get(p)) for p in policies}
    if runs_out is not None:
        runs_out.update(runs)
    clock = ManualClock()
    backends = {p: SimBackend([sku] * n_dev, clock=clock) for p in policies}
    controllers = {p: PowerController(PowerLimitMechanism(logger=_QuietLog())) for p in policies if p != "static"}
    pid = 1000
    for p in policies:
        for a in apps:
            pid += 1
            backends[p].launch(a.app_id, pid, a.raw, a.device)
    states: dict[str, dict[str, AppState]] = {p: {} for p in policies}
    oom_floor: dict[str, float] = {}

    for k in range(horizon):
        clock.set(float(k) + 0.5)  # the middle of second k
        active = [a for a in apps if k < a.ticks]
        # 1. score the grants in force during second k (decided at k - 1)
        for p in policies:
            run = runs[p]
            for a in active:
                st = states[p].get(a.app_id)
                if k == 0 or st is None:
                    continue
                run.mem_alloc.append(st.granted_mem_mib)
                run.mem_used.append(float(a.mem[k]))
                run.sm_alloc.append(st.granted_sm_pct)
                run.sm_used.append(float(a.sm[k]))
                if p == "vpa" and a.mem[k] > st.granted_mem_mib + 1e-9:
                    bump = max(a.mem[k] * VPA_OOM_RATIO, a.mem[k] + VPA_OOM_MIN_MIB)
                    oom_floor[a.app_id] = max(oom_floor.get(a.app_id, 0.0), bump)
            # energy of second k under the limits in force
            for dev in backends[p].devices():
                if any(a.device == dev.index for a in active):
                    run.energy_j += dev.power_usage_mw() / 1000.0
                    run.slowdowns.append(dev.throttle().slowdown)
        # 2. forecasts at origin k (one batch per forecaster)
        deciding = [a for a in active if k + 1 < a.ticks]
        if not deciding:
            continue
        fc_needed = "predictive" in policies
        forecasts = forecaster.forecast_batch([a.history(k) for a in deciding]) if fc_needed else []
        vpa_fcs = vpa_fc.forecast_batch([a.history(k) for a in deciding]) if "vpa" in policies else []
        # 3. each policy plans the grants for second k + 1
        for p in policies:
            new_states = []
            for i, a in enumerate(deciding):
                old = states[p].get(a.app_id) or AppState(a.app_id, str(a.device))
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
                new_states.append(replace(
                    old, used_mem_mib=used_m, used_sm_pct=used_s,
                    forecast_mem_p90_mib=f_m, forecast_sm_p90_pct=f_s, history_s=float(k + 1),
                ))
            if p == "static":
                for st in new_states:
                    states[p][st.app_id] = st
                continue
            result = plan(new_states, devices, float(k), runs[p].config)
            need_by_dev: dict[str, float] = {}
            for st in new_states:
                t = result.target(st.app_id)
                if st.app_id in states[p] and t.changed:
                    runs[p].changes += 1
                states[p][st.app_id] = replace(
                    st, granted_mem_mib=t.mem_mib, granted_sm_pct=t.sm_pct,
                    last_mem_change_s=float(k) if t.changed_mem else st.last_mem_change_s,
                    last_sm_change_s=float(k) if t.changed_sm else st.last_sm_change_s,
                )
                need_by_dev[t.device_id] = min(100.0, need_by_dev.get(t.device_id, 0.0) + t.sm_pct)
            # 4. power limits for second k + 1, from the planned SM share
            devs = backends[p].devices()
            clock_dev = {str(d.index): d for d in devs}
            controllers[p].step(devs, {clock_dev[d].uuid: v for d, v in need_by_dev.items()})
        if progress:
            progress(k, horizon)
    app_hours = sum(max(a.ticks - 1, 0) for a in apps) / 3600.0
    return [runs[p].result(app_hours) for p in policies]


class _QuietLog:
    """The replay changes power limits every few seconds on dozens of GPUs; it does not log them."""

    def info(self, *a: object, **k: object) -> None:
        pass

    warning = error = debug = info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/replay.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="canonical trace (.csv or .csv.gz)")
    ap.add_argument("--gpu", default="h100-80gb", help="simulated GPU SKU (default h100-80gb)")
    ap.add_argument("--split", default="test", choices=("train", "val", "test", "all"),
                    help="applications to replay (manager/splits.py; default test)")
    ap.add_argument("--forecaster", default="auto", choices=FORECASTERS,
                    help="predictive policy's forecaster (auto: the checkpoint, else gbdt on the train split)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="forecaster checkpoint (default: manager/models/)")
    ap.add_argument("--max-apps", type=int, default=0, help="replay only the first N applications (0: all)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override one PREDICTIVE_CONFIG setting of the predictive policy (repeatable)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--plot", type=Path, metavar="DIR",
                    help="also draw use, forecast and grant per application, policy beside policy, into DIR")
    ap.add_argument("--plot-apps", type=int, default=6, help="with --plot: draw the first N applications (default 6)")
    args = ap.parse_args(argv)

    from vgpu.offline.splits import select

    try:
        predictive_config, overrides = config_overrides(PREDICTIVE_CONFIG, args.set)
        sku = get_sku(args.gpu)
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
        apps = pack(apps, sku)
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
    results = replay(apps, sku, forecaster, configs={"predictive": predictive_config}, timeline_out=timeline)
    replay_s = time.perf_counter() - t1
    if args.plot is not None and timeline is not None:
        if str(Path(__file__).resolve().parent) not in sys.path:  # imported as bench.replay (tests)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
        from replay_plot import plot_replay

        drawn = plot_replay(timeline, args.plot, max_apps=args.plot_apps,
                            title=f"{Path(args.trace).name} on {sku.key}, forecaster: {described}")
        print("\n".join(str(p) for p in drawn), file=sys.stderr)
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
        "skipped": skipped,
        "fit_s": round(fit_s, 1),
        "replay_s": round(replay_s, 1),
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        cols = ("mem_slack_frac", "mem_violation_rate", "sm_slack_frac", "sm_violation_rate", "changes_per_hour",
                "energy_j", "mean_slowdown")
        print(f"{len(apps)} apps, {app_ticks} app-ticks on {out['gpus']} x {sku.key}; forecaster: {described}")
        print(f"{'policy':<11}" + "".join(f"{c:>20}" for c in cols))
        for r in results:
            print(f"{r['policy']:<11}" + "".join(f"{r[c]:>20}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
