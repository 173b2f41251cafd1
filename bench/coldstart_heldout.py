"""The cold-start sizer on the held-out 30 % of the permitted job profiles, old target against new.

    python bench/coldstart_heldout.py --json [--data ../shared/data] [--seed 0]

Same 70/30 split as bench/paper_table.py and `python -m vgpu.manager.coldstart train`. Each sizer is
fit (forest, training ranges, margin from 5-fold cross-validation) on the 70 % training part only, and
sizes every job of the 30 % test part through `ColdStartSizer.size` on its own slice or GPU
(`vgpu.manager.coldstart.heldout_evaluation`). Printed per sizer: MAE and MAPE of the size without the
margin, `under_frac` (the share of jobs whose grant, size + margin, is below the measured peak) and
the slack of the others (grant - peak), over all jobs, the non-MLP jobs, and by batch size.

Sizers: "peak" (the earlier sizer: a forest on the peak in MiB, min 2 samples per leaf, p90 margin)
and "ratio_to_physics" (shipped: a forest on log(peak / physical estimate), min 1 sample per leaf,
p95 margin; chosen by nested cross-validation on the training part, docs/coldstart.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vgpu.manager.coldstart import heldout_evaluation  # noqa: E402

SIZERS: dict[str, dict[str, Any]] = {
    "peak": {"mem_target": "mem_mib", "params": {"min_samples_leaf": 2}, "quantile": 0.9},
    "ratio_to_physics": {"mem_target": "log_ratio_to_physics", "params": {"min_samples_leaf": 1}, "quantile": 0.95},
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coldstart_heldout.py", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default is a summary)")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.data.is_dir():
        print(f"coldstart_heldout.py: data directory {args.data} not found (pass --data)", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"seed": args.seed, "sizers": {}}
    for name, kw in SIZERS.items():
        t0 = time.perf_counter()
        out["sizers"][name] = {**heldout_evaluation(args.data, args.seed, **kw), "fit_s": round(time.perf_counter() - t0, 1)}
    if args.json:
        print(json.dumps(out))
        return 0
    for name, r in out["sizers"].items():
        print(f"{name}: margin {r['margin_rel']}")
        for label, st in [("all", r["all"]), ("not mlp", r["not_mlp"]), *((f"not mlp, batch {k}", v) for k, v in r["by_batch_not_mlp"].items())]:
            print(f"  {label:<22} {json.dumps(st)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
