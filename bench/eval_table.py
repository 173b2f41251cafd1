"""Markdown tables from `vgpu eval --json` reports: each method's MAE and pinball_p90 as a multiple of the
last value's, and its P90 coverage, per target and horizon.

    python bench/eval_table.py --set "MIGPerf test (real)" new=runs/eval/new-migperf-test.json \
        old=runs/eval/old-migperf-test.json [--horizons 1,5]

Each NAME=PATH is one report; rows are NAME/method for every method in it (last_value and the other
baselines are taken from the first report only, so they are not repeated). The last value's own P90 is
the fixed margin fitted on the first report's training traces.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _rows(report: dict[str, Any]) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(r["target"], int(r["horizon_s"]), r["method"]): r for r in report["results"]}


def table(title: str, reports: list[tuple[str, dict[str, Any]]], horizons: list[int]) -> str:
    first = _rows(reports[0][1])
    lines = [f"**{title}**", "", "| target | h | row | MAE | MAE / last value | pinball_p90 / last value's | coverage_p90 |",
             "|---|---|---|---|---|---|---|"]
    targets = sorted({k[0] for k in first})
    for target in targets:
        for h in horizons:
            lv = first.get((target, h, "last_value"))
            for i, (name, report) in enumerate(reports):
                rows = _rows(report)
                for (t, hh, method), r in rows.items():
                    if t != target or hh != h:
                        continue
                    if i > 0 and method not in ("model", "served"):
                        continue
                    label = f"{name}/{method}" if method in ("model", "served") else method
                    ratio = r["mae"] / lv["mae"] if lv and lv["mae"] else float("nan")
                    pin = (r["pinball_p90"] / lv["pinball_p90"]
                           if lv and r.get("pinball_p90") is not None and lv.get("pinball_p90") else None)
                    cov = r.get("coverage_p90")
                    lines.append(
                        f"| {target} | {h} | {label} | {r['mae']:.3f} | {ratio:.3f} | "
                        f"{'' if pin is None else f'{pin:.3f}'} | {'' if cov is None else f'{cov:.3f}'} |"
                    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", required=True, help="the table's title (say real or derived)")
    p.add_argument("--horizons", default="1,5")
    p.add_argument("reports", nargs="+", help="NAME=PATH of a vgpu eval --json report")
    args = p.parse_args()
    reports = []
    for item in args.reports:
        name, _, path = item.partition("=")
        reports.append((name, json.loads(Path(path).read_text())))
    print(table(args.set, reports, [int(h) for h in args.horizons.split(",")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
