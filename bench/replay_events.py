"""Why a policy's OOM events happen: replay a trace (bench/replay.py) and print, for each OOM event of
one policy, the seconds before it: the usage, the forecast's P50 and P90, the grant in force, and the
target the policy planned with the rule that set it (`Target.reason_mem`) and the signals it planned
with (ramp, covered seconds, burst).

    python bench/replay_events.py --trace runs/serving_mooncake.csv.gz --split val --cooperative [--json]

An OOM event here is what bench/replay.py counts as one: a second whose usage is over the grant in
force (a device that runs out is not shown). `--policy`, `--set`, `--forecaster`, `--checkpoint`,
`--pack` and `--cooperative` mean what they mean to bench/replay.py; only the chosen policy is replayed
(each policy replays on its own simulated GPUs, so its figures are those of the full replay).
`--before-s` says how many seconds before each event are shown (default 10).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# the replay beside it as a top-level module, as the other bench scripts import their siblings (bench/ is
# not a package: mypy, which checks bench/, names bench/replay.py "replay")
sys.path.insert(0, str(ROOT / "bench"))

import replay as R  # noqa: E402

from vgpu.allocator.policy.forecast import PREDICTIVE_CONFIG, AppState, PolicyConfig, Target  # noqa: E402
from vgpu.device.skus import Sku, get_sku  # noqa: E402
from vgpu.manager.forecast import Forecaster  # noqa: E402
from vgpu.traces import TraceFormatError, read_trace  # noqa: E402

DYNAMIC = tuple(p for p in R.POLICIES if p != "static")


def _num(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 1)


def oom_events(apps: list[R.ReplayApp], sku: Sku, forecaster: Forecaster, *, policy: str = "predictive",
               config: PolicyConfig | None = None, kill_on_oom: bool = True,
               before_s: int = 10) -> tuple[R.Result, list[dict[str, Any]]]:
    """(the policy's replay figures, one dict per OOM event: the application, the second, the usage
    and the grant in force, and `seconds`, the `before_s` seconds before it and the event's own)."""
    if policy not in DYNAMIC:
        raise ValueError(f"policy must be one of {', '.join(DYNAMIC)}, got {policy!r}")
    runs: dict[str, R.PolicyRun] = {}
    timeline: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] = {}
    decisions: dict[tuple[str, str], list[tuple[int, AppState, Target]]] = {}
    configs = {policy: config} if config is not None else None
    (result,) = R.replay(apps, sku, forecaster, policies=(policy,), configs=configs, runs_out=runs,
                         kill_on_oom=kill_on_oom, timeline_out=timeline, decisions_out=decisions)
    events: list[dict[str, Any]] = []
    for a in apps:
        rec = runs[policy].apps[a.app_id]
        forecast = {int(t): (p50, p90) for t, _, p50, p90, _ in timeline.get((policy, a.app_id), [])}
        planned = {k: (st, t) for k, st, t in decisions.get((policy, a.app_id), [])}
        for k, (grant, used) in enumerate(zip(rec.grant_mem, rec.used_mem, strict=True)):
            if not used > grant + 1e-9:  # NaN grant (the first second): no event
                continue
            seconds = []
            for j in range(max(0, k - before_s), k + 1):
                p50, p90 = forecast.get(j, (math.nan, math.nan))
                row: dict[str, Any] = {"t_s": j, "used_mib": _num(rec.used_mem[j]), "grant_mib": _num(rec.grant_mem[j]),
                                       "p50_mib": _num(p50), "p90_mib": _num(p90)}
                if j in planned:
                    st, t = planned[j]
                    row.update(target_mib=_num(t.mem_mib), rule=t.reason_mem, changed=t.changed_mem,
                               ramp_s=st.mem_ramp_s, covered_s=st.mem_p90_covered_s, burst_mib=_num(st.mem_burst_mib))
                seconds.append(row)
            events.append({"app": a.app_id, "device": a.device, "t_s": k, "used_mib": _num(used),
                           "grant_mib": _num(grant), "over_mib": _num(used - grant), "seconds": seconds})
    return result, events


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value:,.0f}" if isinstance(value, float) else str(value)


def _width(column: str) -> int:
    return 18 if column == "rule" else 12


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/replay_events.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="canonical trace (.csv or .csv.gz)")
    ap.add_argument("--split", default="test", choices=("train", "val", "test", "all"))
    ap.add_argument("--policy", default="predictive", choices=DYNAMIC)
    ap.add_argument("--gpu", default="h100-80gb", help="simulated GPU SKU (default h100-80gb)")
    ap.add_argument("--forecaster", default="auto", choices=R.FORECASTERS)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override one PREDICTIVE_CONFIG setting of the predictive policy (repeatable)")
    ap.add_argument("--pack", default="peak", choices=R.PACKINGS)
    ap.add_argument("--cooperative", action="store_true", help="every memory limit cooperative")
    ap.add_argument("--before-s", type=int, default=10, help="seconds shown before each event (default 10)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)

    from vgpu.offline.splits import select

    try:
        if args.before_s < 0:
            raise ValueError(f"--before-s must be >= 0, got {args.before_s}")
        if args.set and args.policy != "predictive":
            raise ValueError("--set applies to the predictive policy only")
        config, _ = R.config_overrides(PREDICTIVE_CONFIG, args.set)
        sku = get_sku(args.gpu)
        trace = read_trace(args.trace)
        chosen = select(trace.apps, args.split)
        apps, _ = R.prepare([chosen[n] for n in sorted(chosen)])
        if not apps:
            raise ValueError(f"no usable application of {args.trace} in the {args.split!r} split")
        apps = {"peak": R.pack, "mean": R.pack_mean, "gpu": R.pack_gpu}[args.pack](apps, sku)
        train = [] if args.split in ("train", "all") else list(select(trace.apps, "train").values())
        forecaster, described = R.make_forecaster(args.forecaster, train, args.checkpoint)
    except (ValueError, TraceFormatError, FileNotFoundError) as exc:
        print(f"replay_events: {exc}", file=sys.stderr)
        return 2
    result, events = oom_events(apps, sku, forecaster, policy=args.policy,
                                config=config if args.policy == "predictive" else None,
                                kill_on_oom=not args.cooperative, before_s=args.before_s)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "split": args.split, "policy": args.policy,
                          "forecaster": described, "cooperative": args.cooperative,
                          "mem_slack_frac": result["mem_slack_frac"], "oom_events": result["oom_events"],
                          "events": events}, indent=1))
        return 0
    print(f"{args.policy} on {args.trace} ({args.split}), forecaster {described}: "
          f"{result['oom_events']} OOM events, memory slack {result['mem_slack_frac']}")
    cols = ("t_s", "used_mib", "grant_mib", "p50_mib", "p90_mib", "target_mib", "rule", "ramp_s", "covered_s", "burst_mib")
    for e in events:
        print(f"\n{e['app']} (GPU {e['device']}) at {e['t_s']} s: {_fmt(e['used_mib'])} MiB used, "
              f"{_fmt(e['grant_mib'])} granted, {_fmt(e['over_mib'])} over")
        print("".join(f"{c:>{_width(c)}}" for c in cols))
        for row in e["seconds"]:
            print("".join(f"{_fmt(row.get(c)):>{_width(c)}}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
