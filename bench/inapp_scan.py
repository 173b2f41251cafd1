"""What listing a crowded in-app directory costs: `vgpu.client.InAppFinder.scan`, the bounded step
the profiler's sampler takes at most once per second (and the daemon's pid proof once per check)
while some process has no report under `<pid>.json`.

    python bench/inapp_scan.py --files 100000 --json

Fills a temporary directory with `--files` empty files: half under other pids' usual names, half
under names of the process's pid in the stub's fallback form (`<pid>.<32 hex>.json`, the worst
case: each one's status is read), with the process's real report among them (written by the client
stub itself, its usual name taken by a directory). Then scans step by step, as the sampler does,
until the report is found.

Prints {"files", "scan_entries", "steps_to_find", "step_p50_ms", "step_max_ms", "stats_read_per_step",
"lookup_ms"}: the steps (listings, one a second in the sampler) before the report was found, the wall
time of one step, the status reads per step, and the time of one lookup of a found name (usual name
plus the found one, as the sampler reads them each tick).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.client import MAX_INAPP_SCAN_ENTRIES, InAppFinder, VgpuClient, read_inapp_reports  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    pid = os.getpid()
    with tempfile.TemporaryDirectory(prefix="vgpu-inapp-scan-") as tmp:
        inapp = Path(tmp)
        (inapp / f"{pid}.json").mkdir()
        half = args.files // 2
        for n in range(half):
            (inapp / f"{n + 1_000_000}.json").touch()
        for _ in range(args.files - half):
            (inapp / f"{pid}.{secrets.token_hex(16)}.json").touch()
        client = VgpuClient("bench", socket="unix:///nonexistent.sock", inapp_dir=inapp, watch=False, report=False)
        try:
            client.report_now()
            finder = InAppFinder(inapp)
            step_ms: list[float] = []
            stats_read: list[int] = []
            found = None
            while found is None and len(step_ms) < args.files // MAX_INAPP_SCAN_ENTRIES + 2:
                before = finder.stats_read
                t0 = time.perf_counter()
                finder.scan({pid: (os.geteuid(),)})
                step_ms.append((time.perf_counter() - t0) * 1000)
                stats_read.append(finder.stats_read - before)
                reports = read_inapp_reports(finder.paths(pid), pid, now_s=time.time(), owners=(os.geteuid(),)).reports
                found = reports[0] if reports else None
            t0 = time.perf_counter()
            for _ in range(100):
                read_inapp_reports(finder.paths(pid), pid, now_s=time.time(), owners=(os.geteuid(),))
            lookup_ms = (time.perf_counter() - t0) * 1000 / 100
        finally:
            client.close()
    out = {
        "files": args.files,
        "scan_entries": MAX_INAPP_SCAN_ENTRIES,
        "found": found is not None and found.app_id == "bench",
        "steps_to_find": len(step_ms),
        "step_p50_ms": round(statistics.median(step_ms), 3),
        "step_max_ms": round(max(step_ms), 3),
        "stats_read_per_step": max(stats_read),
        "lookup_ms": round(lookup_ms, 3),
    }
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0 if out["found"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
