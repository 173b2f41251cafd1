"""The cost of a `GetAppHistory` reply of every series: what one call by any reader of the socket
(reads are open by default) makes the daemon's event loop do.

    python bench/history_reply.py [--apps 256] [--points 3600] [--json]

Fills the allocator's `History` (allocator/history.py) with `--apps` applications of `--points` points
each (the defaults are its bounds: 256 series of an hour), then times, on this thread, what the servicer
does for a request without an app id: `History.series()`, the reply built from it (`history_to_pb`) and
its serialization. Prints the seconds of each and the reply's size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.allocator.history import History, HistoryPoint  # noqa: E402
from vgpu.allocator.service import history_to_pb  # noqa: E402
from vgpu.v1 import allocator_pb2 as pb  # noqa: E402


def measure(apps: int, points: int) -> dict[str, float]:
    history = History(max_points=max(points, 1), max_series=max(apps, 1))
    for a in range(apps):
        for t in range(points):
            history.record(f"app-{a}", "GPU-0", HistoryPoint(float(t), 100.0, 110.0, 120.0, 150.0, 50.0, 60.0, 70.0),
                           granted_before_mib=150.0)
    t0 = time.perf_counter()
    series = history.series()
    t1 = time.perf_counter()
    reply = pb.GetAppHistoryResponse(apps=[history_to_pb(s) for s in series])
    t2 = time.perf_counter()
    size = len(reply.SerializeToString())
    t3 = time.perf_counter()
    return {"apps": apps, "points": points, "series_s": t1 - t0, "reply_s": t2 - t1, "serialize_s": t3 - t2,
            "total_s": t3 - t0, "reply_mib": size / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--apps", type=int, default=256)
    p.add_argument("--points", type=int, default=3600)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args()
    out = measure(ns.apps, ns.points)
    if ns.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:12s} {v:.3f}" if isinstance(v, float) else f"{k:12s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
