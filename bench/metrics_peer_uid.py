"""What reading a loopback caller's uid costs the metrics endpoint at each accept, and whether it grows
with the host's sockets.

    python bench/metrics_peer_uid.py --json
    python bench/metrics_peer_uid.py --background 0 1000 5000 --lookups 2000 --json

What runs. For each count B in `--background`, B loopback TCP connections are opened and held (2 B
sockets on the host besides whatever else it has), then one more connection is looked up
`--lookups` times, as `MetricsServer` does at each accept on loopback:
`vgpu.daemon.sockdiag.tcp_peer_uid` (one NETLINK_SOCK_DIAG request for the exact 4-tuple, a fresh
netlink socket each time). For comparison, the same uid is read by the other way the kernel offers,
parsing /proc/net/tcp to its matching line (`--proc-lookups` times; its cost is the file's size,
which grows with every TCP socket of the host's network namespace). Printed, per B:

    {"background", "tcp_sockets_in_proc", "sock_diag_p50_us", "sock_diag_p99_us",
     "proc_net_tcp_p50_us", "proc_net_tcp_p99_us"}

The lookup runs on the endpoint's one serving thread, so its p50 bounds how many loopback accepts a
second the endpoint can take (about 1e6 / p50). No figure is tuned here; on a slow or shared
machine, say so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vgpu.daemon.sockdiag import tcp_peer_uid  # noqa: E402


def _proc_uid(local_port: int, remote_port: int) -> int:
    """The uid of 127.0.0.1:local_port -> 127.0.0.1:remote_port from /proc/net/tcp."""
    local, remote = f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}"
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[1] == local and fields[2] == remote:
                return int(fields[7])
    raise LookupError("no such connection")


def _percentile_us(samples_s: list[float], q: float) -> float:
    ordered = sorted(samples_s)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6, 1)


def run(background: int, lookups: int, proc_lookups: int) -> dict[str, object]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    try:
        for _ in range(background):
            held.append(socket.create_connection(("127.0.0.1", port)))
            held.append(listener.accept()[0])
        conn = socket.create_connection(("127.0.0.1", port))
        accepted, peer = listener.accept()
        held += [conn, accepted]
        endpoint = ("127.0.0.1", port)
        assert tcp_peer_uid(peer, endpoint) == os.getuid()
        assert _proc_uid(peer[1], port) == os.getuid()
        diag: list[float] = []
        for _ in range(lookups):
            t0 = time.perf_counter()
            tcp_peer_uid(peer, endpoint)
            diag.append(time.perf_counter() - t0)
        proc: list[float] = []
        for _ in range(proc_lookups):
            t0 = time.perf_counter()
            _proc_uid(peer[1], port)
            proc.append(time.perf_counter() - t0)
        with open("/proc/net/tcp") as f:
            in_proc = sum(1 for _ in f) - 1
        return {"background": background, "tcp_sockets_in_proc": in_proc,
                "sock_diag_p50_us": _percentile_us(diag, 0.5), "sock_diag_p99_us": _percentile_us(diag, 0.99),
                "sock_diag_mean_us": round(statistics.fmean(diag) * 1e6, 1),
                "proc_net_tcp_p50_us": _percentile_us(proc, 0.5), "proc_net_tcp_p99_us": _percentile_us(proc, 0.99)}
    finally:
        for s in held:
            s.close()
        listener.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--background", type=int, nargs="+", default=[0, 1000, 5000])
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--proc-lookups", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="one JSON object per line (the default output)")
    args = parser.parse_args()
    for b in args.background:
        print(json.dumps(run(b, args.lookups, args.proc_lookups)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
