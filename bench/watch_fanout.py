"""What one WatchAllocations stream costs the daemon per allocation event, in CPU time.

    python bench/watch_fanout.py --json                 # 16 streams that read every event
    python bench/watch_fanout.py --no-read --json       # 16 streams that never read (the abuse pile)
    python bench/watch_fanout.py --repeat 5 --json      # five measurements, each reported

What runs, in this process: the daemon's servicer stack on the simulated H100 (an `Allocator` with no
store, `AllocatorServicer`, the daemon's `AuthInterceptor`, `build_server` on a Unix socket), and the
allocator's own request + release pairs (2 events each, no RPC) on the server's event loop, with a
0.5 ms pause after each pair so the streams are written between events, as between a client's
calls. First `--pairs` pairs with no watcher, then a child process opens `--watchers` streams
(anonymous, every application's events, one channel each) and the same pairs run again. The
process's CPU time (user + system, every thread: the loop and gRPC's own) is read around each phase;
the pauses cost none, so the figure suffers less from other load on a shared machine than a latency:

    {"watchers", "read", "pairs", "cpu_per_pair_us_without", "cpu_per_pair_us_with",
     "us_per_event_per_stream", "events_serialized", "received", "in_order"}

`us_per_event_per_stream` = (CPU per pair with the streams - without) / (2 x watchers).

`--no-grpc` measures the Python part alone: each stream is the daemon's handler chain (the auth
interceptor's wrapper around `AllocatorServicer.WatchAllocations`, then the response serializer) run
as a task whose write is an already finished future; best of 5 rounds of `--pairs` pairs, with the
streams and again without them: {"no_grpc": true, "python_us_per_event_per_stream", ...}.
`events_serialized`: how many times an event was turned into bytes while the streams were open
(2 x pairs when each event is serialized once for every stream). With `--read`, `received` is
what each stream got (every one must get all 2 x pairs events) and `in_order` whether each got them
in the order they were published. With `--no-read` the child reads nothing: the streams are written
until their HTTP/2 windows fill (4 MiB each, about 32,000 events, well past this run's), as in
bench/abuse.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vgpu import auth  # noqa: E402
from vgpu import log as vlog  # noqa: E402
from vgpu.allocator import service  # noqa: E402
from vgpu.allocator.core import AllocationRequest, Allocator, device_capacities  # noqa: E402
from vgpu.allocator.ledger import Ledger  # noqa: E402
from vgpu.allocator.service import AllocatorServicer, build_server  # noqa: E402
from vgpu.daemon.serve import LedgerView  # noqa: E402
from vgpu.device.sim import SimBackend  # noqa: E402
from vgpu.v1 import allocator_pb2 as pb  # noqa: E402
from vgpu.v1 import allocator_pb2_grpc as pb_grpc  # noqa: E402


class NoClaims:
    """The token registry of an `AccessControl` here: no application has claimed its id (watchers
    are anonymous readers; the allocator's pairs bypass the RPC edge)."""

    def app_claimed(self, app_id: str) -> bool:
        return False

    def claim_app(self, app_id: str, uid: int | None = None) -> bool:
        return True

    def unclaim_app(self, app_id: str) -> bool:
        return False

    def claimed_count(self, uid: int | None = None) -> int:
        return 0

    def claim_uid(self, app_id: str) -> int | None:
        return None

    def claimed_by(self, uid: int) -> list[str]:
        return []


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def readers(sock: str, n: int, events: int, read: bool) -> int:
    """The child: `n` streams; with `read`, read `events` from each, then print what each got."""
    # a connection per stream, as each application's stub has: gRPC would otherwise share one among
    # channels of the same options, and the daemon holds at most 16 calls open on a connection
    channels = [grpc.insecure_channel(f"unix:{sock}", options=(("grpc.use_local_subchannel_pool", 1),))
                for _ in range(n)]
    calls: list[Any] = [pb_grpc.AllocatorStub(ch).WatchAllocations(pb.WatchAllocationsRequest(), timeout=3600)
                        for ch in channels]
    for call in calls:
        call.initial_metadata()  # the watch is registered
    print(json.dumps({"open": n}), flush=True)
    if not read:
        sys.stdin.read()
        return 0
    got = [0] * n
    ordered = [True] * n

    def run(k: int) -> None:
        last = ("", -1)
        for ev in calls[k]:
            got[k] += 1
            # grants are numbered in the order they are made: a release follows its grant
            key = (ev.grant.grant_id, ev.kind)
            ordered[k] = ordered[k] and key > last
            last = key
            if got[k] == events:
                break

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"received": sorted(set(got)), "in_order": all(ordered)}), flush=True)
    return 0


async def pairs(alloc: Allocator, n: int) -> None:
    for _ in range(n):
        g = alloc.request_allocation(AllocationRequest(app_id="good", memory_mib=1.0))
        alloc.release(g.grant_id)
        await asyncio.sleep(0.0005)


