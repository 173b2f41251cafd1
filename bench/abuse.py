"""One well-behaved client's latency while hostile callers pile up grants, watchers and idle connections.

    python bench/abuse.py --json                      # N = 0, 1000 (default config)
    python bench/abuse.py --n 0 1000 10000 --json
    python bench/abuse.py --n 0 1000 --raise-quotas --json

What runs. `vgpu serve --backend sim:h100-80gb` as a child process on a temporary state directory
(as a daemon runs; the WAL is fsynced on every change). For each N, on a fresh daemon, once it serves
and its forecaster has loaded (the socket serves seconds before that; a measurement taken meanwhile
shares the daemon with the model's loading):

0. the well-behaved application's channel connects (before anything piles up);
1. N grants are requested with the operator token, spread over N/32 applications (1 MiB each);
2. N `WatchAllocations` streams are opened (as anonymous callers, over N/16 connections: a connection
   carries at most `server.max_streams_per_connection` calls) and never read;
3. N idle connections are opened to the socket (connected, never a byte sent) by a child process
   that runs as another user (`--pile-uid`, default 65534 when the bench runs as root: the issue's
   case, one local user against another; without root, the bench's own uid). The daemon's front
   closes at once any beyond `server.max_connections_per_uid` for that uid (and beyond
   `server.max_connections` in all): `idle_connections_refused` counts those. The daemon closes a
   connection that never speaks 10 s after it opened; the pile opens such a one again at once
   (`idle_connections_reopened`), so the pile stays in place for the whole measurement, and
   `idle_connections_held` is what the daemon still held at its end. `new_client_served` says
   whether a client connecting right after the pile-up, before the pairs, was served;
each pile-up goes on until N or until the daemon refuses (its quotas: `server.max_grants_per_*`,
`server.max_watchers*`); how many were accepted is reported. When the node's grant quota is reached,
two piled grants are released so the well-behaved client has room (a full node refuses everyone). `--raise-quotas` lifts the quotas to
N + 1000, so what piled-up state itself costs can be measured; `--pile grants` (or `watchers`,
`connections`, comma-separated) piles up only those.

`--peer-credentials off` runs the daemon without its socket front (gRPC on the socket, no per-uid
bound), for comparison.

Then the well-behaved application does `--pairs` request + release pairs in sequence (1 MiB,
anonymous, its own token after the first) and the latency of each pair is measured (1000 pairs by
default: the p99 is then the 10th slowest, not the 2nd). Printed, per N:

    {"n", "grants_accepted", "watchers_accepted", "idle_connections", "idle_connections_refused",
     "idle_connections_reopened", "idle_connections_held", "new_client_served", "pair_p50_ms",
     "pair_p99_ms", "daemon_rss_mib", "refusals": {...}}

with, once, the pile's uid and the daemon's connection bounds, and at the end the target check:
p99 at each N within 2x of N = 0 and RSS within +100 MiB. No figure is tuned here; on a slow or
shared machine, say so with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vgpu import auth  # noqa: E402
from vgpu import config as vconfig  # noqa: E402
from vgpu.v1 import allocator_pb2 as pb  # noqa: E402
from vgpu.v1 import allocator_pb2_grpc as pb_grpc  # noqa: E402

NOBODY = 65534


def _started(log: bytes) -> bool:
    """Whether the daemon's log says it serves and its forecaster has loaded (or fallen back)."""
    return b'"serving"' in log and (b'"forecaster_loaded"' in log or b'"forecaster_fallback"' in log)


