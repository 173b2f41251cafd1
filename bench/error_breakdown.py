"""Where a forecaster's error lies: the protocol's MAE at one horizon split into the origins whose
truth falls in an application's final seconds (its teardown) and the rest of its run (the body).

    python bench/error_breakdown.py --trace runs/migperf.csv.gz [--split test] [--horizon 5] --json

Same protocol, origins and methods as `vgpu eval` (vgpu/offline/evaluate.py): the model (`--model`,
default: the shipped checkpoint), `last_value`, and `gbdt` trained on the trace's train split. Per
target it prints:
- `change_mae`: the mean |truth - origin value|, i.e. how much there is to forecast at all
  (last_value's MAE), and `change_share_final`: the share of that change that happens where the
  truth lies in the final `--final-s` seconds of an application's grid;
- per method: `mae` (as `vgpu eval` reports it) = `mae_final_part` + `mae_body_part`, the two
  parts' contributions to it, `mae_body` (the mean over body origins alone), and `coverage_p90`
  over all origins and over the body.

A target whose change happens only at teardown cannot be forecast better than the last value
without knowing when applications end: on a benchmark trace whose runs all last the same time, a
forecaster that learnt that duration would score well here and badly in the daemon.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vgpu.manager.baselines import GbdtForecaster, LastValueForecaster  # noqa: E402
from vgpu.manager.forecast import HORIZONS_S, Forecaster  # noqa: E402
from vgpu.offline.evaluate import OriginScores, gbdt_training_apps, load_model, score_origins  # noqa: E402
from vgpu.offline.splits import select  # noqa: E402
from vgpu.traces import TARGETS, TraceFormatError, read_trace  # noqa: E402

PROG = "bench/error_breakdown.py"


def breakdown(scores: dict[str, dict[str, OriginScores]], horizon_s: int, final_s: int) -> list[dict[str, Any]]:
    """One entry per target from `score_origins` output: the change to forecast, and each method's
    error split into final seconds and body. `last_value` must be among the methods."""
    j = HORIZONS_S.index(horizon_s)
    out = []
    for target in TARGETS:
        base = scores["last_value"][target]
        ok = np.isfinite(base.truth[:, j])
        truth = base.truth[ok, j]
        # the truth's grid index is origin + h; it is final when within `final_s` of the grid's end
        final = (base.origin[ok] + horizon_s) >= (base.grid_len[ok] - final_s)
        n = int(ok.sum())
        change = np.abs(truth - base.p50[ok, j])
        entry: dict[str, Any] = {
            "target": target,
            "n": n,
            "n_final": int(final.sum()),
            "change_mae": float(change.mean()) if n else None,
            "change_share_final": float(change[final].sum() / change.sum()) if change.sum() > 0 else None,
            "methods": [],
        }
        for method, by_target in scores.items():
            sc = by_target[target]
            p50, p90 = sc.p50[ok, j], sc.p90[ok, j]
            err = np.abs(p50 - truth)
            covered = truth <= p90
            has90 = bool(np.isfinite(p90).any())
            body = ~final
            entry["methods"].append({
                "method": method,
                "mae": float(err.mean()) if n else None,
                "mae_final_part": float(err[final].sum() / n) if n else None,
                "mae_body_part": float(err[body].sum() / n) if n else None,
                "mae_body": float(err[body].mean()) if body.any() else None,
                "coverage_p90": float(covered.mean()) if has90 and n else None,
                "coverage_p90_body": float(covered[body].mean()) if has90 and body.any() else None,
            })
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True, help="canonical trace")
    parser.add_argument("--split", default="test", choices=("test", "val", "train", "all"))
    parser.add_argument("--model", default=None, help="forecaster checkpoint (default: the shipped one)")
    parser.add_argument("--horizon", type=int, default=5, choices=HORIZONS_S, help="horizon in seconds")
    parser.add_argument("--final-s", type=int, default=1, help="seconds at a grid's end counted as teardown")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.final_s < 1:
        parser.error("--final-s must be at least 1")
    try:
        trace = read_trace(args.trace)
    except (OSError, TraceFormatError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    apps = select(trace.apps, args.split)
    if not apps:
        print(f"{PROG}: no application of {args.trace} falls in the {args.split!r} split", file=sys.stderr)
        return 1
    forecasters: list[Forecaster] = [LastValueForecaster()]
    model = load_model(args.model, PROG)
    if model is not None:
        forecasters.insert(0, model)
    train_apps, _ = gbdt_training_apps([], trace, args.split, PROG)
    if train_apps:
        forecasters.append(GbdtForecaster().fit(train_apps))
    scores = score_origins(apps, forecasters)
    report = {"trace": args.trace, "split": args.split, "apps": len(apps), "horizon_s": args.horizon,
              "final_s": args.final_s, "targets": breakdown(scores, args.horizon, args.final_s)}
    if args.json:
        print(json.dumps(report))
        return 0
    for t in report["targets"]:
        share = t["change_share_final"]
        print(f"{t['target']}: change to forecast {t['change_mae']:.3f} per origin, "
              f"{'n/a' if share is None else f'{share:.1%}'} of it in the final {args.final_s} s")
        for m in t["methods"]:
            print(f"  {m['method']:<12} mae {m['mae']:.3f} = final {m['mae_final_part']:.3f} + body "
                  f"{m['mae_body_part']:.3f}   body-only mae {m['mae_body']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
