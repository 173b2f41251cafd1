"""What in-app counters cost the manager's ingest: CPU per signature, with and without them.

    python bench/inapp_ingest.py --json
    -> {"apps": 64, "batches": 100, "us_per_signature": {"rows": {"plain": ..., "inapp": ...},
                                                          "columns": {"plain": ..., "inapp": ...}}, ...}

A `Manager` (no allocator, the baseline forecaster, no forecast tick: `accept` only, so this is the
wire codec and the windows) reads `--batches` batches of one signature per application for
`--apps` applications, as rows and as columns (`vgpu.wire.columns_from_signatures`, what the
profiler sends). "plain" signatures carry the device and process counters only; "inapp" ones add
the PyTorch allocator's reserved MiB and step and a serving engine's five counters. The figure is
the best of `--reps` runs of process CPU time per signature (the machine is shared: the best run is
the least disturbed one).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from vgpu.manager.core import Manager, default_baseline
from vgpu.v1 import ingest_pb2
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import columns_from_signatures


def _sig(app: str, seq: int, t_s: float, inapp: bool) -> spb.BehavioralSignature:
    s = spb.BehavioralSignature(app_id=app, device_id="GPU-0", seq=seq, timestamp_s=t_s)
    s.process.gpu_mem_used_mib = 1000.0 + seq
    s.process.sm_util_pct = 50.0
    s.device.mem_total_mib = 80_000.0
    s.device.power_mw = 300_000
    if inapp:
        s.in_app.torch_reserved_mib = 900.0
        s.in_app.step = seq
        s.in_app.requests_running = 3
        s.in_app.requests_waiting = 1
        s.in_app.kv_used_mib = 100.0 + seq
        s.in_app.kv_total_mib = 8192.0
        s.in_app.tokens_in_flight = 4000
    return s


def run(apps: int, batches: int, reps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for form in ("rows", "columns"):
        out[form] = {}
        for kind in ("plain", "inapp"):
            msgs = []
            for k in range(batches):
                sigs = [_sig(f"app{a}", k + 1, 1000.0 + 0.1 * k, kind == "inapp") for a in range(apps)]
                if form == "rows":
                    msgs.append(ingest_pb2.SignatureBatch(tick=k, signatures=sigs))
                else:
                    cols, _ = columns_from_signatures(sigs)
                    msgs.append(ingest_pb2.SignatureBatch(tick=k, columns=cols))
            best = float("inf")
            for _ in range(reps):
                m = Manager(None, default_baseline(), clock=lambda: 1e6, min_samples=1)
                t0 = time.process_time()
                for msg in msgs:
                    m.accept(msg)
                best = min(best, (time.process_time() - t0) / (apps * batches))
            out[form][kind] = round(best * 1e6, 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apps", type=int, default=64)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args()
    result = {"apps": args.apps, "batches": args.batches, "reps": args.reps,
              "us_per_signature": run(args.apps, args.batches, args.reps),
              "python": platform.python_version(), "machine": platform.machine()}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
