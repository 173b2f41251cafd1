"""What the daemon's socket front (vgpu/daemon/front.py) costs: call latency through it against a direct
connection to gRPC's own socket, and the daemon's memory per idle connection with and without it.

    python bench/front.py --json
    python bench/front.py --calls 4000 --idle 4000 --json

What runs. `vgpu serve --backend sim:h100-80gb` as a child process on a temporary state directory.

1. Latency: on one daemon (front on), `--calls` unary calls of two kinds, in alternating batches of 100
   over two channels, one through the public socket (the front) and one straight to gRPC's socket in
   `<state_dir>/front` (the daemon's own user may connect there; no credentials reach the call then):
   `GetAvailableResources` (a reply of about 200 bytes) and `ListApplications` with 200 applications
   of 250-character ids (a reply of about 150 KB, more than two relay chunks of 64 KiB). Alternating
   batches put both paths under the same machine load. Printed: p50 / p99 per path and kind, and the
   difference of the p50s (what the relay adds per call).
2. Memory: on a daemon with the front on and one with it off, `--idle` connections that never send a
   byte, opened by this process (root's are bounded by `server.max_connections` only, raised here to
   fit); the daemon's RSS before and 1 s after, per connection.

No figure is tuned here; on a shared machine say so with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from abuse import _still_open, daemon  # noqa: E402

from vgpu import auth  # noqa: E402
from vgpu.v1 import allocator_pb2 as pb  # noqa: E402
from vgpu.v1 import allocator_pb2_grpc as pb_grpc  # noqa: E402

BATCH = 100


def _stats(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def latency(calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vgpu-front-") as d, daemon(Path(d), {}) as (_proc, sock, state):
        op = auth.bearer(auth.read_token_file(auth.role_token_file("operator", state)))
        paths = {"front": f"unix:{sock}", "direct": f"unix:{state / 'front' / 'grpc.sock'}"}
        channels = {k: grpc.insecure_channel(v) for k, v in paths.items()}
        stubs = {k: pb_grpc.AllocatorStub(ch) for k, ch in channels.items()}
        for i in range(200):
            stubs["direct"].RequestResourceAllocation(pb.RequestResourceAllocationRequest(
                request=pb.ResourceRequest(app_id=f"a{i:03d}-" + "x" * 245, memory_mib=1.0)), metadata=op, timeout=30)
        kinds: dict[str, Callable[[pb_grpc.AllocatorStub], object]] = {
            "small_reply": lambda s: s.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=30),
            "large_reply": lambda s: s.ListApplications(pb.ListApplicationsRequest(), timeout=30),
        }
        sizes = {k: len(fn(stubs["direct"]).SerializeToString()) for k, fn in kinds.items()}  # type: ignore[attr-defined]
        out: dict[str, Any] = {"reply_bytes": sizes}
        for kind, fn in kinds.items():
            ms: dict[str, list[float]] = {"front": [], "direct": []}
            for name in ms:  # warm both connections
                for _ in range(20):
                    fn(stubs[name])
            for b in range(max(1, calls // BATCH)):
                for name in (("front", "direct") if b % 2 == 0 else ("direct", "front")):
                    for _ in range(BATCH):
                        t0 = time.perf_counter()
                        fn(stubs[name])
                        ms[name].append((time.perf_counter() - t0) * 1000)
            row: dict[str, Any] = {name: _stats(v) for name, v in ms.items()}
            row["added_p50_ms"] = round(row["front"]["p50_ms"] - row["direct"]["p50_ms"], 3)
            out[kind] = row
        for ch in channels.values():
            ch.close()
    return out


def idle_memory(n: int, front: bool) -> dict[str, Any]:
    extra = {"VGPU_SERVER_PEER_CREDENTIALS": "true" if front else "false",
             "VGPU_SERVER_MAX_CONNECTIONS": str(n + 100), "VGPU_SERVER_MAX_CONNECTIONS_PER_UID": str(n + 100)}
    with tempfile.TemporaryDirectory(prefix="vgpu-front-") as d, daemon(Path(d), extra) as (proc, sock, _state):
        daemon_proc = psutil.Process(proc.pid)
        time.sleep(2.0)
        before = daemon_proc.memory_info().rss
        idle = []
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            idle.append(s)
        time.sleep(1.0)
        after = daemon_proc.memory_info().rss
        held = sum(_still_open(s) for s in idle)
        for s in idle:
            s.close()
    return {"front": front, "idle_connections": n, "held": held, "rss_before_mib": round(before / 2**20, 1),
            "rss_after_mib": round(after / 2**20, 1), "kib_per_connection": round((after - before) / 1024 / n, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per path and kind (default 2000)")
    p.add_argument("--idle", type=int, default=2000, help="idle connections for the memory figure (default 2000)")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = {
        "machine": f"{os.cpu_count()} cpus, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
        "latency": latency(ns.calls),
        "idle_memory": [idle_memory(ns.idle, True), idle_memory(ns.idle, False)] if ns.idle else [],
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out, indent=None if ns.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