async def measure(watchers: int, n_pairs: int, read: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vgpu-fanout-") as tmp:
        backend = SimBackend(["h100-80gb"])
        numbers = itertools.count()
        # grant ids in the order they are made, so a reader can check the order it got them in
        ledger = Ledger(device_capacities(backend), id_factory=lambda: f"g{next(numbers):09d}")
        alloc = Allocator(backend, dry_run=False, ledger=ledger, max_watchers_per_caller=watchers,
                          max_watchers=watchers, drop_slow_watchers=True)
        access = auth.AccessControl(auth.TokenAuthority(Path(tmp) / "tokens"), NoClaims(), LedgerView(alloc))
        servicer = AllocatorServicer(alloc, identify=auth.identify_caller, watcher_owner=auth.caller_name)
        sock = f"{tmp}/s.sock"
        server = build_server(f"unix:{sock}", allocator_servicer=servicer, interceptors=[auth.AuthInterceptor(access)])
        await server.start()
        try:
            await pairs(alloc, 100)  # warm
            c0 = cpu_s()
            await pairs(alloc, n_pairs)
            without = (cpu_s() - c0) / n_pairs
            child = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--reader-child", sock, str(watchers),
                 str(2 * n_pairs), "1" if read else "0"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert child.stdout is not None and child.stdin is not None
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, child.stdout.readline)  # the streams are open
            while alloc.watchers < watchers:
                await asyncio.sleep(0.01)
            encoded0 = servicer.encoded_events.encoded if hasattr(servicer, "encoded_events") else 0
            c0 = cpu_s()
            await pairs(alloc, n_pairs)
            if read:
                line = await loop.run_in_executor(None, child.stdout.readline)  # every stream got every event
            with_w = (cpu_s() - c0) / n_pairs
            encoded = servicer.encoded_events.encoded - encoded0 if hasattr(servicer, "encoded_events") else None
            got = json.loads(line) if read else {"received": None, "in_order": None}
            child.stdin.close()
            child.wait(30)
        finally:
            alloc.end_watches()
            await server.stop(0)
    return {
        "watchers": watchers,
        "read": read,
        "pairs": n_pairs,
        "cpu_per_pair_us_without": round(without * 1e6, 1),
        "cpu_per_pair_us_with": round(with_w * 1e6, 1),
        "us_per_event_per_stream": round((with_w - without) * 1e6 / (2 * max(1, watchers)), 2),
        "events_serialized": encoded,
        **got,
    }


class _Take:
    """Takes the method handlers an add-servicer function registers, instead of a server."""

    def __init__(self) -> None:
        self.by_service: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, _handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
        self.by_service[name] = dict(handlers)


class _NoContext:
    """The servicer context a stream needs without gRPC: initial metadata goes nowhere."""

    async def send_initial_metadata(self, _metadata: object) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


async def measure_python(watchers: int, n_pairs: int) -> dict[str, Any]:
    alloc = Allocator(SimBackend(["h100-80gb"]), dry_run=False)
    servicer = AllocatorServicer(alloc)
    # the handler as the daemon registers it (a build without add_allocator_servicer: the generated one)
    add: Any = getattr(service, "add_allocator_servicer", pb_grpc.add_AllocatorServicer_to_server)
    taken = _Take()
    add(servicer, taken)
    handler = taken.by_service["vgpu.v1.Allocator"]["WatchAllocations"]

    async def before(_request: object, _context: object) -> tuple[str | None, bool]:
        return None, False

    async def after(_state: object, _context: object, _ok: bool) -> None:
        pass

    wrapped: Any = auth.wrap_handler(handler, before, after)
    serialize = wrapped.response_serializer
    loop = asyncio.get_running_loop()

    async def stream() -> None:
        async for message in wrapped.unary_stream(pb.WatchAllocationsRequest(), _NoContext()):
            serialize(message)
            sent: asyncio.Future[None] = loop.create_future()
            sent.set_result(None)
            await sent

    async def rounds() -> float:
        best = math.inf
        for _ in range(5):
            c0 = cpu_s()
            for _ in range(n_pairs):
                g = alloc.request_allocation(AllocationRequest(app_id="good", memory_mib=1.0))
                await asyncio.sleep(0)
                alloc.release(g.grant_id)
                await asyncio.sleep(0)
            best = min(best, cpu_s() - c0)
        return best

    tasks = [asyncio.create_task(stream()) for _ in range(watchers)]
    while alloc.watchers < watchers:
        await asyncio.sleep(0)
    with_w = await rounds()
    alloc.end_watches()
    await asyncio.gather(*tasks)
    without = await rounds()
    return {"no_grpc": True, "watchers": watchers, "pairs": n_pairs,
            "python_us_per_event_per_stream": round((with_w - without) * 1e6 / (2 * n_pairs * max(1, watchers)), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--watchers", type=int, default=16)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--read", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--no-grpc", action="store_true", help="the Python part alone (see the module docstring)")
    p.add_argument("--reader-child", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    if ns.reader_child:
        sock, n, events, read = ns.reader_child
        return readers(sock, int(n), int(events), read == "1")
    vlog.configure("json", "warning")  # each grant's info record is not what is measured
    for _ in range(ns.repeat):
        load = os.getloadavg()[0]
        if ns.no_grpc:
            out = asyncio.run(measure_python(ns.watchers, ns.pairs))
        else:
            out = asyncio.run(measure(ns.watchers, ns.pairs, ns.read))
        out["load_avg_1m"] = round(load, 2)
        print(json.dumps(out, indent=None if ns.json else 2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
