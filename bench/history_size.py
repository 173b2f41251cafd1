"""Bytes and append cost of the node history (manager/history.py): one hour of `--apps` applications.

    python bench/history_size.py [--apps 64] [--seconds 3600] [--inapp] [--json]

Every second, `NodeHistory.add` gets one row per application (random memory and compute, so gzip's ratio
is a pessimistic one), with `--inapp` also five serving counters per application (requests running and
waiting, KV cache used and total, tokens in flight). Prints the segment's plain and gzipped size (level 6,
as `compress_closed`) and the thread CPU per `add` call.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.manager.history import NodeHistory  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--apps", type=int, default=64)
    p.add_argument("--seconds", type=int, default=3600)
    p.add_argument("--inapp", action="store_true", help="every application reports five serving counters")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    n = args.apps
    apps = [f"app-{i:03d}" for i in range(n)]
    gpus = ["GPU-3f2a9c1e-7b4d-4e8a-9c2f-1a2b3c4d5e6f"] * n
    cpu_s = 0.0
    with tempfile.TemporaryDirectory() as d:
        h = NodeHistory(d, segment_s=max(args.seconds, 1))
        for sec in range(args.seconds):
            values = np.stack([20000 + rng.normal(0, 300, n), np.clip(rng.normal(50, 20, n), 0, 100)], axis=1)
            inapp = None
            if args.inapp:
                inapp = {"inapp_requests_running": rng.integers(0, 64, n).astype(np.float64),
                         "inapp_requests_waiting": rng.integers(0, 8, n).astype(np.float64),
                         "inapp_kv_used_mib": rng.normal(8000, 500, n), "inapp_kv_total_mib": np.full(n, 16384.0),
                         "inapp_tokens_in_flight": rng.integers(0, 100000, n).astype(np.float64)}
            started = time.thread_time()
            h.add(apps, gpus, np.full(n, float(sec)), values, [81559.0] * n, inapp=inapp)
            cpu_s += time.thread_time() - started
        h.close()
        raw = b"".join(path.read_bytes() for _, path in h.segments())
    out = {"apps": n, "seconds": args.seconds, "inapp": args.inapp, "plain_mib": round(len(raw) / 2**20, 2),
           "gzip_mib": round(len(gzip.compress(raw, 6)) / 2**20, 2),
           "add_cpu_ms_per_call": round(cpu_s / max(args.seconds, 1) * 1e3, 3)}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