@contextlib.contextmanager
def daemon(tmp: Path, env_extra: dict[str, str], socket_group: str = "") -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    sock, state = tmp / "vgpu.sock", tmp / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
    env.update({"PYTHONPATH": str(ROOT), **env_extra})
    log = open(tmp / "serve.log", "w")  # noqa: SIM115
    group = ["--socket-group", socket_group] if socket_group else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(sock), "--state-dir", str(state),
         "--backend", "sim:h100-80gb", "--metrics-port", "0", *group],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
    )
    try:
        # The socket serves before the forecaster has loaded (torch and the model load in a background
        # thread, seconds); the measurement starts once it has, so that it sees the daemon at work, not
        # the daemon starting.
        deadline = time.monotonic() + 120
        log_path = tmp / "serve.log"
        while not _started(log_path.read_bytes()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        yield proc, sock, state
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def hold_pile(sock: str, n: int, settle_s: float = 1.0) -> int:
    """The idle-connection pile (run in a child process, as the pile's user): open `n` connections
    that never send a byte, print {"held", "refused"} once the daemon has had `settle_s` to refuse
    some, then keep the held ones in place, opening again at once each one the daemon closes (its
    handshake timeout), until stdin closes; then print {"held", "reopened", "reopen_refused"}."""
    def connect() -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(sock)
        except OSError:
            s.close()
            return None
        s.setblocking(False)
        return s

    opened = [s for s in (connect() for _ in range(n)) if s is not None]
    time.sleep(settle_s)
    held = [s for s in opened if _still_open(s)]
    for s in opened:
        if s not in held:
            s.close()
    print(json.dumps({"held": len(held), "refused": n - len(held)}), flush=True)
    reopened = reopen_refused = 0
    while not select.select([sys.stdin], [], [], 0.2)[0]:
        for i, s in enumerate(held):
            if _still_open(s):
                continue
            s.close()
            fresh = connect()
            if fresh is not None:
                time.sleep(0.01)  # the front refuses at accept: a refused one reads end-of-file at once
                if _still_open(fresh):
                    held[i] = fresh
                    reopened += 1
                    continue
                fresh.close()
            reopen_refused += 1
            held[i] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # closed stand-in, tried again
    print(json.dumps({"held": sum(_still_open(s) for s in held), "reopened": reopened,
                      "reopen_refused": reopen_refused}), flush=True)
    for s in held:
        s.close()
    return 0


def start_pile(sock: Path, n: int, uid: int | None) -> subprocess.Popen[str]:
    """`hold_pile` in a child process, as `uid` (root only; None: the bench's own uid)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pile-child", str(sock), str(n)]
    if uid is not None:
        cmd += ["--pile-uid", str(uid)]
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _refusal(counts: dict[str, int], err: grpc.RpcError) -> None:
    key = f"{err.code().name}: {str(err.details())[:120]}"
    counts[key] = counts.get(key, 0) + 1


def _still_open(s: socket.socket) -> bool:
    """Whether the daemon still holds a connection that sent nothing. What the daemon sent (its
    settings frame) is read and dropped: a peek would see those bytes even after the close."""
    if s.fileno() < 0:
        return False
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return False  # end of file: closed by the daemon
    except BlockingIOError:
        return True
    except OSError:
        return False


def measure(n: int, pairs: int, raise_quotas: bool, pile: set[str], pile_uid: int | None,
            front: bool = True) -> dict[str, Any]:
    extra = {"VGPU_SERVER_PEER_CREDENTIALS": "true" if front else "false"}
    if raise_quotas:
        extra |= {"VGPU_SERVER_MAX_GRANTS_PER_APP": str(n + 1000), "VGPU_SERVER_MAX_GRANTS_PER_NODE": str(n + 1000),
                 "VGPU_SERVER_MAX_WATCHERS_PER_CALLER": str(n + 1000), "VGPU_SERVER_MAX_WATCHERS": str(n + 1000)}
    refusals: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vgpu-abuse-")))
        group = ""
        if pile_uid is not None:  # the pile's user must reach the socket: the directory and the group
            os.chmod(d, 0o711)
            group = grp.getgrgid(NOBODY).gr_name
        proc, sock, state = stack.enter_context(daemon(d, extra, group))
        op = auth.bearer(auth.read_token_file(auth.role_token_file("operator", state)))
        main = grpc.insecure_channel(f"unix:{sock}")
        grpc.channel_ready_future(main).result(timeout=30)  # connected before anything piles up
        stub = pb_grpc.AllocatorStub(main)
        piled: list[str] = []
        for i in range(n if "grants" in pile else 0):
            try:
                piled.append(stub.RequestResourceAllocation(pb.RequestResourceAllocationRequest(
                    request=pb.ResourceRequest(app_id=f"pile{i // 32}", memory_mib=1.0)), metadata=op,
                    timeout=30).grant.grant_id)
            except grpc.RpcError as err:
                _refusal(refusals, err)
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_grants_per_node" in str(err.details()):
                    # the node is full: leave room for the well-behaved client's one grant
                    for grant_id in piled[-2:]:
                        stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=grant_id), metadata=op, timeout=30)
                    piled = piled[:-2]
                    break
        grants = len(piled)
        n_watch = n if "watchers" in pile else 0
        # a connection carries at most server.max_streams_per_connection calls, and channels with the same
        # options share one connection: each channel gets its own (a local subchannel pool) and that many
        per_channel = vconfig.ServerConfig().max_streams_per_connection
        channels = [grpc.insecure_channel(f"unix:{sock}", options=(("grpc.use_local_subchannel_pool", 1),))
                    for _ in range(-(-n_watch // per_channel))]
        watches: list[Any] = []
        watchers = 0
        for i in range(n_watch):
            call: Any = pb_grpc.AllocatorStub(channels[i % len(channels)]).WatchAllocations(
                pb.WatchAllocationsRequest(), timeout=3600)
            try:
                call.initial_metadata()  # sent once the watch is registered; a refusal ends the call first
                if call.done():
                    raise call  # the call is the RpcError of its refusal
                watches.append(call)
                watchers += 1
            except grpc.RpcError as err:
                _refusal(refusals, err)
                if "max_watchers" in str(err.details()):
                    break
        n_idle = n if "connections" in pile else 0
        holder = start_pile(sock, n_idle, pile_uid) if n_idle else None
        first = json.loads(holder.stdout.readline()) if holder is not None and holder.stdout else {"held": 0, "refused": 0}
        # a client that connects now, with everything piled up
        fresh = grpc.insecure_channel(f"unix:{sock}")
        try:
            pb_grpc.AllocatorStub(fresh).GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=5)
            new_client_served = True
        except grpc.RpcError:
            new_client_served = False
        fresh.close()
        # the well-behaved application (its channel connected before the pile-up)
        app_md: tuple[tuple[str, str], ...] = ()
        lat_ms = []
        for k in range(pairs + 10):
            t0 = time.perf_counter()
            reply, done = stub.RequestResourceAllocation.with_call(pb.RequestResourceAllocationRequest(
                request=pb.ResourceRequest(app_id="good", memory_mib=1.0)), metadata=app_md, timeout=30)
            token = dict(done.trailing_metadata() or ()).get(auth.APP_TOKEN_TRAILER)
            if token:
                app_md = auth.bearer(str(token))
            stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=reply.grant.grant_id), metadata=app_md,
                                  timeout=30)
            if k >= 10:  # the first pairs warm the connection and claim the id
                lat_ms.append((time.perf_counter() - t0) * 1000)
        rss_mib = psutil.Process(proc.pid).memory_info().rss / 2**20
        last = {"held": 0, "reopened": 0, "reopen_refused": 0}
        if holder is not None and holder.stdin is not None and holder.stdout is not None:
            holder.stdin.close()
            last = json.loads(holder.stdout.readline())
            holder.wait(30)
        for c in watches:
            c.cancel()
        for ch in channels:
            ch.close()
        main.close()
    return {
        "n": n,
        "grants_accepted": grants,
        "watchers_accepted": watchers,
        "idle_connections": n_idle,
        "idle_connections_refused": first["refused"],
        "idle_connections_reopened": last["reopened"],
        "idle_connections_held": last["held"],
        "new_client_served": new_client_served,
        "pair_p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
        "pair_p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
        "daemon_rss_mib": round(rss_mib, 1),
        "refusals": refusals,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[0, 1000])
    p.add_argument("--pairs", type=int, default=1000)
    p.add_argument("--raise-quotas", action="store_true")
    p.add_argument("--pile", default="grants,watchers,connections",
                   help="what piles up, comma-separated (default all three)")
    p.add_argument("--pile-uid", type=int, default=None,
                   help=f"uid the idle connections come from (root only; default {NOBODY} as root, else the bench's own)")
    p.add_argument("--peer-credentials", choices=("on", "off"), default="on",
                   help="the daemon's socket front (server.peer_credentials; off: gRPC on the socket, no per-uid bound)")
    p.add_argument("--pile-child", nargs=2, metavar=("SOCKET", "N"), help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the idle connections are ours too
    if ns.pile_child:
        if ns.pile_uid is not None:  # everything is imported: become the pile's user
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(ns.pile_uid)
        return hold_pile(ns.pile_child[0], int(ns.pile_child[1]))
    pile_uid = ns.pile_uid if ns.pile_uid is not None else (NOBODY if os.geteuid() == 0 else None)
    if pile_uid is not None and os.geteuid() != 0:
        p.error("--pile-uid needs root")
    pile = set(ns.pile.split(","))
    front = ns.peer_credentials == "on"
    rows = [measure(n, ns.pairs, ns.raise_quotas, pile, pile_uid, front) for n in ns.n]
    base = next((r for r in rows if r["n"] == 0), rows[0])
    defaults = vconfig.ServerConfig()
    out = {
        "machine": f"{os.cpu_count()} cpus, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "raise_quotas": ns.raise_quotas,
        "pile": sorted(pile),
        "pile_uid": pile_uid if pile_uid is not None else os.geteuid(),
        "bench_uid": os.geteuid(),
        "peer_credentials": front,
        "max_connections": defaults.max_connections,
        "max_connections_per_uid": defaults.max_connections_per_uid if front else None,
        "pairs": ns.pairs,
        "rows": rows,
        "p99_within_2x": all(r["pair_p99_ms"] <= 2 * base["pair_p99_ms"] for r in rows),
        "rss_within_100_mib": all(r["daemon_rss_mib"] <= base["daemon_rss_mib"] + 100 for r in rows),
    }
    print(json.dumps(out, indent=None if ns.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
