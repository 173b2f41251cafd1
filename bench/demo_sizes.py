"""The cold-start sizer on the demo's declared jobs, against the MIGPerf runs they replay.

    python bench/demo_sizes.py --json [--data ../shared/data] [--model manager/models/coldstart_randomforest.pt]

For each run of `vgpu.daemon.demo.DEMO_RUNS`: the measured peak of its MIGPerf run (the A100-80GB
7g.80gb row of the same model, mode, batch and sequence length; ViT fine-tuning: the A100-40GB 2g.10gb
row), and the sizer's size, method and grant for the declared job on the demo's H100-80GB
(81,559 MiB). The table of docs/demo.md ("The sizer has seen these very runs").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vgpu.daemon.demo import DEMO_RUNS  # noqa: E402
from vgpu.manager.coldstart import DEFAULT_ARTEFACT, ColdStartSizer  # noqa: E402
from vgpu.manager.jobprofiles import JobProfile, load_migperf  # noqa: E402

DEMO_CAPACITY_MIB = 81559.0


def _run_row(rows: list[JobProfile], job: Any) -> JobProfile | None:
    def match(p: JobProfile, gpu: str, slice_name: str) -> bool:
        return (p.job.model_type == job.model_type and p.job.batch_size == job.batch_size and p.job.mode_norm == job.mode_norm
                and p.job.input_size == job.input_size and p.gpu == gpu and p.slice_name == slice_name)

    found = [p for p in rows if match(p, "A100-80GB", "7g.80gb")] or [p for p in rows if match(p, "A100-40GB", "2g.10gb")]
    return found[0] if found else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo_sizes.py", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default is a table)")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", type=Path, default=DEFAULT_ARTEFACT)
    args = parser.parse_args(argv)
    if not args.data.is_dir():
        print(f"demo_sizes.py: data directory {args.data} not found (pass --data)", file=sys.stderr)
        return 2
    sizer = ColdStartSizer.load(args.model)
    rows = load_migperf(args.data)
    out: list[dict[str, Any]] = []
    for app, runs in DEMO_RUNS.items():
        for run in runs:
            row = _run_row(rows, run.job)
            est = sizer.size(run.job, DEMO_CAPACITY_MIB)
            out.append({"app": app, "batch_size": run.job.batch_size, "mode": run.job.mode_norm,
                        "measured_peak_mib": round(row.peak_mem_mib) if row else None,
                        "run": f"{row.gpu} {row.slice_name}" if row else None,
                        "size_mib": round(est.mem_mib), "grant_mib": round(est.grant_mib), "method": est.method,
                        "extrapolated": list(est.extrapolated),
                        "grant_covers_peak": bool(row and est.grant_mib >= row.peak_mem_mib)})
    if args.json:
        print(json.dumps({"model": str(args.model), "capacity_mib": DEMO_CAPACITY_MIB, "runs": out}))
        return 0
    for r in out:
        print(f"{r['app']:<14} {r['mode']:<5} batch {r['batch_size']:>4}  peak {r['measured_peak_mib']:>7}  "
              f"size {r['size_mib']:>7} ({r['method']})  grant {r['grant_mib']:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
